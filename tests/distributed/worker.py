"""SkewAdam under FSDP2, DDP, ZeroRedundancyOptimizer and expert-parallel layouts, checked against one process.

Run by ``test_distributed.py`` as ``torchrun --standalone --nproc_per_node=2 worker.py OUT_DIR IMPL [CHECK ...]`` (CPU,
gloo), once per kernel: IMPL (``eager`` or ``cpp``) is the kernel every SkewAdam here runs (``SKEWADAM_IMPL``), the
one-process references included. Every check trains the reference MoE (`skewadam.bench.models`, float64, tiny) or the toy
of issue 13 with SkewAdam groups per tier for a few steps and returns figures (max abs difference of parameters and
optimizer state from one process on the global batch, reducer collectives and bytes per step, ...). Rank 0 writes
``OUT_DIR/results.json`` (`checks.run_checks`): ``{check: {"rank0": figures, "rank1": figures}}``, a check that
raised recording ``{"error": traceback}`` (one failure does not hide others); the pytest side asserts on it.

Layouts, on 2 ranks:
- FSDP2 (`fully_shard`): dim-0 shards with uneven sizes (vocab 67, 3 experts, 9 positions) and EMPTY shards (a single
  expert: router [1, D] and banks [1, F, D] hold nothing on rank 1); torchtitan's placement (experts ``Shard(1)`` when
  the shard degree exceeds the number of experts) mixed with column-sharded attention (``Shard(1)`` on [D, D]).
- The toy of issue 13 (`Toy`): a head ``Linear(7, 1)`` whose ``[1, 7]`` weight (backbone: momentum + factored) and
  ``[1]`` bias (1-D) are empty on rank 1, a ``[1, 300]`` row (int8 momentum blocks along its unsharded last dim), and
  with one expert an empty router and empty banks too: an empty shard in every tier, with fp32, int8 and bf16
  momentum.
- DDP; `ZeroRedundancyOptimizer` wrapping SkewAdam (whole parameters: no reducer).
- Expert parallelism as torchtitan lays it out (`_layout_run`): experts ``(_StridedShard(0, sf=2), Shard(0))`` on an
  (efsdp=1, ep=2) mesh, i.e. EP with FSDP on the other mesh dim (what ``fully_shard`` over ``Shard(0)`` EP DTensors
  produces), experts ``(Shard(1), Shard(0))`` on (efsdp=2, ep=1) with one expert, a 1-D strided layout
  ``_StridedShard(0, sf=2)`` (rank 0 holds experts {0, 2}), and every tensor sharded on its last dim. Dense parameters
  are ``Shard(0)`` on a separate 1-D data-parallel mesh. The expert compute there is done on a full copy of the model
  (weights all-gathered, gradients all-reduced and re-sharded by the harness): the optimizer sees exactly the DTensor
  parameters and gradients an EP run gives it, which is what is under test.
"""

from __future__ import annotations

import copy
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.parallel import DistributedDataParallel as DDP

import skewadam.bench.models
from checks import run_checks
from skewadam import SkewAdam
from skewadam.bench.models import MoETransformer, get_config
from skewadam.distributed import DTensorReducer, new_state_dtensor
from skewadam.state import StateTensor

W = 2
STEPS = 4
LR = 1e-2
BATCH, SEQ = 4, 8  # global batch; each rank takes BATCH // W rows
VOCAB = 67  # odd: the embedding's shards are uneven


def _expert_dispatch_fp64(x_ND, expert_NK, weight_NK, experts):
    """`skewadam.bench.models.expert_dispatch` with one matmul per expert: ``F.grouped_mm`` has no float64 CPU kernel."""
    y_ND = torch.zeros_like(x_ND)
    for e in range(experts.w1.shape[0]):
        token_n, slot_n = (expert_NK == e).nonzero(as_tuple=True)
        x = x_ND[token_n]
        h = F.silu(x @ experts.w1[e].T) * (x @ experts.w3[e].T)
        y_ND = y_ND.index_add(0, token_n, (h @ experts.w2[e].T) * weight_NK[token_n, slot_n, None].to(x.dtype))
    return y_ND


skewadam.bench.models.expert_dispatch = _expert_dispatch_fp64


def config(n_experts: int):
    """Tiny, odd sizes (uneven shards), deterministic routing (no router noise), batch-additive loss (no balance loss,
    whose product of batch means makes data parallelism differ from one process on the global batch)."""
    return get_config("tiny", vocab_size=VOCAB, block_size=9, d_model=8, n_head=2, n_kv_head=1, d_ff=12, d_expert=6,
                      n_experts=n_experts, top_k=min(2, n_experts), router_noise_std=0.0, balance_coef=0.0)


def build(cfg, seed: int = 0) -> MoETransformer:
    torch.manual_seed(seed)
    return MoETransformer(cfg).double()


def groups(named, momentum_dtype: str = "fp32") -> list[dict]:
    """SkewAdam groups per tier by name; the expert tier also exercises ``eps_mode="add"``."""
    tiers = {"backbone": [], "expert": [], "router": []}
    for name, p in named:
        name = "." + name
        tiers["expert" if ".experts." in name else "router" if ".router." in name else "backbone"].append(p)
    return [dict(params=tiers["backbone"], tier="backbone", weight_decay=0.1, momentum_dtype=momentum_dtype),
            dict(params=tiers["expert"], tier="expert", weight_decay=0.1, eps_mode="add"),
            dict(params=tiers["router"], tier="router")]


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(steps)]


def local(batch):
    rows = slice(dist.get_rank() * BATCH // W, (dist.get_rank() + 1) * BATCH // W)
    return batch[0][rows], batch[1][rows]


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def reference(cfg, data, momentum_dtype: str = "fp32") -> tuple[dict, dict]:
    """One process, global batch: final parameters and optimizer state by name."""
    model = build(cfg)
    opt = SkewAdam(groups(model.named_parameters(), momentum_dtype), lr=LR)
    for idx, tgt in data:
        model(idx, tgt).loss.backward()
        opt.step()
        opt.zero_grad()
    return snapshot(model.named_parameters(), opt)


def snapshot(named, opt) -> tuple[dict, dict]:
    named = list(named)
    params = {n: full(p.detach()).clone() for n, p in named}
    state = {n: {k: full(v).clone() for k, v in opt.state[p].items()} for n, p in named} if opt is not None else {}
    return params, state


def max_diff(ref: tuple[dict, dict], got: tuple[dict, dict], *, state: bool = True) -> float:
    (rp, rs), (gp, gs) = ref, got
    assert rp.keys() == gp.keys()
    d = max((rp[n] - gp[n]).abs().max().item() for n in rp)
    if state:
        for n in rs:
            assert rs[n].keys() == gs[n].keys(), (n, rs[n].keys(), gs[n].keys())
            d = max([d] + [(rs[n][k] - gs[n][k]).abs().max().item() for k in rs[n]])
    return d


def train(forward, opt, data) -> None:
    """``forward(idx, tgt)`` computes this rank's gradients on its rows of each global batch; then one step."""
    for batch in data:
        forward(*local(batch))
        opt.step()
        opt.zero_grad()


def backward(model):
    return lambda idx, tgt: model(idx, tgt).loss.backward()


def comm_figures(opt, steps: int) -> dict:
    r = opt._reducer
    return {"collectives_per_step": r.collectives / steps, "bytes_per_step": r.bytes / steps}


# ---------------------------------------------------------------------------------------------------------- FSDP2
def torchtitan_placement(param):
    """torchtitan's fsdp.py: experts on ``Shard(1)`` when the shard degree exceeds the expert count; here also the
    attention query/output projections on ``Shard(1)`` (column shards: their row statistics cross ranks)."""
    if param.ndim == 3 and param.shape[0] < W:
        return Shard(1)
    if param.ndim == 2 and param.shape == (8, 8):
        return Shard(1)
    return Shard(0)


def fsdp_model(cfg, placement_fn=None, seed: int = 0):
    model = build(cfg, seed)
    for block in model.blocks:
        fully_shard(block, mesh=MESH, shard_placement_fn=placement_fn)
    fully_shard(model, mesh=MESH, shard_placement_fn=placement_fn)
    return model


def check_fsdp2(n_experts: int, placement_fn=None, disable_reducer: bool = False, momentum_dtype: str = "fp32") -> dict:
    cfg = config(n_experts)
    data = batches()
    model = fsdp_model(cfg, placement_fn)
    opt = SkewAdam(groups(model.named_parameters(), momentum_dtype), lr=LR)
    if disable_reducer:
        opt._reducer = lambda items: None
    train(backward(model), opt, data)
    out = {"max_diff": max_diff(reference(cfg, data, momentum_dtype), snapshot(model.named_parameters(), opt))}
    if not disable_reducer:
        out.update(comm_figures(opt, len(data)))
        out["grad_bytes_per_rank"] = sum(p.to_local().numel() * 8 for p in model.parameters())
        if placement_fn is None:
            out["expected_bytes_per_step"] = expected_bytes_shard0(model)
        out["placements"] = _placements(model, opt)
        out["empty_local_shards"] = sorted(n for n, p in model.named_parameters() if p.to_local().numel() == 0)
    return out


class _Experts(torch.nn.Module):
    def __init__(self, n_experts: int):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(n_experts, 20, 14) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(n_experts, 14, 20) * 0.3)

    def forward(self, h_ND, gate_NE):
        return sum(gate_NE[:, e:e + 1] * (F.silu(h_ND @ self.w1[e]) @ self.w2[e]) for e in range(self.w1.shape[0]))


class Toy(torch.nn.Module):
    """The MoE of issue 13: ``Linear(12, 20)``, router ``[E, 20]`` (sigmoid gates: it trains with one expert too),
    banks ``[E, 20, 14]``/``[E, 14, 20]``, ``Linear(20, 7)``, head ``Linear(7, 1)``, and a ``[1, 300]`` row with a
    loss of its own. Shape legend: N tokens, D=20 hidden, E experts."""

    def __init__(self, n_experts: int):
        super().__init__()
        self.inp = torch.nn.Linear(12, 20)
        self.router = torch.nn.Linear(20, n_experts, bias=False)
        self.experts = _Experts(n_experts)
        self.mid = torch.nn.Linear(20, 7)
        self.head = torch.nn.Linear(7, 1)
        self.wide = torch.nn.Parameter(torch.randn(1, 300) * 0.3)

    def forward(self, x_N12, y_N):
        h_ND = torch.tanh(self.inp(x_N12))
        z_ND = self.experts(h_ND, torch.sigmoid(self.router(h_ND)))
        out_N = self.head(torch.tanh(self.mid(h_ND + z_ND))).squeeze(-1)
        return F.mse_loss(out_N, y_N) + (self.wide - 0.5).square().mean()


TOY_STEPS, TOY_BATCH = 20, 8


def toy_batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(TOY_BATCH, 12, generator=g, dtype=torch.float64),
             torch.randn(TOY_BATCH, generator=g, dtype=torch.float64)) for _ in range(TOY_STEPS)]


def check_toy(n_experts: int, momentum_dtype: str = "fp32", dtype=torch.float64) -> dict:
    """The toy under FSDP2 (each submodule and the root ``fully_shard``ed) against one process on the global batch.
    ``seed_diff``: how far two one-process runs with different rounding seeds end apart (bf16 momentum rounds rank 1's
    rows with other bits than one process does, so that is how close the sharded run can be)."""
    def model_opt(shard: bool, seed: int = 0):
        torch.manual_seed(0)
        model = Toy(n_experts).to(dtype)
        if shard:
            for child in model.children():
                fully_shard(child, mesh=MESH)
            fully_shard(model, mesh=MESH)
        return model, SkewAdam(groups(model.named_parameters(), momentum_dtype), lr=LR, seed=seed)

    def one_process(seed: int):
        ref_model, ref_opt = model_opt(shard=False, seed=seed)
        for x, y in data:
            ref_model(x, y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        return snapshot(ref_model.named_parameters(), ref_opt)

    data = [(x.to(dtype), y.to(dtype)) for x, y in toy_batches()]
    rows = slice(dist.get_rank() * TOY_BATCH // W, (dist.get_rank() + 1) * TOY_BATCH // W)
    model, opt = model_opt(shard=True)
    for x, y in data:
        model(x[rows], y[rows]).backward()
        opt.step()
        opt.zero_grad()
    got = snapshot(model.named_parameters(), opt)
    ref = one_process(0)
    return {"max_diff": max_diff(ref, got), "seed_diff": max_diff(ref, one_process(1)),
            "finite": all(bool(t.isfinite().all()) for t in got[0].values()) and all(
                bool(v.float().isfinite().all()) for st in got[1].values() for v in st.values()),
            "skipped_steps": opt.skipped_steps,
            "empty_local_shards": sorted(n for n, p in model.named_parameters() if p.to_local().numel() == 0)}


def expected_bytes_shard0(model) -> int:
    """What must cross ranks per step under dim-0 sharding, derived from the math, not from the reducer: for each
    non-bank factored [R, C] matrix the column sums [1, C] plus sum g^2, the matrix's sum g^2 and sum_i row_var_i
    (C + 3 numbers); one sum g^2 for any other non-bank tensor; then one sum u^2 (the clip) per non-bank tensor; banks
    sharded on experts need nothing. Float64 statistics, plus the float32 skip flag."""
    n = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            continue
        factored = p.ndim == 2 and ".router." not in name
        n += (p.shape[1] + 3 if factored else 1) + 1
    return 8 * n + 4


def _placements(model, opt) -> dict:
    """Parameter and state placements by name (strings), for the record and for the placement checks."""
    out = {}
    for n, p in model.named_parameters():
        out[n] = {"param": str(tuple(p.placements))}
        for k, v in opt.state[p].items():
            out[n][k] = str(tuple(v.placements)) if isinstance(v, DTensor) else f"plain {v.device.type}"
    return out


def check_ddp() -> dict:
    cfg = config(3)
    data = batches()
    model = DDP(build(cfg))
    opt = SkewAdam(groups(model.module.named_parameters()), lr=LR)
    train(backward(model), opt, data)
    return {"max_diff": max_diff(reference(cfg, data), snapshot(model.module.named_parameters(), opt)),
            "reducer": repr(opt._reducer)}


def check_zero() -> dict:
    cfg = config(3)
    data = batches()
    model = DDP(build(cfg))
    opt = ZeroRedundancyOptimizer(groups(model.module.named_parameters()), optimizer_class=SkewAdam, lr=LR)
    train(backward(model), opt, data)
    got = snapshot(model.module.named_parameters(), None)
    return {"max_diff": max_diff(reference(cfg, data), got, state=False),
            "local_params": sum(len(g["params"]) for g in opt.optim.param_groups)}


# ------------------------------------------------------------------------------------ expert-parallel layouts
class Layout:
    """Parameters as DTensors with given placements on a "sharded twin" of the model; a full copy computes the
    gradients (weights gathered, gradients averaged and re-sharded: test plumbing, not what the optimizer does)."""

    def __init__(self, cfg, place, seed: int = 0):
        self.compute = build(cfg, seed)
        self.twin = copy.deepcopy(self.compute)
        self.place = {}
        for name, p in list(self.twin.named_parameters()):
            mesh, placements = place(name, p)
            self.place[name] = (mesh, placements)
            module, attr = self._owner(self.twin, name)
            setattr(module, attr, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, placements, src_data_rank=None)))

    @staticmethod
    def _owner(model, name):
        path, attr = name.rsplit(".", 1)
        return model.get_submodule(path), attr

    def forward(self, idx, tgt) -> None:
        named = dict(self.twin.named_parameters())
        with torch.no_grad():
            for n, p in self.compute.named_parameters():
                p.copy_(named[n].full_tensor())
        self.compute(idx, tgt).loss.backward()
        for n, p in self.compute.named_parameters():
            g = p.grad
            dist.all_reduce(g)
            g /= W
            mesh, placements = self.place[n]
            named[n].grad = distribute_tensor(g, mesh, placements, src_data_rank=None)
            p.grad = None


def ep_layouts() -> dict:
    """``{name: (place(name, param) -> (mesh, placements), number of experts)}``; dense parameters on ``MESH``."""
    ep2 = init_device_mesh("cpu", (1, W), mesh_dim_names=("efsdp", "ep"))
    efsdp2 = init_device_mesh("cpu", (W, 1), mesh_dim_names=("efsdp", "ep"))

    def experts(placements, mesh):
        return lambda name, p: (mesh, placements) if ".experts." in name else (MESH, (Shard(0),))

    return {
        # torchtitan EP + FSDP over the other mesh dim, as fully_shard lays it out
        "ep_shard0_fsdp_strided": (experts((_StridedShard(0, split_factor=W), Shard(0)), ep2), 4),
        # torchtitan: experts on Shard(1) when efsdp * ep exceeds the expert count
        "ep_shard1": (experts((Shard(1), Shard(0)), efsdp2), 1),
        # a strided layout that is not contiguous: rank 0 holds experts {0, 2}
        "strided_1d": (experts((_StridedShard(0, split_factor=W),), MESH), 4),
        # every tensor on its last dim (row statistics cross ranks)
        "shard_last_dim": (lambda name, p: (MESH, (Shard(p.ndim - 1),)), 3),
    }


def check_layout_run(place, n_experts: int, disable_reducer: bool = False) -> dict:
    cfg = config(n_experts)
    data = batches()
    lay = Layout(cfg, place)
    opt = SkewAdam(groups(lay.twin.named_parameters()), lr=LR)
    if disable_reducer:
        opt._reducer = lambda items: None
    train(lay.forward, opt, data)
    out = {"max_diff": max_diff(reference(cfg, data), snapshot(lay.twin.named_parameters(), opt))}
    if not disable_reducer:
        out.update(comm_figures(opt, len(data)))
        out["placements"] = {n: v for n, v in _placements(lay.twin, opt).items() if ".experts." in n}
    return out


# --------------------------------------------------------------------------------------------------- DCP resume
def check_dcp(make, ckpt_dir: Path, k1: int = 2, k2: int = 2) -> dict:
    """Train k1 steps, save model+optimizer with DCP, train k2 more; a fresh model+optimizer (different init) loaded
    from the checkpoint and trained the same k2 steps must end bitwise equal, parameters and state."""
    data = batches(k1 + k2)
    model, opt, fwd = make(seed=0)
    train(fwd, opt, data[:k1])
    msd, osd = get_state_dict(_module(model), opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ckpt_dir))
    train(fwd, opt, data[k1:])
    a = snapshot(_module(model).named_parameters(), opt)

    model2, opt2, fwd2 = make(seed=1)
    msd2, osd2 = get_state_dict(_module(model2), opt2)  # allocates state (a zero-gradient, lr=0 step)
    dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=str(ckpt_dir))
    set_state_dict(_module(model2), opt2, model_state_dict=msd2, optim_state_dict=osd2)
    train(fwd2, opt2, data[k1:])
    b = snapshot(_module(model2).named_parameters(), opt2)
    bitwise = all(torch.equal(a[0][n], b[0][n]) for n in a[0]) and all(
        torch.equal(a[1][n][k], b[1][n][k]) and a[1][n][k].dtype == b[1][n][k].dtype for n in a[1] for k in a[1][n])
    local_bitwise = all(torch.equal(_loc(p), _loc(q)) for p, q in
                        zip(_module(model).parameters(), _module(model2).parameters()))
    return {"bitwise": bitwise and local_bitwise, "max_diff": max_diff(a, b),
            "steps": [float(full(opt2.state[p]["step"]).sum()) for p in list(_module(model2).parameters())[:1]]}


def _module(model):
    return model.twin if isinstance(model, Layout) else model


def _loc(t):
    return t.to_local() if isinstance(t, DTensor) else t


def make_fsdp(seed: int):
    model = fsdp_model(config(1), torchtitan_placement, seed)
    return model, SkewAdam(groups(model.named_parameters()), lr=LR), backward(model)


def make_ep(seed: int):
    place, n_experts = LAYOUTS["ep_shard0_fsdp_strided"]
    lay = Layout(config(n_experts), place, seed)
    return lay, SkewAdam(groups(lay.twin.named_parameters()), lr=LR), lay.forward


# ----------------------------------------------------------------------------------------------- agreement, refusal
def check_nonfinite_skipped_everywhere() -> dict:
    """A NaN in rank 1's shard of an expert bank sharded on experts (no statistic of it crosses ranks) must make both
    ranks skip the step: weights and state untouched, ``skipped_steps == 1`` everywhere."""
    place, n_experts = LAYOUTS["ep_shard0_fsdp_strided"]
    cfg = config(n_experts)
    lay = Layout(cfg, place)
    opt = SkewAdam(groups(lay.twin.named_parameters()), lr=LR)
    data = batches(2)
    train(lay.forward, opt, data[:1])
    before = snapshot(lay.twin.named_parameters(), opt)
    lay.forward(*local(data[1]))
    w1 = lay.twin.get_parameter("blocks.1.moe.experts.w1")
    if dist.get_rank() == 1:
        w1.grad.to_local()[0, 0, 0] = float("nan")
    opt.step()
    after = snapshot(lay.twin.named_parameters(), opt)
    return {"skipped_steps": opt.skipped_steps, "unchanged": max_diff(before, after) == 0.0}


def check_zero_nonfinite_skipped_everywhere() -> dict:
    """ZeroRedundancyOptimizer: rank 1 alone sees a NaN in a parameter it owns; with the reducer's agreement installed
    on the local optimizers both ranks skip (partitions of rank 0 untouched too)."""
    model = DDP(build(config(3)))
    opt = ZeroRedundancyOptimizer(groups(model.module.named_parameters()), optimizer_class=SkewAdam, lr=LR)
    opt.optim._reducer = DTensorReducer()
    data = batches(2)
    train(backward(model), opt, data[:1])
    before = snapshot(model.module.named_parameters(), None)
    model(*local(data[1])).loss.backward()
    if dist.get_rank() == 1:
        opt.optim.param_groups[0]["params"][0].grad.view(-1)[0] = float("nan")
    opt.step()
    after = snapshot(model.module.named_parameters(), None)
    return {"skipped_steps": opt.optim.skipped_steps, "unchanged": max_diff(before, after, state=False) == 0.0}


def check_rounding_streams() -> dict:
    """bf16 weight of equal values and equal gradients: one step lands every element between two bf16 values
    (1 - lr), so each rounds up or down by its own coin. Row shards must flip differently (they used to draw the same
    bits at the same local positions), the first shard as one process does, replicas identically."""
    def stepped(placements):
        p = torch.nn.Parameter(distribute_tensor(torch.ones(8, 256, dtype=torch.bfloat16), MESH, placements))
        p.grad = distribute_tensor(torch.ones(8, 256, dtype=torch.bfloat16), MESH, placements)
        SkewAdam([p], lr=1e-3, weight_decay=0.0).step()
        return p
    one = torch.nn.Parameter(torch.ones(8, 256, dtype=torch.bfloat16))
    one.grad = torch.ones_like(one)
    SkewAdam([one], lr=1e-3, weight_decay=0.0).step()
    rows = stepped([Shard(0)]).full_tensor()
    replica = stepped([Replicate()]).to_local()
    replicas = [torch.empty_like(replica) for _ in range(W)]
    dist.all_gather(replicas, replica)
    return {"rounded_both_ways": sorted(rows.unique().float().tolist()),
            "shards_differ": not torch.equal(rows[:4], rows[4:]),
            "first_shard_as_one_process": torch.equal(rows[:4], one.detach()[:4]),
            "replicas_equal": torch.equal(replicas[0], replicas[1])}


def check_refusals() -> dict:
    """Error messages (or "accepted") for a Partial parameter, a Partial gradient, and int8 momentum scales of a
    parameter sharded on its last dim (its blocks would straddle ranks)."""
    out = {}
    p = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, 3, dtype=torch.float64), MESH, [Partial()]))
    try:
        SkewAdam([p])
        out["param"] = "accepted"
    except ValueError as e:
        out["param"] = str(e)
    q = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3, dtype=torch.float64), MESH, [Shard(0)]))
    q.grad = DTensor.from_local(torch.ones(4, 3, dtype=torch.float64), MESH, [Partial()])
    try:
        SkewAdam([q]).step()
        out["grad"] = "accepted"
    except ValueError as e:
        out["grad"] = str(e)
    r = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 512), MESH, [Shard(1)]))
    try:
        new_state_dtensor(r, "exp_avg_scale", StateTensor((4, 2), torch.float32))
        out["int8_last_dim"] = "accepted"
    except ValueError as e:
        out["int8_last_dim"] = str(e)
    return out


def main(out_dir: Path, impl: str) -> None:
    os.environ["SKEWADAM_IMPL"] = impl  # every SkewAdam below, the one-process references too
    run_checks(lambda: named_checks(out_dir), out_dir, only=sys.argv[3:], timeout=timedelta(seconds=180))


def named_checks(out_dir: Path) -> dict:
    """Every check by name (after the process group exists: the meshes)."""
    global MESH, LAYOUTS
    MESH = init_device_mesh("cpu", (W,))
    LAYOUTS = ep_layouts()
    return {
        "fsdp2_uneven": lambda: check_fsdp2(3),
        "fsdp2_empty_shards": lambda: check_fsdp2(1),
        "fsdp2_torchtitan_shard1": lambda: check_fsdp2(1, torchtitan_placement),
        "fsdp2_negative_control": lambda: check_fsdp2(3, disable_reducer=True),
        "fsdp2_int8_momentum": lambda: check_fsdp2(3, momentum_dtype="int8"),
        "toy_issue13": lambda: check_toy(3),
        "toy_every_tier_empty": lambda: check_toy(1),
        "toy_every_tier_empty_int8": lambda: check_toy(1, momentum_dtype="int8"),
        "toy_every_tier_empty_bf16": lambda: check_toy(1, momentum_dtype="bf16", dtype=torch.float32),
        "ddp": check_ddp,
        "zero_redundancy": check_zero,
        **{name: (lambda pe=pe: check_layout_run(*pe)) for name, pe in LAYOUTS.items()},
        "ep_shard1_negative_control": lambda: check_layout_run(*LAYOUTS["ep_shard1"], disable_reducer=True),
        "dcp_fsdp2": lambda: check_dcp(make_fsdp, out_dir / "ckpt_fsdp2"),
        "dcp_ep": lambda: check_dcp(make_ep, out_dir / "ckpt_ep"),
        "nonfinite_agreement": check_nonfinite_skipped_everywhere,
        "zero_nonfinite_agreement": check_zero_nonfinite_skipped_everywhere,
        "refusals": check_refusals,
        "rounding_streams": check_rounding_streams,
    }


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
