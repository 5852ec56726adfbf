"""Update kernels: pure functions over the records of `skewadam.kernels.types` (one `Group` per param group), one
module per backend, the same passes in each (the protocol is in `types`), and `BACKENDS`, the one registry every other
module asks which backends exist, where they run and what they cost.

- ``eager``: torch ops, on any device (the reference path).
- ``cpp``: a C++ kernel for CPU tensors, compiled on first use and cached. Its ``step_`` runs the whole step of one
  process in one call.
- ``triton``: Triton kernels for CUDA tensors, a few launches per group and pass and no host sync (step counts, the
  skip flag and a tensor lr are read on the device). Under ``TRITON_INTERPRET=1`` (set before triton is first
  imported) they also run on CPU tensors, slowly: that is how they are tested without a GPU.

`resolve_backend` picks one for ``impl`` (``"auto"``, or a backend's name) and a device: ``"auto"`` is the
``SKEWADAM_IMPL`` environment variable when set, else the first backend of `BACKENDS` whose ``auto`` devices include
the device and that is available there (the C++ kernel on CPU when it builds, with one warning line when it cannot;
Triton on CUDA when triton imports), else eager. ``build=False`` answers from the registry alone, importing and
building nothing: the backend a machine where it is installed would run (the planner's question).

Example:
    >>> resolve_backend("auto", torch.device("cpu")).name   # 'cpp' where the C++ kernel builds, else 'eager'
    >>> BACKENDS["triton"].step_transient_bytes([((8, 64, 32), True)], torch.bfloat16)
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from types import ModuleType
from typing import Any, Optional, Sequence

import torch

__all__ = ["Backend", "BACKENDS", "BACKEND_CHOICES", "cpu_backends", "resolve_backend"]


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend: a module implementing the kernel protocol, and the facts other modules need about it.

    Attributes:
        name: what ``impl=`` and ``SKEWADAM_IMPL`` call it.
        summary: how the command line and the docs name it.
        module: the module implementing the passes (imported on first use: it may build or need a package).
        devices: device types it runs on (None: any).
        auto: device types on which ``impl="auto"`` prefers it when it is available.
        device_steps: its step counts live on the parameters' device (no host read per step).
        skip_on_host: a skip flag is read on the host (one sync per step on a GPU); else on the device.
        temporaries: the module whose ``step_transient_bytes`` counts its step temporaries, importable without the
            backend's toolchain (the planner asks it on machines that cannot run the backend).
        requires: what to install for it, for error messages.
    """

    name: str
    summary: str
    module: str
    devices: Optional[tuple[str, ...]]
    auto: tuple[str, ...]
    device_steps: bool
    skip_on_host: bool
    temporaries: str
    requires: str = ""

    def load(self) -> ModuleType:
        """The kernel module (built or imported on first use); raises what its import raises."""
        return importlib.import_module(self.module)

    def runs_on(self, device: torch.device | str) -> bool:
        """Whether its device types include ``device``'s, counting CPU for the Triton kernels in Triton's interpreter
        (``TRITON_INTERPRET=1``), as `available` does (not whether it builds or imports here: `available`)."""
        kind = torch.device(device).type
        return self.devices is None or kind in self.devices or \
            (self.name == "triton" and kind == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")

    def available(self, device: torch.device | str, warn: bool = False) -> bool:
        """Whether it runs on ``device`` here: it builds or imports, and takes that device's tensors (the Triton
        kernels take CPU tensors too under ``TRITON_INTERPRET=1``); ``warn``: say why not, once."""
        if self.name == "triton":
            try:
                module = self.load()
            except ImportError:
                return False
            return module.available(device)
        if not self.runs_on(device):
            return False
        if self.name == "cpp":
            from . import cpu

            return cpu.available(warn=warn)
        return True

    def step_transient_bytes(self, tensors: Sequence[Sequence[Any]], param_dtype: torch.dtype) -> int:
        """Peak bytes a step of parameters ``[(shape, bank), ...]`` or ``[(shape, bank, state, group), ...]``
        (`types.Planned`) allocates beyond parameters, gradients and state, at most: given the states and groups,
        closer to what the step allocates (Triton's exact)."""
        return importlib.import_module(self.temporaries).step_transient_bytes(tensors, param_dtype)


#: The backends, in ``auto``'s order of preference.
BACKENDS: dict[str, Backend] = {
    b.name: b for b in (
        Backend("triton", "the Triton GPU kernel", f"{__name__}.triton", ("cuda",), ("cuda",), device_steps=True,
                skip_on_host=False, temporaries=f"{__name__}.triton_layout", requires="pip install triton"),
        Backend("cpp", "the C++ CPU kernel", f"{__name__}.cpu", ("cpu",), ("cpu",), device_steps=False,
                skip_on_host=True, temporaries=f"{__name__}.cpu", requires="a C++ compiler and ninja"),
        Backend("eager", "the eager kernels (torch ops)", f"{__name__}.eager", None, (), device_steps=False,
                skip_on_host=True, temporaries=f"{__name__}.eager"),
    )
}
#: What ``impl`` (SkewAdam's argument, the command line's ``--impl``, ``SKEWADAM_IMPL``) takes: ``"auto"`` or a backend.
BACKEND_CHOICES = ("auto", *BACKENDS)


def cpu_backends(interpreted: bool = False) -> list[str]:
    """The backends that run on CPU tensors here, by name: ``eager``, and ``cpp`` when the C++ kernel builds; with
    ``interpreted``, also ``triton`` when its kernels run in Triton's interpreter (``TRITON_INTERPRET=1``:
    tests/conftest.py sets it without a GPU), minutes per test on the shapes the other kernels' tests use."""
    out = ["eager", "cpp"] if BACKENDS["cpp"].available("cpu") else ["eager"]
    if interpreted and os.environ.get("TRITON_INTERPRET") == "1":  # (triton is not imported otherwise)
        try:
            tk = BACKENDS["triton"].load()
        except ImportError:
            return out
        if tk.available("cpu"):
            out.append("triton")
    return out


def resolve_backend(impl: str, device: torch.device | str, *, build: bool = True) -> Backend:
    """The backend that runs tensors on ``device`` under the choice ``impl`` (``"auto"`` or a backend's name).

    ``build=False``: decided from the registry alone, nothing imported or built (the C++ extension is not compiled):
    the backend ``impl`` names, or the one ``"auto"`` prefers on ``device``'s type, as a machine where it is
    installed runs it; a named backend that does not run on ``device`` is refused either way.

    Example:
        >>> resolve_backend("auto", torch.device("cuda")).name  # 'triton', or 'eager' where triton does not import
        >>> resolve_backend("auto", "cpu", build=False).name     # 'cpp', whether or not it builds here
    """
    device = torch.device(device)
    if impl == "auto":
        impl = os.environ.get("SKEWADAM_IMPL", "auto")
        if impl not in BACKEND_CHOICES:
            raise ValueError(f"SKEWADAM_IMPL={impl!r} is not a backend: use one of {BACKEND_CHOICES}")
    if impl not in BACKEND_CHOICES:
        raise ValueError(f"Invalid impl: {impl!r} (expected one of {BACKEND_CHOICES})")
    if impl == "auto":
        for backend in BACKENDS.values():
            if device.type in backend.auto and (not build or backend.available(device, warn=True)):
                return backend
        return BACKENDS["eager"]
    backend = BACKENDS[impl]
    if (not build and backend.runs_on(device)) or (build and backend.available(device)):
        return backend
    others = ", ".join(f"impl={b.name!r} ({b.summary})" for b in BACKENDS.values() if b.name != impl)
    if not backend.runs_on(device):
        where = " and ".join(d.upper() for d in backend.devices or ())
        raise ValueError(f"impl={impl!r} runs on {where} tensors ({backend.summary}), got tensors on {device}: use "
                         f"impl='auto', or {others}")
    if backend.name == "cpp":
        from . import cpu

        cpu.load()  # raises, saying why it cannot build
    hint = " (to test the Triton kernels on CPU, set TRITON_INTERPRET=1 before triton is first imported)" \
        if backend.name == "triton" else ""
    raise ValueError(f"impl={impl!r} ({backend.summary}) is not available here: it needs {backend.requires}{hint}; "
                     f"use impl='auto' or {others}")
