"""An independent, deliberately plain float64 implementation of the SkewAdam math (issue #2), for tests only.

One parameter (or one bank slice, treated as the separate expert it stands for) at a time, straight from the formulas;
nothing is shared with `skewadam.kernels`.
"""

from __future__ import annotations

import math

import torch


class RefParam:
    """Reference state and update of one parameter; ``bank`` splits it into independent slices along dim 0."""

    def __init__(self, value: torch.Tensor, *, momentum: bool, factored: bool, bank: bool):
        self.value = value.detach().to(torch.float64).clone()
        self.bank = bank
        units = [self.value[e] for e in range(self.value.shape[0])] if bank else [self.value]
        self.units = [
            _RefUnit(u.shape, momentum=momentum, factored=factored and u.dim() >= 2) for u in units
        ]

    def step(self, grad: torch.Tensor, **hp) -> None:
        grad = grad.to(torch.float64)
        if not self.bank:
            self.value = self.units[0].step(self.value, grad, **hp)
            return
        for e, unit in enumerate(self.units):
            if bool((grad[e] == 0).all()):  # an expert that received no token: skipped entirely
                continue
            self.value[e] = unit.step(self.value[e], grad[e], **hp)


class _RefUnit:
    def __init__(self, shape, *, momentum: bool, factored: bool):
        self.t = 0
        self.m = torch.zeros(shape, dtype=torch.float64) if momentum else None
        self.factored = factored
        if factored:
            self.row = torch.zeros(shape[:-1] + (1,), dtype=torch.float64)
            self.col = torch.zeros(shape[:-2] + (1, shape[-1]), dtype=torch.float64)
        else:
            self.v = torch.zeros(shape, dtype=torch.float64)

    def step(self, p, g, *, lr, betas, eps, eps_mode, weight_decay):
        b1, b2 = betas
        self.t += 1
        t = self.t
        g2 = g * g + (eps if eps_mode == "add" else 0.0)
        if self.factored:
            self.row = b2 * self.row + (1 - b2) * g2.mean(dim=-1, keepdim=True)
            self.col = b2 * self.col + (1 - b2) * g2.mean(dim=-2, keepdim=True)
            row_mean = self.row.mean(dim=-2, keepdim=True)
            if eps_mode == "floor":
                denom = torch.sqrt(torch.clamp(self.row / torch.clamp(row_mean, min=1e-15), min=eps))
                denom = denom * torch.sqrt(torch.clamp(self.col, min=eps))
            else:
                denom = torch.sqrt(self.row / row_mean) * torch.sqrt(self.col)
        else:
            self.v = b2 * self.v + (1 - b2) * g2
            denom = torch.sqrt(torch.clamp(self.v, min=eps)) if eps_mode == "floor" else torch.sqrt(self.v)
        if self.m is not None:
            self.m = b1 * self.m + (1 - b1) * g
            u = self.m * math.sqrt(1 - b2**t) / (1 - b1**t) / denom
        else:
            u = g * math.sqrt(1 - b2**t) / denom
        rms = torch.sqrt(torch.mean(u * u)).item()
        u = u / max(1.0, rms)
        return p * (1 - lr * weight_decay) - lr * u
