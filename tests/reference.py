"""An independent, deliberately plain float64 implementation of the SkewAdam math (issue #2), for tests only.

One parameter (or one bank slice, treated as the separate expert it stands for) at a time, straight from the formulas;
nothing is shared with `skewadam.kernels`. `RefParam` is the Adam-style tiers (with Adafactor's relative step and
second-moment decay as options, issue 17); `RefOrthogonal` the orthogonal tier (Muon's update, Newton-Schulz by
hand, one matrix at a time).
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

    def step(self, p, g, *, lr, betas, eps, eps_mode, weight_decay, relative_step=False, beta2_decay=None):
        b1, b2 = betas
        self.t += 1
        t = self.t
        if beta2_decay is not None:  # Adafactor: beta2_t = 1 - t^decay, an average that needs no bias correction
            b2 = 1.0 - t**beta2_decay
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
        corr2 = 1.0 if beta2_decay is not None else math.sqrt(1 - b2**t)
        if self.m is not None:
            self.m = b1 * self.m + (1 - b1) * g
            u = self.m * corr2 / (1 - b1**t) / denom
        else:
            u = g * corr2 / denom
        rms = torch.sqrt(torch.mean(u * u)).item()
        u = u / max(1.0, rms)
        step_size = lr * max(1e-3, torch.sqrt(torch.mean(p * p)).item()) if relative_step else lr
        return p * (1 - lr * weight_decay) - step_size * u


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration of one matrix, in float64, written out: on the wide orientation,
    ``X <- a X + (b A + c A A) X`` with ``A = X X^T``, from ``X = g / ||g||_F``."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.to(torch.float64)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.t()
    x = x / max(float(torch.sqrt((x * x).sum())), 1e-7)
    for _ in range(steps):
        gram = x @ x.t()
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.t() if transposed else x


class RefOrthogonal:
    """The orthogonal tier: ``p <- p (1 - lr wd) - lr 0.2 sqrt(max(A, B)) NS(u)`` with Nesterov momentum
    ``m <- mu m + (1 - mu) g``, ``u = (1 - mu) g + mu m`` (or ``u = g`` without momentum); a bank's slices are
    separate matrices, and a slice whose gradient is all zero is left untouched. ``steps``: `newton_schulz`'s;
    ``interval`` k: a matrix's weights move only at its steps t = k, 2k, ..., by
    ``p <- p (1 - k lr wd) - k lr 0.2 sqrt(max(A, B)) NS(u)``, its momentum at every step."""

    def __init__(self, value: torch.Tensor, *, momentum: bool, bank: bool, steps: int = 5, interval: int = 1):
        self.value = value.detach().to(torch.float64).clone()
        self.bank = bank
        self.steps, self.interval = steps, interval
        n = self.value.shape[0] if bank else 1
        self.m = [torch.zeros(self.value.shape[1:] if bank else self.value.shape, dtype=torch.float64)
                  for _ in range(n)] if momentum else None
        self.t = [0] * n

    def step(self, grad: torch.Tensor, *, lr, mu, weight_decay) -> None:
        grad = grad.to(torch.float64)
        for e in range(len(self.t)):
            g = grad[e] if self.bank else grad
            if self.bank and bool((g == 0).all()):
                continue
            self.t[e] += 1
            if self.m is not None:
                self.m[e] = mu * self.m[e] + (1 - mu) * g
                u = (1 - mu) * g + mu * self.m[e]
            else:
                u = g
            if self.t[e] % self.interval:
                continue
            p = self.value[e] if self.bank else self.value
            k_lr = self.interval * lr
            new = p * (1 - k_lr * weight_decay) - k_lr * 0.2 * math.sqrt(max(g.shape)) * newton_schulz(
                u, self.steps)
            if self.bank:
                self.value[e] = new
            else:
                self.value = new
