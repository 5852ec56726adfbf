"""The step inside backward (``SkewAdam(..., in_backward=True)``): each parameter is stepped as soon as its gradient
is complete, and the gradient freed, so no step holds every gradient at once.

`BackwardSteps` registers a post-accumulate-grad hook (``Tensor.register_post_accumulate_grad_hook``) on every
parameter of its optimizer that requires a gradient. The hook calls the optimizer's step of that parameter alone
(`ParamStepper.step_parameter`, the interface this module defines and `skewadam.SkewAdam` satisfies:
`skewadam.functional.skewadam_` over the parameter's record, with the cross-shard reducer for DTensors: the same
update as the regular step, since every statistic SkewAdam needs is per tensor or per bank slice), then sets
``p.grad = None``. torch's engine runs a gradient's accumulation as soon as it is produced (``AccumulateGrad`` has the
highest priority), so the gradient memory in flight is about the largest gradient one backward node produces at once.
FSDP2 (``fully_shard``) runs these hooks itself on the sharded parameters after its reduce-scatter, in the same order
on every rank, so the reducer's collectives inside them line up.

``optimizer.step()`` then does the bookkeeping: the step hooks and LR schedulers run as usual (a scheduler's ``lr``
is read by the next backward's hooks), the non-finite skips are counted, and any gradient that backward did not step
(set by hand, accumulated under `BackwardSteps.hold`, deferred, or of a parameter without a hook) is stepped there by
the regular step. What cannot run inside backward is refused before anything moves, or done as the regular step
does it (docs/guide/in-backward.md lists both):

- a second backward before ``step()`` (gradient accumulation, or a backward after a ``zero_grad()``, which cannot
  undo the steps already taken) raises at its first hook, nothing of it stepped; accumulate micro-batches under
  ``with optimizer.hold_gradients():`` (the hooks then leave the gradients to accumulate, holding them as the
  regular step does), or with FSDP2's ``set_requires_gradient_sync(False)``. A backward that raised midway (its
  final callback never ran) is no second backward: the next one starts a new record, whichever ``zero_grad`` ran;
- a backward that keeps its graph (``retain_graph=True``, ``create_graph=True``) raises at its first hook: stepping
  in place would change weights the kept graph saved;
- reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``) runs a nested backward
  per segment, so a weight a segment uses can get its gradient in several pieces: a gradient that arrives inside a
  nested backward is left to accumulate, and so is, in later backwards, an outer gradient of a weight segments use
  (all of them in the first backward that has segments); ``step()`` steps their sums;
- ``zero_grad(set_to_none=False)`` keeps a zero gradient for every parameter the hooks freed: one the next backward
  does not reach is stepped by ``step()`` with that zero gradient, as the regular step does;
- a backward of a loss that a ``torch.amp.GradScaler`` scaled (``scaler.scale(loss).backward()``: its root is a
  product with a constant while an enabled GradScaler is alive, `_scaled`) holds its gradients, so
  ``scaler.step(optimizer)`` takes torch's own path (unscale, inf check, ``step()`` of the held gradients); a
  scaled loss it cannot recognise (changed after scaling) raises at ``scaler.step``;
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
import gc
import sys
import threading
import weakref
from typing import Any, ContextManager, Iterable, Iterator, Optional, Protocol

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["BackwardMode", "BackwardSteps", "ParamStepper", "Counter", "check_trainer", "stacked"]

#: Each parameter's `BackwardSteps`: a parameter is stepped in backward by one optimizer at most.
_OWNERS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
#: The Python frames that bracket a reentrant backward: torch's engine call, and a custom Function's backward.
_ENGINE = torch.autograd.graph._engine_run_backward.__code__
_NODE = BackwardCFunction.apply.__code__

_TWICE = ("{name} got a gradient from a second backward before optimizer.step(): with in_backward=True each "
          "gradient is stepped as soon as backward completes it, and the last backward's were, so a second one "
          "(gradient accumulation, or a backward after zero_grad(), which cannot undo those steps) would step the "
          "batches apart. Call optimizer.step() after every backward, or accumulate under `with "
          "optimizer.hold_gradients():` (the backwards inside it keep their gradients; the first backward after it "
          "steps their sum; under FSDP2, model.set_requires_gradient_sync(False) does the same), or use "
          "in_backward=False")
_REGROWN = ("{name} has a gradient again after it was stepped in backward: something wrote it after SkewAdam's hook "
            "(DistributedDataParallel all-reduces gradients after the hooks, so they stepped this rank's own "
            "gradients). Under DDP use in_backward=False, or shard with FSDP2 (fully_shard), whose hooks run after "
            "its reduce-scatter")
_RETAINED = ("a backward that keeps its graph (retain_graph=True or create_graph=True) cannot step inside backward: "
             "the step changes weights in place that the kept graph saved, so a second backward through it would "
             "fail. Run the backwards that share a graph under `with optimizer.hold_gradients():` (the last one, "
             "outside it and without retain_graph, steps their sum), or use in_backward=False; nothing was stepped")
_SEGMENT = ("{name} got a gradient inside a reentrant activation checkpoint (torch.utils.checkpoint(..., "
            "use_reentrant=True)) after it was stepped in this backward: it is used inside a checkpointed segment "
            "and after it, which the first backward did not show (the model changed since). Use "
            "use_reentrant=False, or rebuild the optimizer after changing the model; this step used part of its "
            "gradient, so resume from a checkpoint")
_SCALED = ("torch.amp.GradScaler steps an optimizer whose hooks stepped the backward before this call: its loss was "
           "not recognised as scaled (it was changed after scaler.scale(), e.g. divided, or several scaled losses "
           "were summed or scaled as one list), so scaled gradients were stepped (resume from a checkpoint). "
           "Call scaler.scale(loss).backward() on the final loss (SkewAdam then holds that backward's gradients "
           "for scaler.step), or run the backward under `with optimizer.hold_gradients():`, or train in bf16 "
           "(torch.autocast(..., dtype=torch.bfloat16) needs no scaler), or use in_backward=False")


class ParamStepper(Protocol):
    """What `BackwardSteps` needs of its optimizer (`skewadam.SkewAdam` satisfies it): its param groups, and the step
    of one parameter alone."""

    param_groups: list[dict[str, Any]]

    def step_parameter(self, group: int, position: int) -> Tensor:
        """Step parameter ``position`` of param group ``group`` alone, with its gradient, as the regular step steps
        it (the same update, its cross-shard reductions included); return its skip flag: a 0-d bool tensor on the
        parameter's device, True where a non-finite gradient skipped the update."""
        ...


class BackwardSteps:
    """The gradient hooks of one optimizer in ``in_backward`` mode, and what they did since the last ``step()``.

    The hooks keep a weak reference to the optimizer: they are removed when it is garbage-collected, by `remove`
    (``optimizer.in_backward = False``), and never step a parameter the optimizer no longer holds.

    Attributes:
        stepped: ids of the parameters stepped in backward since the last ``step()`` (or since the backward that
            raised before the running one started).
        skipped: each of those updates' skip flag (0-d bool tensors on the parameters' devices: no host sync).
        held: inside `hold`: the hooks leave the gradients to accumulate.
        freed: ids of the parameters whose gradient a hook freed since the last ``zero_grad(set_to_none=True)``:
            the regular step would still hold a gradient tensor for each.
        zeroed: ids of those whose gradient ``zero_grad(set_to_none=False)`` kept as zeros and no backward has
            reached since: ``step()`` steps them with a zero gradient.
        segmented: ids of the parameters whose gradient arrived inside a reentrant backward (a checkpointed
            segment's): their gradients are left to accumulate for ``step()``.

    Example:
        >>> steps = BackwardSteps(optimizer)   # what SkewAdam(..., in_backward=True) does
        >>> steps.remove()                     # what optimizer.in_backward = False does
    """

    def __init__(self, optimizer: ParamStepper) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._handles: dict[int, Any] = {}
        self._where: dict[int, tuple[int, int]] = {}
        self.stepped: set[int] = set()
        self.skipped: list[Tensor] = []
        self.held = False
        self.freed: set[int] = set()
        self.zeroed: set[int] = set()
        self.segmented: set[int] = set()
        self._task: tuple[int, str] = (-2, "")  # the running backward's graph task id and what it is (`_kind`)
        self._outer: tuple[int, str] = (-2, "")  # the same of the last outermost backward a hook ran in
        self._done = True  # whether that backward completed (the engine ran its final callback)
        self._probed = False  # whether a backward was searched for reentrant segments (`_classify`)
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

    def zero_grad(self, set_to_none: bool) -> None:
        """After the optimizer's ``zero_grad``: with ``set_to_none=False`` each gradient a hook freed is a kept zero
        gradient (`zeroed`). The record of what was stepped is not reset: that is ``step()``'s, and, after a
        backward that raised, the next backward's."""
        if set_to_none:
            self.freed.clear()
        self.zeroed = set() if set_to_none else set(self.freed)

    def finish(self, optimizer: ParamStepper) -> list[Tensor]:
        """At ``step()``: refuse a GradScaler after a backward whose hooks stepped, and a gradient that came back
        after its parameter was stepped in backward, give each kept zero gradient no backward reached its zeros,
        then return the skip flags of the updates done in backward and start the next step's record."""
        if "found_inf" in optimizer.__dict__:  # torch.amp.GradScaler.step() hands its inf checks to the step
            del optimizer.grad_scale, optimizer.found_inf
            raise RuntimeError(_SCALED)
        for index, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is not None and id(p) in self.stepped:
                    raise RuntimeError(_REGROWN.format(name=_name(group, index, i)))
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None and id(p) in self.zeroed and id(p) not in self.stepped:
                    p.grad = torch.zeros_like(p)
        skipped, self.skipped = self.skipped, []
        self.stepped.clear()
        return skipped

    def _locate(self, optimizer: ParamStepper, p: Tensor) -> Optional[tuple[int, int]]:
        """``(group index, position)`` of ``p`` in the optimizer's param groups, None if it holds ``p`` no more."""
        where = self._where.get(id(p))
        groups = optimizer.param_groups
        if where is not None and where[0] < len(groups) and where[1] < len(groups[where[0]]["params"]) \
                and groups[where[0]]["params"][where[1]] is p:
            return where
        self._where = {id(q): (index, i) for index, g in enumerate(groups) for i, q in enumerate(g["params"])}
        return self._where.get(id(p))

    def _kind(self) -> str:
        """What the running backward is (`_classify`), decided at its first hook."""
        task = torch._C._current_graph_task_id()
        if task != self._task[0]:
            self._task = (task, self._classify(task))
        return self._task[1]

    def _classify(self, task: int) -> str:
        """``"retained"`` (the backward keeps its graph), ``"nested"`` (a reentrant backward: `_engine_call`),
        ``"second"`` (an outermost backward after one that completed and stepped, before ``step()``), ``"scaled"``
        (its loss was scaled by a GradScaler: `_scaled`), ``"defer"`` (the first backward this optimizer meets, and
        it has reentrant segments: which weights they use is not known yet), else ``"outer"``. An outermost
        backward after one that raised (the engine never ran the callback queued here at its end) starts a new
        record. One walk of the Python stack per backward; no graph walk but the first backward's."""
        if task < 0:
            return "outer"  # a hook run by hand, outside any backward
        if torch._C._autograd._get_current_graph_task_keep_graph():
            return "retained"
        nested, engine = _engine_call(sys._getframe())
        if nested:
            return "nested"
        if task == self._outer[0]:
            return self._outer[1]  # back from a nested backward
        if self._done and self.stepped:
            return "second"  # (no record: each backward until step() is refused)
        if not self._done:  # the last backward raised: a new record, and a new search if it was to search
            self.stepped.clear()
            self._probed = self._probed and self._outer[1] != "defer"
        roots = _roots(engine)
        kind = "scaled" if _scaled(roots) else "outer"
        if kind == "outer" and not self._probed:
            self._probed = True
            kind = "defer" if self.segmented or _has_reentrant_segment(roots) else kind
        self._outer, self._done = (task, kind), False
        torch.autograd.Variable._execution_engine.queue_callback(self._complete)
        return kind

    def _complete(self) -> None:
        self._done = True

    def _hook(self, p: Tensor) -> None:
        optimizer = self._optimizer()
        if optimizer is None or self.held or p.grad is None:
            return
        where = self._locate(optimizer, p)
        if where is None:
            return
        kind = self._kind()
        if kind == "retained":
            raise RuntimeError(_RETAINED)
        if kind == "nested":
            if id(p) in self.stepped:
                raise RuntimeError(_SEGMENT.format(name=_name(optimizer.param_groups[where[0]], *where)))
            self.segmented.add(id(p))
        if kind == "second" or (kind == "outer" and id(p) in self.stepped):  # (the latter: hooks run by hand)
            raise RuntimeError(_TWICE.format(name=_name(optimizer.param_groups[where[0]], *where)))
        if kind != "outer" or id(p) in self.segmented:
            return  # held: its gradient may come in several pieces, or be scaled; step() steps it
        self.skipped.append(optimizer.step_parameter(*where))
        self.stepped.add(id(p))
        self.freed.add(id(p))
        self.zeroed.discard(id(p))
        p.grad = None


class Counter:
    """A count of skipped updates (``SkewAdam.skipped_steps``, ``skipped_tensors``): counted on the device as steps
    run (`add`: no host sync), the device count added in when read (one host sync on GPU, only when asked);
    settable (`SkewAdam.load_state_dict` restores ``skipped_steps``)."""

    def __init__(self, name: str, pending: str, doc: str) -> None:
        self.name, self.pending, self.__doc__ = name, pending, doc

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        pending = obj.__dict__.pop(self.pending, None)
        if pending is not None:
            obj.__dict__[self.name] = obj.__dict__.get(self.name, 0) + int(pending)
        return obj.__dict__.get(self.name, 0)

    def __set__(self, obj: Any, value: int) -> None:
        obj.__dict__.pop(self.pending, None)
        obj.__dict__[self.name] = int(value)

    @staticmethod
    def add(obj: Any, name: str, count: Tensor) -> None:
        """Add the 0-d ``count`` to the count ``name`` of ``obj``, on its device."""
        key = getattr(type(obj), name).pending
        pending = obj.__dict__.get(key)  # one op a step: ops right after a step run in cold caches
        obj.__dict__[key] = count.to(torch.int64) if pending is None else pending + count  # int64 + bool: int64


class _InBackward:
    """``SkewAdam.in_backward``: whether each parameter is stepped inside backward; setting it adds or removes the
    gradient hooks (a `BackwardSteps` in the optimizer's ``_backward``). Turned off between a backward and
    ``step()``, the skips of that backward are counted then."""

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return self if obj is None else obj.__dict__.get("_backward") is not None

    def __set__(self, obj: Any, value: bool) -> None:
        current = obj.__dict__.get("_backward")
        if bool(value) != (current is not None):
            if current is not None:
                current.remove()
                if current.skipped:
                    Counter.add(obj, "skipped_tensors", stacked(current.skipped).sum())
                    Counter.add(obj, "skipped_steps", stacked(current.skipped).any())
            obj._backward = BackwardSteps(obj) if value else None


class BackwardMode:
    """What `SkewAdam` has for the step inside backward: the ``in_backward`` switch, `hold_gradients`, and a
    ``zero_grad`` that tells the hooks."""

    _backward: Optional[BackwardSteps]
    in_backward = _InBackward()
    skipped_tensors = Counter("skipped_tensors", "_skipped_tensors_pending", "With ``in_backward``: the tensor "
                              "updates skipped inside backward for a non-finite gradient, counted at ``step()``.")

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # read by torch.amp.GradScaler.step() alone: after a backward whose hooks stepped (a scaled loss not
        # recognised) it then hands its inf checks to step(), which refuses it (`BackwardSteps.finish`), instead
        # of finding no gradient; after a scaled backward (held) it unscales and steps as for any optimizer
        return self._backward is not None and bool(self._backward.stepped)

    def hold_gradients(self) -> ContextManager[None]:
        """With ``in_backward``: backwards inside keep their gradients, and the next backward (or ``step()``) steps
        their sum: ``with opt.hold_gradients(): loss_1.backward()``, then ``loss_2.backward(); opt.step()``."""
        return self._backward.hold() if self._backward is not None else contextlib.nullcontext()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # type: ignore[misc]
        if self._backward is not None:
            self._backward.zero_grad(set_to_none)


def check_trainer(model: Any) -> None:
    """Refuse the settings of a trainer attached to ``model`` (a Lightning ``LightningModule``'s, in
    ``configure_optimizers``) that cannot run inside backward: global gradient clipping (``gradient_clip_val``: it
    would see no gradient), gradient accumulation, fp16 loss scaling (under a GradScaler every gradient is held to
    the step: nothing saved), DDP (it all-reduces after the hooks); ValueError naming each fix. A model without a
    trainer passes.

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
        fixes.append(f"precision={trainer.precision!r} scales the loss: under a GradScaler SkewAdam holds every "
                     f"gradient to the step (nothing saved); use 'bf16-mixed'")
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


def _engine_call(frame: Any) -> tuple[bool, Any]:
    """Of the Python stack ``frame`` tops: whether it runs a reentrant backward (one started inside a node of another:
    a custom Function's backward below (outside) an engine call, what ``torch.utils.checkpoint(...,
    use_reentrant=True)`` runs per segment; FSDP2's hooks run inside a custom Function's backward too, but with no
    engine call between it and them), and the outermost engine call's frame (None on a device thread)."""
    nested, outer = False, None
    while frame is not None:
        if frame.f_code is _ENGINE:
            outer = frame
        elif outer is not None and frame.f_code is _NODE:
            nested = True
        frame = frame.f_back
    return nested, outer


def _roots(engine: Any) -> tuple:
    """The running outermost backward's roots: its engine call's ``t_outputs`` (``engine``: that call's frame on this
    thread, or None when a device thread runs the hooks: then the one other thread waiting in the engine's); ()
    if not found."""
    if engine is None:
        calls = [call for t, f in sys._current_frames().items()
                 if t != threading.get_ident() and (call := _engine_call(f)[1]) is not None]
        if len(calls) != 1:
            return ()
        engine = calls[0]
    return tuple(engine.f_locals.get("t_outputs", ()))


def _scaled(roots: tuple) -> bool:
    """Whether a root is a loss a ``torch.amp.GradScaler`` scaled: ``scaler.scale(loss)`` is ``loss * scaler._scale``
    (a MulBackward0 one of whose operands needs no gradient). Which tensor it multiplied cannot be read here: the
    root's node runs first and frees what it saved before any parameter's hook runs; so: such a product while an
    enabled GradScaler that has scaled a loss is alive (`_scalers`). Holding a backward that was not scaled costs
    memory, never exactness."""
    if not any(type(getattr(r, "grad_fn", None)).__name__ == "MulBackward0"
               and any(node is None for node, _ in r.grad_fn.next_functions) for r in roots):
        return False
    return any(s.is_enabled() and s._scale is not None for s in _scalers())


#: The live GradScalers found so far, and what `_scalers` compares to know whether to search again.
_SCALERS: "weakref.WeakSet[Any]" = weakref.WeakSet()
_SCALER_REFS: list[tuple[int, ...]] = [()]


def _scalers() -> "weakref.WeakSet[Any]":
    """Every live ``torch.amp.GradScaler`` (subclasses too). An instance holds a reference to its class, so the heap
    is searched (``gc.get_referrers``: ~0.1 s) only when a class's reference count, less its instances found so far,
    moved since the last search."""
    classes, todo = [], [torch.amp.GradScaler]
    while todo:
        classes.append(todo.pop())
        todo += classes[-1].__subclasses__()

    def refs() -> tuple[int, ...]:
        return tuple(sys.getrefcount(c) - sum(type(s) is c for s in _SCALERS) for c in classes)

    if refs() != _SCALER_REFS[0]:
        _SCALERS.update(o for o in gc.get_referrers(*classes) if isinstance(o, torch.amp.GradScaler))
        _SCALER_REFS[0] = refs()
    return _SCALERS


def _has_reentrant_segment(roots: tuple) -> bool:
    """Whether the graph below ``roots`` (`_roots`) holds a reentrant checkpoint (a node of a ``CheckpointFunction``:
    torch's, DeepSpeed's, Megatron's). One search per optimizer (its first backward): it visits every node."""
    todo = [r.grad_fn if isinstance(r, Tensor) else getattr(r, "node", None) for r in roots]
    seen = set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CheckpointFunction" in type(node).__name__:
            return True
        todo += [n for n, _ in node.next_functions]
    return False


def _name(group: dict, index: int, i: int) -> str:
    names = group.get("param_names")
    return f"param_groups[{index}]['params'][{i}]" + (f" ({names[i]!r})" if names else "")


def _remove_all(handles: dict[int, Any]) -> None:
    for handle in handles.values():
        handle.remove()
    handles.clear()
