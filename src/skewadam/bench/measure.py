"""Memory of real training steps, beside `skewadam.bench.planner.plan`'s estimate: `measure_peak`, and the process RSS.

On CPU the peak resident set size of a process cannot be reset, so `measure_peak` trains in a fresh Python process
(``python -m skewadam.bench.measure ARGS_JSON``, which prints its result as one JSON line).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable, Optional

import torch
from torch import nn

from .. import kernels
from . import arms
from .activations import config_value
from .planner import DTYPES, default_seq, plan
from .presets import lm_losses, load_model

__all__ = ["measure_peak", "train_steps", "peak_rss", "rss"]


def rss() -> int:
    """Resident set size of this process now, in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """Peak resident set size of this process's own address space, in bytes (``VmHWM``; Linux).

    Not ``getrusage(...).ru_maxrss``: Linux carries that across ``fork``/``exec``, so a process started by a large
    parent (a long pytest session, say) reports the parent's size as its own peak.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line: peak RSS is only measured on Linux")


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, batch: int, seq: int, steps: int,
                progress: Optional[Callable[[int], None]] = None) -> None:
    """``steps`` training steps of a language model (ours or a Transformers one) on seeded random tokens;
    ``progress(step)`` after each."""
    vocab = config_value(model, ("vocab_size",))
    device = next(model.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(0)
    for step in range(1, steps + 1):
        idx = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        tgt = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        out = lm_losses(model, idx, tgt)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out
        if progress:
            progress(step)


def _measure_here(spec: str, overrides: dict, optimizer: str, batch: int, seq: int, param_dtype: str,
                  device: str, steps: int, impl: str, in_backward: bool = False,
                  progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Train ``steps`` steps in this process and return the measured peak growth (see `measure_peak`); each stage is
    told to ``progress``."""
    t0 = time.perf_counter()

    def tell(what: str) -> None:
        progress(f"{what} ({time.perf_counter() - t0:.0f} s)")

    dtype = DTYPES[param_dtype]
    arm = arms.get(optimizer)
    torch.manual_seed(0)
    # Warm up the same code paths on the tiny reference model, so that lazily loaded kernels and thread pools are
    # part of the baseline, not of the measurement.
    warm = load_model("tiny", device=device, dtype=dtype)
    train_steps(warm, _build(arm, warm, impl, in_backward), 2, 16, 2)
    tell("warmed up on the tiny model")
    del warm
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = rss()
    model = load_model(spec, device=device, dtype=dtype, overrides=overrides)
    tell(f"built {spec} on {device}")
    train_steps(model, _build(arm, model, impl, in_backward), batch, seq, steps,
                lambda step: tell(f"step {step}/{steps}"))
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = peak_rss() - base
    return {"measured": peak, "method": "cuda max_memory_allocated" if device == "cuda" else "peak RSS growth"}


def _build(arm: arms.Arm, model: nn.Module, impl: str, in_backward: bool):
    """The arm's optimizer over ``model``; SkewAdam's arms stepped inside backward with ``in_backward``."""
    opt = arm.build(model, impl=impl)
    if in_backward and arm.kernels:
        opt.in_backward = True
    return opt


def measure_peak(
    spec: str,
    *,
    optimizer: str = "skewadam",
    batch: int = 1,
    seq: Optional[int] = None,
    param_dtype: str = "fp32",
    device: str = "cpu",
    steps: int = 2,
    overrides: Optional[dict[str, Any]] = None,
    impl: Optional[str] = None,
    in_backward: bool = False,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Measure the peak memory of real training steps and set it beside `plan`'s estimate.

    The model (``spec``: preset or ``config.json``, with config ``overrides``) is built on ``device`` and trained
    ``steps`` steps on random tokens by the arm ``optimizer`` (`skewadam.bench.arms`). CPU: the growth of the peak
    resident set size (``VmHWM``) over the resident size after a warm-up, in a fresh Python process (the peak RSS of
    this one is not resettable). CUDA: ``torch.cuda.max_memory_allocated`` growth, in this process.

    SkewAdam steps with the backend ``impl`` (a name of `skewadam.kernels.BACKENDS`; None or ``"auto"``: the one
    `skewadam.kernels.resolve_backend` picks on ``device``), and the estimate is the plan's peak with that backend
    (``impl`` in the result); with ``in_backward`` a SkewAdam arm steps inside backward (planned so too).
    ``progress`` is told each stage (warm-up, model built, each step) as it ends.

    Returns:
        ``{"measured", "estimate", "ratio" (measured / estimate), "method", "impl", ...}``, bytes.

    Example:
        >>> measure_peak("cpu", optimizer="adamw", batch=16, seq=128)["ratio"]
    """
    overrides = dict(overrides or {})
    optimizer = arms.get(optimizer).name
    meta = load_model(spec, device="meta", overrides=overrides)
    seq = default_seq(meta) if seq is None else seq
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: use 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but torch.cuda.is_available() is False")
    impl = kernels.resolve_backend(impl or "auto", torch.device(device)).name  # raises if it does not run there
    estimate = plan(meta, batch=batch, seq=seq, param_dtype=param_dtype, optimizers=[optimizer], impl=impl,
                    device=device, in_backward=in_backward)[optimizer].peak
    args = dict(spec=os.fspath(spec), overrides=overrides, optimizer=optimizer, batch=batch, seq=seq,
                param_dtype=param_dtype, device=device, steps=steps, impl=impl, in_backward=in_backward)
    if device == "cuda":
        result = _measure_here(**args, progress=progress)
    else:
        result = _measure_in_child(args, progress)
    return {**args, **result, "estimate": estimate, "ratio": result["measured"] / estimate}


_PROGRESS = "progress: "


def _measure_in_child(args: dict[str, Any], progress: Callable[[str], None]) -> dict[str, Any]:
    """`_measure_here` in a fresh process (stepping with ``args["impl"]``, not whatever "auto" finds there): its
    progress lines passed on as they come, its result read from its last stdout line."""
    proc = subprocess.Popen([sys.executable, "-m", "skewadam.bench.measure", json.dumps(args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    errors = []
    for line in proc.stderr:  # stdout holds one line, written at the end: no deadlock reading stderr first
        if line.startswith(_PROGRESS):
            progress(line[len(_PROGRESS):].rstrip("\n"))
        else:
            errors.append(line)
    out = proc.stdout.read()
    if proc.wait():
        raise RuntimeError(f"measuring in a fresh process failed:\n{''.join(errors)[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":  # the fresh process of `measure_peak` on CPU: its result on stdout, one JSON line
    def _tell(line: str) -> None:
        print(_PROGRESS + line, file=sys.stderr, flush=True)

    sys.stdout.write(json.dumps(_measure_here(**json.loads(sys.argv[1]), progress=_tell)) + "\n")
