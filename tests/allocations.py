"""`Allocations`: the peak bytes of tensor storages a block of code creates (exact tensor accounting, no allocator),
for tests of what a step allocates beyond its inputs.

Example:
    >>> with Allocations() as tracked:
    ...     torch.ones(256)
    >>> tracked.peak
    1024
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Allocations"]


class Allocations(TorchDispatchMode):
    """Peak bytes of live tensor storages created inside the mode (exact tensor accounting, no allocator), on
    ``device`` if given (device memory, not a pinned staging copy)."""

    def __init__(self, device=None) -> None:
        super().__init__()
        self.device = None if device is None else torch.device(device)
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or (self.device is not None and t.device != self.device):
                continue
            s = t.untyped_storage()
            ptr, n = s.data_ptr(), s.nbytes()
            if ptr in inputs or ptr in self._seen or n == 0:  # in-place results and known storages
                continue
            self._seen.add(ptr)
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(s, self._free, ptr, n)
        return out

    def _free(self, ptr: int, n: int) -> None:
        self._seen.discard(ptr)
        self.live -= n
