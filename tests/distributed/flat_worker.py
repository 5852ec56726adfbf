"""Flattened expert banks ``[E*H, M]`` (OLMo-core's ``DroplessMoEMLP``, DBRX) under FSDP2 on 2 ranks, checked
against one process on the global batch.

Run by ``test_flat_banks_distributed.py`` as ``torchrun --standalone --nproc_per_node=2 flat_worker.py OUT_DIR IMPL
[CHECK ...]`` (CPU, gloo), once per kernel: IMPL is the kernel every SkewAdam here runs (``SKEWADAM_IMPL``), the
one-process references included. Rank 0 writes ``OUT_DIR/results.json`` (`checks.run_checks`).

The model (`FlatMoE`, float64) routes every token to every expert with sigmoid gates, an expert idle on odd steps
(its gate zeroed: an all-zero gradient slice); ``fully_shard`` cuts its banks ``Shard(0)`` on rows, so with
``E*H`` rows over 2 ranks a rank may hold part of an expert, whole ones, or none:

- ``cut``: E=3, H=5: rank 0 holds rows 0-7 (expert 0, 3 rows of expert 1), rank 1 rows 8-14 (2 rows of expert 1,
  expert 2); each rank also steps the experts it holds no row of, as pieces of zero rows.
- ``one_expert``: E=1, H=5: each rank holds part of the only expert, no whole one.
- ``empty``: E=1, H=1: rank 1's shards of the banks (and of the router ``[1, M]``) are empty.
- ``columns``: the cut sizes with the banks ``Shard(1)`` (columns: their row sums cross ranks).
- momentum (fp32, int8) in the expert tier, bf16 weights (each piece rounds with its own bits, as shards do).
- ``*_in_backward``: each tensor stepped inside backward (``in_backward=True``) on the 2 ranks.

``dcp_*`` save and load with `torch.distributed.checkpoint` across world sizes: the pytest side saves a checkpoint
on one process (``OUT_DIR/ckpt_one``) that ``dcp_from_one_process`` loads onto the 2 ranks, and
``dcp_to_one_process`` saves one on 2 ranks (``OUT_DIR/ckpt_two``) for the pytest side to load on one process.
``refusal``: a flattened bank whose local rows are not one run (a strided placement) is refused at construction.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from checks import run_checks
from skewadam import SkewAdam, plan
from skewadam.distributed import flat_bank_pieces

W = 2
M = 8  # model width
STEPS, BATCH = 6, 8  # global batch; each rank takes BATCH // W rows
LR = 1e-2
SIZES = {"cut": (3, 5), "one_expert": (1, 5), "empty": (1, 1)}  # (E, H)


class FlatMoE(nn.Module):
    """``inp`` Linear(6, M), a router Linear(M, E), experts ``w1``/``w2`` flattened ``[E*H, M]`` (viewed ``[E, H, M]``
    in the forward, as OLMo-core's ``DroplessMoEMLP`` keeps them), a head Linear(M, 1). Legend: N tokens, M width,
    H an expert's hidden width, E experts."""

    def __init__(self, experts: int, hidden: int):
        super().__init__()
        self.inp = nn.Linear(6, M)
        self.router = nn.Linear(M, experts, bias=False)
        self.experts = nn.Module()
        for name in ("w1", "w2"):
            self.experts.register_parameter(name, nn.Parameter(torch.randn(experts * hidden, M) * 0.3))
        self.head = nn.Linear(M, 1)
        self.shape = (experts, hidden, M)

    def forward(self, x_N6, y_N, idle: int = -1):
        h_NM = torch.tanh(self.inp(x_N6))
        gate_NE = torch.sigmoid(self.router(h_NM))
        if idle >= 0:  # this expert receives no token: its slices' gradients are all zero
            gate_NE = gate_NE * (torch.arange(gate_NE.shape[1]) != idle)
        w1_EHM, w2_EHM = self.experts.w1.view(self.shape), self.experts.w2.view(self.shape)
        z_NM = sum(gate_NE[:, e:e + 1] * (F.silu(h_NM @ w1_EHM[e].T) @ w2_EHM[e]) for e in range(self.shape[0]))
        return F.mse_loss(self.head(torch.tanh(h_NM + z_NM)).squeeze(-1), y_N)


def groups(model: FlatMoE, expert_options: dict, momentum_dtype: str = "fp32") -> list[dict]:
    """Backbone (momentum), the flattened banks (``experts=E``), the router."""
    ex = model.experts
    return [dict(params=[*model.inp.parameters(), *model.head.parameters()], tier="backbone", weight_decay=0.1,
                 momentum_dtype=momentum_dtype),
            dict(params=[ex.w1, ex.w2], tier="expert", experts=model.shape[0], weight_decay=0.1, **expert_options),
            dict(params=[model.router.weight], tier="router")]


def data(steps: int = STEPS, dtype=torch.float64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(BATCH, 6, generator=g).to(dtype), torch.randn(BATCH, generator=g).to(dtype))
            for _ in range(steps)]


def build(size: str, shard=None, seed: int = 0, dtype=torch.float64) -> FlatMoE:
    torch.manual_seed(seed)
    model = FlatMoE(*SIZES[size]).to(dtype)
    if shard is not None:
        for child in (model.inp, model.router, model.head):  # the banks go with the root (``experts`` runs no forward)
            fully_shard(child, mesh=MESH, shard_placement_fn=shard)
        fully_shard(model, mesh=MESH, shard_placement_fn=shard)
    return model


def train(model, opt, batches, sharded: bool, first: int = 0) -> None:
    """One step per batch (a rank its rows of it when ``sharded``); expert 0 idle on odd steps."""
    rows = slice(dist.get_rank() * BATCH // W, (dist.get_rank() + 1) * BATCH // W) if sharded else slice(None)
    for t, (x, y) in enumerate(batches, first):
        model(x[rows], y[rows], idle=0 if t % 2 else -1).backward()
        opt.step()
        opt.zero_grad()


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def snapshot(model, opt) -> dict:
    """Parameters and optimizer state by name, as full tensors."""
    out = {}
    for n, p in model.named_parameters():
        out[n] = full(p.detach()).clone()
        out.update({f"{n}:{k}": full(v).clone() for k, v in opt.state[p].items()})
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def one_process(size: str, expert_options: dict, momentum_dtype: str = "fp32", seed: int = 0, dtype=torch.float64,
                steps: int = STEPS) -> dict:
    model = build(size, dtype=dtype)
    opt = SkewAdam(groups(model, expert_options, momentum_dtype), lr=LR, seed=seed)
    train(model, opt, data(steps, dtype), sharded=False)
    return snapshot(model, opt)


def rows_shard(p):
    return Shard(0)


def columns_shard(p):
    """The banks of the cut model on their columns (``[15, 8]``), the rest on rows."""
    return Shard(1) if tuple(p.shape) == (15, M) else Shard(0)


def check_sharded(size: str, expert_options: dict | None = None, momentum_dtype: str = "fp32", shard=rows_shard,
                  disable_reducer: bool = False, dtype=torch.float64, in_backward: bool = False) -> dict:
    """Train on 2 ranks (each tensor stepped inside backward if ``in_backward``: FSDP2 runs the hooks after its
    reduce-scatter) and one process (the regular step) from the same weights and global batches; figures: the
    largest difference, whether each rank's copies of the per-expert state (``col_var``, ``step``) equal the other's
    bitwise, the pieces each rank steps, the reducer's traffic."""
    expert_options = expert_options or {}
    model = build(size, shard, dtype=dtype)
    opt = SkewAdam(groups(model, expert_options, momentum_dtype), lr=LR, in_backward=in_backward)
    if disable_reducer:
        opt._reducer = lambda items: None
    train(model, opt, data(dtype=dtype), sharded=True)
    got = snapshot(model, opt)
    ref = one_process(size, expert_options, momentum_dtype, dtype=dtype)
    out = {"max_diff": max_diff(ref, got)}
    if disable_reducer:
        return out
    banks = [model.experts.w1, model.experts.w2]
    replicas = []
    for p in banks:
        for key in ("col_var", "step"):
            if any(not pl.is_replicate() for pl in opt.state[p][key].placements):
                continue
            local = opt.state[p][key].to_local().contiguous()
            other = [torch.empty_like(local) for _ in range(W)]
            dist.all_gather(other, local)
            replicas.append(torch.equal(other[0], other[1]))
    out.update(
        replicas_equal=all(replicas), finite=all(bool(v.double().isfinite().all()) for v in got.values()),
        skipped_steps=opt.skipped_steps,
        placements={k: str(tuple(v.placements)) for k, v in opt.state[banks[0]].items()},
        pieces=[list(pc) for pc in flat_bank_pieces(banks[0], model.shape[0])],
        local_rows=banks[0].to_local().shape[0], collectives_per_step=opt._reducer.collectives / STEPS,
        bytes_per_step=opt._reducer.bytes / STEPS,
        planned_bytes_per_step=plan(FlatMoE(*SIZES[size]).double(), optimizers=["skewadam"], shards=W,
                                    labels=_labels(model))["skewadam"].reduce_bytes)
    if dtype != torch.float64:  # rounding: as close as a one-process run with another seed, no closer needed
        out["seed_diff"] = max_diff(ref, one_process(size, expert_options, momentum_dtype, seed=1, dtype=dtype))
    return out


def _labels(model) -> dict:
    return {n: "expert" if ".experts." in f".{n}" else "router" if n.startswith("router") else "backbone"
            for n, _ in model.named_parameters()}


# --------------------------------------------------------------------------------------------------- DCP
STEPS_BEFORE, STEPS_AFTER = 3, 3
DCP_OPTIONS = {"use_momentum": True, "momentum_dtype": "int8"}


def model_and_optimizer(sharded: bool, seed: int = 0):
    """The cut model (int8 momentum in the expert tier), on 2 ranks or whole."""
    model = build("cut", rows_shard if sharded else None, seed=seed)
    return model, SkewAdam(groups(model, DCP_OPTIONS), lr=LR)


def save(model, opt, path: Path) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))


def load(model, opt, path: Path) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


def check_dcp_from_one_process(out_dir: Path) -> dict:
    """Load the one-process checkpoint (saved after ``STEPS_BEFORE`` steps by the pytest side) onto 2 ranks: every
    tensor bitwise what was saved; then ``STEPS_AFTER`` more steps end as one process's uninterrupted run."""
    model, opt = model_and_optimizer(sharded=True, seed=5)
    load(model, opt, out_dir / "ckpt_one")
    saved = torch.load(out_dir / "ckpt_one.pt")
    loaded = snapshot(model, opt)
    bitwise = loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    batches = data(STEPS_BEFORE + STEPS_AFTER)
    train(model, opt, batches[STEPS_BEFORE:], sharded=True, first=STEPS_BEFORE)
    ref_model, ref_opt = model_and_optimizer(sharded=False)
    train(ref_model, ref_opt, batches, sharded=False)
    return {"bitwise": bitwise, "max_diff": max_diff(snapshot(ref_model, ref_opt), snapshot(model, opt)),
            "placements": str(tuple(opt.state[model.experts.w1]["exp_avg"].placements))}


def check_dcp_to_one_process(out_dir: Path) -> dict:
    """Train ``STEPS_BEFORE`` steps on 2 ranks and save (``OUT_DIR/ckpt_two``; the full tensors beside it, for the
    pytest side to compare what one process loads); resume on 2 ranks from it too: bitwise the uninterrupted run."""
    batches = data(STEPS_BEFORE + STEPS_AFTER)
    model, opt = model_and_optimizer(sharded=True)
    train(model, opt, batches[:STEPS_BEFORE], sharded=True)
    save(model, opt, out_dir / "ckpt_two")
    saved = snapshot(model, opt)
    if dist.get_rank() == 0:
        torch.save(saved, out_dir / "ckpt_two.pt")
    train(model, opt, batches[STEPS_BEFORE:], sharded=True, first=STEPS_BEFORE)
    resumed, resumed_opt = model_and_optimizer(sharded=True, seed=5)
    load(resumed, resumed_opt, out_dir / "ckpt_two")
    train(resumed, resumed_opt, batches[STEPS_BEFORE:], sharded=True, first=STEPS_BEFORE)
    a, b = snapshot(model, opt), snapshot(resumed, resumed_opt)
    return {"resumed_bitwise": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)}


def check_refusal() -> dict:
    """A flattened bank ``[12, 4]`` placed ``_StridedShard(0, split_factor=2)``: rank 0 holds rows 0-2 and 6-8, not
    one run of rows; the error message of the constructor (or "accepted")."""
    strided = [_StridedShard(0, split_factor=2)]
    p = nn.Parameter(distribute_tensor(torch.zeros(12, 4, dtype=torch.float64), MESH, strided, src_data_rank=None))
    try:
        SkewAdam([{"params": [p], "tier": "expert", "experts": 3}])
    except ValueError as e:
        return {"message": str(e)}
    return {"message": "accepted"}


def named_checks(out_dir: Path) -> dict:
    global MESH
    MESH = init_device_mesh("cpu", (W,))
    return {
        "cut": lambda: check_sharded("cut"),
        "one_expert": lambda: check_sharded("one_expert"),
        "empty": lambda: check_sharded("empty"),
        "columns": lambda: check_sharded("cut", shard=columns_shard),
        "cut_momentum": lambda: check_sharded("cut", {"use_momentum": True}),
        "cut_int8": lambda: check_sharded("cut", {"use_momentum": True, "momentum_dtype": "int8"}, "int8"),
        "empty_int8": lambda: check_sharded("empty", {"use_momentum": True, "momentum_dtype": "int8"}, "int8"),
        "cut_bf16": lambda: check_sharded("cut", {"use_momentum": True}, dtype=torch.bfloat16),
        "cut_in_backward": lambda: check_sharded("cut", {"use_momentum": True}, in_backward=True),
        "empty_in_backward": lambda: check_sharded("empty", in_backward=True),
        "negative_control": lambda: check_sharded("cut", disable_reducer=True),
        "dcp_from_one_process": lambda: check_dcp_from_one_process(out_dir),
        "dcp_to_one_process": lambda: check_dcp_to_one_process(out_dir),
        "refusal": check_refusal,
    }


def main(out_dir: Path, impl: str) -> None:
    os.environ["SKEWADAM_IMPL"] = impl  # every SkewAdam below, the one-process references too
    run_checks(lambda: named_checks(out_dir), out_dir, only=sys.argv[3:], timeout=timedelta(seconds=300))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
