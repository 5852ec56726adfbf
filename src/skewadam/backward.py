"""The step inside backward (``SkewAdam(..., in_backward=True)``): each parameter is stepped as soon as its gradient
is complete, and the gradient freed, so no step holds every gradient at once.

`BackwardSteps` registers a post-accumulate-grad hook (``Tensor.register_post_accumulate_grad_hook``) on every
parameter of its optimizer that requires a gradient. The hook calls the optimizer's own step for that parameter
alone (`skewadam.functional.skewadam_` over the parameter's record, with the cross-shard reducer for DTensors: the
same update as the regular step, since every statistic SkewAdam needs is per tensor or per bank slice), then sets
``p.grad = None``. torch's engine runs a gradient's accumulation as soon as it is produced (``AccumulateGrad`` has the
highest priority), so the gradient memory in flight is about the largest gradient one backward node produces at once.
FSDP2 (``fully_shard``) runs these hooks itself on the sharded parameters after its reduce-scatter, in the same order
on every rank, so the reducer's collectives inside them line up.

``optimizer.step()`` then does the bookkeeping: the step hooks and LR schedulers run as usual (a scheduler's ``lr``
is read by the next backward's hooks), the non-finite skips are counted, and any gradient that backward did not step
(set by hand, accumulated under `BackwardSteps.hold`, or of a parameter without a hook) is stepped there by the
regular step. What cannot run inside backward is refused rather than silently done wrong:

- a second backward before ``step()`` (gradient accumulation) raises at the first parameter it would step twice;
  accumulate micro-batches under ``with optimizer.hold_gradients():`` (the hooks then leave the gradients to
  accumulate, holding them as the regular step does), or with FSDP2's ``set_requires_gradient_sync(False)``;
- a gradient set again after its parameter was stepped in backward (DDP all-reducing after the hooks) raises at
  ``step()`` naming the parameter;
- a non-finite gradient skips that tensor's update alone (its gradient is dropped): ``skipped_tensors`` counts them,
  ``skipped_steps`` the steps in which any was skipped; the regular step skips the whole step instead.

Global grad-norm clipping needs every gradient before any update; inside backward there is none left to clip, and a
``clip_grad_norm_`` after backward sees no gradient (it returns 0 and clips nothing). SkewAdam's RMS clip of each
update unit at 1.0 applies either way.

Example:
    >>> opt = SkewAdam.from_model(model, lr=3e-4, in_backward=True)
    >>> loss.backward(); opt.step(); opt.zero_grad()   # the parameters moved during backward
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["BackwardSteps", "InBackward", "check_trainer", "stacked"]

#: Each parameter's `BackwardSteps`: a parameter is stepped in backward by one optimizer at most.
_OWNERS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

_TWICE = ("{name} got a second gradient before optimizer.step(): with in_backward=True each gradient is stepped as "
          "soon as backward completes it, so a second backward (gradient accumulation) would step the micro-batches "
          "apart. Call optimizer.step() after every backward, or accumulate under `with optimizer.hold_gradients():` "
          "(the backwards inside it keep their gradients; the first backward after it steps their sum; under FSDP2, "
          "model.set_requires_gradient_sync(False) does the same), or use in_backward=False")
_REGROWN = ("{name} has a gradient again after it was stepped in backward: something wrote it after SkewAdam's hook "
            "(DistributedDataParallel all-reduces gradients after the hooks, so they stepped this rank's own "
            "gradients). Under DDP use in_backward=False, or shard with FSDP2 (fully_shard), whose hooks run after "
            "its reduce-scatter")


class BackwardSteps:
    """The gradient hooks of one optimizer in ``in_backward`` mode, and what they did since the last ``step()``.

    The hooks keep a weak reference to the optimizer: they are removed when it is garbage-collected, by `remove`
    (``optimizer.in_backward = False``), and never step a parameter the optimizer no longer holds.

    Attributes:
        stepped: ids of the parameters stepped in backward since the last ``step()``.
        skipped: each of those updates' skip flag (0-d bool tensors on the parameters' devices: no host sync).
        held: inside `hold`: the hooks leave the gradients to accumulate.

    Example:
        >>> steps = BackwardSteps(optimizer)   # what SkewAdam(..., in_backward=True) does
        >>> steps.remove()                     # what optimizer.in_backward = False does
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._handles: dict[int, Any] = {}
        self._where: dict[int, tuple[int, int]] = {}
        self.stepped: set[int] = set()
        self.skipped: list[Tensor] = []
        self.held = False
        weakref.finalize(optimizer, _remove_all, self._handles)
        try:
            for group in optimizer.param_groups:
                self.add(group["params"])
        except BaseException:
            self.remove()
            raise

    def add(self, params: Iterable[Tensor]) -> None:
        """Hook ``params`` (a new param group's); those that require no gradient get no hook (a gradient given to
        them by hand is stepped by ``step()``). Raises ValueError if another optimizer steps one in backward."""
        for p in params:
            if id(p) in self._handles or not p.requires_grad:
                continue
            other = _OWNERS.get(p)
            if other is not None and other() is not None and other() is not self:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is already stepped in backward by another "
                                 f"SkewAdam (a deepcopy sharing its parameters, or two optimizers over one model); "
                                 f"each parameter can be stepped in backward by one optimizer: set in_backward=False "
                                 f"on the other first")
            self._handles[id(p)] = p.register_post_accumulate_grad_hook(self._hook)
            _OWNERS[p] = weakref.ref(self)

    def remove(self) -> None:
        """Remove every hook (the optimizer steps after backward again)."""
        optimizer = self._optimizer()
        if optimizer is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) in self._handles and _OWNERS.get(p) is not None and _OWNERS[p]() is self:
                        del _OWNERS[p]
        _remove_all(self._handles)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Backwards inside keep their gradients (they accumulate); the first backward after it steps them."""
        held, self.held = self.held, True
        try:
            yield
        finally:
            self.held = held

    def finish(self, optimizer: torch.optim.Optimizer) -> list[Tensor]:
        """At ``step()``: refuse a gradient that came back after its parameter was stepped in backward, then return
        the skip flags of the updates done in backward and start the next step's record."""
        for index, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is not None and id(p) in self.stepped:
                    raise RuntimeError(_REGROWN.format(name=_name(group, index, i)))
        skipped, self.skipped = self.skipped, []
        self.stepped.clear()
        return skipped

    def _locate(self, optimizer: torch.optim.Optimizer, p: Tensor) -> Optional[tuple[int, int]]:
        """``(group index, position)`` of ``p`` in the optimizer's param groups, None if it holds ``p`` no more."""
        where = self._where.get(id(p))
        groups = optimizer.param_groups
        if where is not None and where[0] < len(groups) and where[1] < len(groups[where[0]]["params"]) \
                and groups[where[0]]["params"][where[1]] is p:
            return where
        self._where = {id(q): (index, i) for index, g in enumerate(groups) for i, q in enumerate(g["params"])}
        return self._where.get(id(p))

    def _hook(self, p: Tensor) -> None:
        optimizer = self._optimizer()
        if optimizer is None or self.held or p.grad is None:
            return
        where = self._locate(optimizer, p)
        if where is None:
            return
        if id(p) in self.stepped:
            raise RuntimeError(_TWICE.format(name=_name(optimizer.param_groups[where[0]], *where)))
        self.skipped.append(optimizer._step(only=where))
        self.stepped.add(id(p))
        p.grad = None


class InBackward:
    """``SkewAdam.in_backward``: whether each parameter is stepped inside backward; setting it adds or removes the
    gradient hooks (a `BackwardSteps` in the optimizer's ``_backward``)."""

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return self if obj is None else obj.__dict__.get("_backward") is not None

    def __set__(self, obj: Any, value: bool) -> None:
        current = obj.__dict__.get("_backward")
        if bool(value) != (current is not None):
            if current is not None:
                current.remove()
            obj._backward = BackwardSteps(obj) if value else None


def check_trainer(model: Any) -> None:
    """Refuse the settings of a trainer attached to ``model`` (a Lightning ``LightningModule``'s, in
    ``configure_optimizers``) that cannot run inside backward: global gradient clipping (``gradient_clip_val``: it
    would see no gradient), gradient accumulation, fp16 loss scaling (the hooks would step scaled gradients), DDP
    (it all-reduces after the hooks); ValueError naming each fix. A model without a trainer passes.

    Example:
        >>> check_trainer(lightning_module)   # SkewAdam.from_model(module, in_backward=True) calls it
    """
    trainer = getattr(model, "_trainer", None)
    if trainer is None:
        return
    fixes = []
    if getattr(trainer, "gradient_clip_val", None):
        fixes.append(f"gradient_clip_val={trainer.gradient_clip_val}: no gradient is left to clip after backward "
                     f"(SkewAdam RMS-clips each update unit at 1.0 anyway); leave it unset")
    if getattr(trainer, "accumulate_grad_batches", 1) > 1:
        fixes.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches}: each backward's gradients are "
                     f"stepped at once; use 1 with a larger batch")
    if str(getattr(trainer, "precision", "")).startswith("16"):
        fixes.append(f"precision={trainer.precision!r} scales the loss and the hooks would step scaled gradients; "
                     f"use 'bf16-mixed'")
    if "DDP" in type(getattr(trainer, "strategy", None)).__name__ and getattr(trainer, "world_size", 1) > 1:
        fixes.append("DDP all-reduces gradients after the hooks have stepped them; shard with FSDP2 "
                     "(ModelParallelStrategy)")
    if fixes:
        raise ValueError("SkewAdam in_backward=True cannot train under this trainer: " + "; ".join(fixes)
                         + "; or use in_backward=False")


def stacked(flags: list[Tensor]) -> Tensor:
    """The 0-d bool ``flags`` as one 1-d tensor on the first one's device (no host sync)."""
    first = flags[0].device
    return torch.stack([f.to(first) for f in flags])


def _name(group: dict, index: int, i: int) -> str:
    names = group.get("param_names")
    return f"param_groups[{index}]['params'][{i}]" + (f" ({names[i]!r})" if names else "")


def _remove_all(handles: dict[int, Any]) -> None:
    for handle in handles.values():
        handle.remove()
    handles.clear()
