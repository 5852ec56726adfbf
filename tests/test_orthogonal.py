"""The orthogonal tier (Muon's update inside SkewAdam) and Adafactor's options, against the float64 reference
(tests/reference.py) and against torch.optim.Muon where the math coincides; resume, refusals, hidden-matrix labels.

Shape legend: A rows, B columns, E bank slices (experts).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.optim._muon as torch_muon

from reference import RefOrthogonal, RefParam, newton_schulz as ref_newton_schulz
from skewadam import SkewAdam, kernels, plan
from skewadam.bench import arms
from skewadam.bench.models import MoETransformer, get_config
from skewadam.classify import hidden_matrices
from skewadam.groups import param_groups
from skewadam.kernels import orthogonal

_LR, _WD, _MU = 2e-2, 0.1, 0.95


def _params(shapes, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, dtype=torch.float64, generator=gen).to(dtype)) for s in shapes]


def _grads(params, gen, step, idle=True):
    grads = []
    for p in params:
        g = torch.randn(p.shape, dtype=torch.float64, generator=gen) * (1.0 + step)
        if idle and p.ndim == 3 and step % 2 == 1:
            g[step % p.shape[0]] = 0.0  # an expert that received no token this step
        grads.append(g.to(p.dtype))
    return grads


# ---------------------------------------------------------------------------------------- the float64 reference
ORTH_CASES = {
    # tall, wide and square matrices in one group, two of one shape (one batched Newton-Schulz)
    "matrices_with_momentum": ([(12, 5), (5, 12), (7, 7), (12, 5)], "backbone", {}),
    "matrices_from_the_gradient": ([(12, 5), (6, 9)], "backbone", {"use_momentum": False}),
    "expert_banks_per_expert": ([(4, 5, 12), (3, 12, 5)], "expert", {}),
    "expert_banks_with_momentum": ([(4, 5, 12), (4, 5, 12)], "expert", {"use_momentum": True}),
    "a_bank_and_a_matrix_of_its_slice_shape": ([(3, 6, 4), (6, 4)], "expert", {}),
}


@pytest.mark.parametrize("chunk", [None, 50], ids=["one_chunk", "chunks_of_2_matrices"])
@pytest.mark.parametrize("case", list(ORTH_CASES.values()), ids=list(ORTH_CASES))
def test_orthogonal_update_matches_float64_reference(monkeypatch, case, chunk):
    """Nesterov momentum (or the gradient), Newton-Schulz, 0.2 sqrt(max(A, B)), decoupled decay, idle slices kept:
    each matrix on its own in the reference, batched by shape (and cut into chunks) in the optimizer."""
    shapes, tier, flags = case
    if chunk:
        monkeypatch.setattr(orthogonal, "CHUNK_NUMEL", chunk)
    params = _params(shapes)
    opt = SkewAdam([{"params": params, "tier": tier, "update": "orthogonal", "betas": (_MU, 0.999), **flags}],
                   lr=_LR, weight_decay=_WD)
    momentum = opt.param_groups[0]["use_momentum"]
    refs = [RefOrthogonal(p, momentum=momentum, bank=p.ndim == 3) for p in params]
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        for p, g in zip(params, _grads(params, gen, step)):
            p.grad = g
        opt.step()
        for ref, p in zip(refs, params):
            ref.step(p.grad, lr=_LR, mu=_MU, weight_decay=_WD)
            torch.testing.assert_close(p.detach(), ref.value, rtol=0, atol=1e-12)
    for ref, p in zip(refs, params):
        state = opt.state[p]
        assert set(state) == ({"step", "exp_avg"} if momentum else {"step"})  # no second moment
        if ref.bank:
            assert state["step"].tolist() == ref.t and min(ref.t) < 6  # idle slices did not count
        if momentum:
            want = torch.stack(ref.m) if ref.bank else ref.m[0]
            torch.testing.assert_close(state["exp_avg"], want, rtol=0, atol=1e-12)


def test_newton_schulz_is_the_reference_iteration_and_orthogonalises():
    """Muon's quintic iteration: equal to the hand-written one (float64), singular values pushed into about
    [0.7, 1.2] (not exactly 1: the coefficients trade accuracy for slope at zero), for tall and wide inputs."""
    gen = torch.Generator().manual_seed(0)
    for shape in [(32, 12), (12, 32), (16, 16)]:
        g = torch.randn(shape, dtype=torch.float64, generator=gen)
        o = orthogonal.newton_schulz(g.unsqueeze(0))[0]
        torch.testing.assert_close(o, ref_newton_schulz(g), rtol=0, atol=1e-13)
        s = torch.linalg.svdvals(o)
        assert 0.6 < s.min() and s.max() < 1.25, s


def test_equals_torch_muon_where_the_math_coincides(monkeypatch):
    """Momentum, Nesterov, the match_rms_adamw scale and the decay are torch.optim.Muon's: with torch's Newton-Schulz
    swapped for ours (torch runs its own in bf16 always, ours in the parameter's dtype), float64 parameters agree."""
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz",
                        lambda g, coeffs, steps, eps: orthogonal.newton_schulz(g))
    a = _params([(16, 8), (8, 24), (16, 8)])
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    theirs = torch.optim.Muon(a, lr=_LR, weight_decay=_WD, momentum=_MU, adjust_lr_fn="match_rms_adamw")
    ours = SkewAdam([{"params": b, "update": "orthogonal", "betas": (_MU, 0.999)}], lr=_LR, weight_decay=_WD)
    gen = torch.Generator().manual_seed(2)
    for step in range(5):
        for x, y, g in zip(a, b, _grads(a, gen, step)):
            x.grad, y.grad = g.clone(), g.clone()
        theirs.step()
        ours.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, rtol=0, atol=1e-13)
        torch.testing.assert_close(ours.state[y]["exp_avg"], theirs.state[x]["momentum_buffer"], rtol=0, atol=1e-13)


def test_bf16_newton_schulz_is_torchs_within_bf16_rounding():
    """In bf16 (what runs for bf16 weights) the iteration is torch's own ops in torch's order, batched: equal to
    ``torch.optim._muon._zeropower_via_newtonschulz`` up to bf16 rounding of the batched matmuls."""
    g = torch.randn(48, 20, generator=torch.Generator().manual_seed(3))
    theirs = torch_muon._zeropower_via_newtonschulz(g, orthogonal.NS_COEFFICIENTS, orthogonal.NS_STEPS,
                                                      orthogonal.NS_EPS).float()
    ours = orthogonal.newton_schulz(g.bfloat16().unsqueeze(0))[0].float()
    assert ours.dtype == theirs.dtype and (ours - theirs).abs().max() < 0.02 * theirs.abs().max()


# --------------------------------------------------------------------------------------- Adafactor's options
ADAFACTOR_CASES = {
    "backbone_matrix": ("backbone", (6, 7)),
    "expert_bank": ("expert", (3, 6, 7)),
    "router_full": ("router", (6, 7)),
    "vector": ("backbone", (5,)),
}
OPTIONS = {"relative_step": {"relative_step": True}, "beta2_decay": {"beta2_decay": -0.8},
           "both": {"relative_step": True, "beta2_decay": -0.8}}


@pytest.mark.parametrize("impl", kernels.cpu_backends())
@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
@pytest.mark.parametrize("case", list(ADAFACTOR_CASES.values()), ids=list(ADAFACTOR_CASES))
def test_adafactor_options_match_float64_reference(case, options, impl):
    """Relative step: the update x max(1e-3, rms(p)) per unit, decay with lr; beta2_t = 1 - t^-0.8 and no
    second-moment bias correction (momentum keeps its own); on every kernel (the passes run one unit at a time)."""
    tier, shape = case
    [p] = _params([shape], seed=4)
    p.data.mul_(0.05)  # weights whose RMS is near Adafactor's floor on some units, above it on others
    p.data[0].mul_(0.01)
    opt = SkewAdam([{"params": [p], "tier": tier, **options}], lr=_LR, betas=(0.9, 0.999), weight_decay=_WD,
                   impl=impl)
    g0 = opt.param_groups[0]
    bank = tier == "expert" and p.ndim == 3
    ref = RefParam(p.detach(), momentum=g0["use_momentum"], factored=g0["use_factored"], bank=bank)
    gen = torch.Generator().manual_seed(5)
    for step in range(8):
        [p.grad] = _grads([p], gen, step)
        opt.step()
        ref.step(p.grad, lr=_LR, betas=(0.9, 0.999), eps=g0["eps"], eps_mode=g0["eps_mode"], weight_decay=_WD,
                 **options)
        torch.testing.assert_close(p.detach(), ref.value, rtol=0, atol=1e-12, msg=lambda m: f"step {step + 1}: {m}")


def test_adafactor_options_change_the_update_and_nothing_else():
    """Not vacuous: each option moves the weights away from plain SkewAdam's, and it reaches the kernels as the
    record's own field (the kernels apply it in their passes; nothing is stepped around them)."""
    finals = {}
    for name, options in {"plain": {}, **OPTIONS}.items():
        [p] = _params([(3, 6, 7)], seed=6)
        opt = SkewAdam([{"params": [p], "tier": "expert", **options}], lr=_LR)
        gen = torch.Generator().manual_seed(7)
        for step in range(3):
            [p.grad] = _grads([p], gen, step)
            record = opt._init_group(opt.param_groups[0], 0, 0)[1]
            assert (record.relative_step, record.beta2_decay) == (options.get("relative_step", False),
                                                                  options.get("beta2_decay"))
            opt.step()
        finals[name] = p.detach().clone()
    for name in OPTIONS:
        assert (finals[name] - finals["plain"]).abs().max() > 1e-6, name


# --------------------------------------------------------------------------------------------- resume, refusals
def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return MoETransformer(get_config("tiny")).to(dtype)


def _train(model, opt, steps, seed):
    torch.manual_seed(seed)  # the router noise
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 256, (2, 32), generator=gen)
        model(idx, idx).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


RESUME = {
    "orthogonal_fp32": (torch.float32, {"orthogonal": True}),
    "orthogonal_experts_bf16_weights": (torch.bfloat16, {"orthogonal": "experts"}),
    "orthogonal_bf16_momentum": (torch.float32, {"orthogonal": True, "momentum_dtype": "bf16"}),
    "orthogonal_int8_momentum": (torch.float32, {"orthogonal": "experts", "momentum_dtype": "int8"}),
    "orthogonal_experts_int8_momentum": (torch.float32, {"orthogonal": "experts", "momentum_dtype": "int8",
                                                         "tier_options": {"expert": {"use_momentum": True}}}),
    "orthogonal_experts_momentum_bf16_weights": (torch.bfloat16, {"orthogonal": "experts",
                                                                  "tier_options": {"expert": {"use_momentum": True}}}),
    "relative_step": (torch.float32, {"relative_step": True}),
    "beta2_decay_bf16_weights": (torch.bfloat16, {"beta2_decay": -0.8}),
}


@pytest.mark.parametrize("dtype,kwargs", list(RESUME.values()), ids=list(RESUME))
def test_resume_from_a_saved_state_dict_is_bitwise(dtype, kwargs):
    """Train 3 steps, save (torch.save, weights_only load on CPU), load into a fresh model and optimizer, train 2
    more: bitwise the uninterrupted run, state dtypes kept (int8 / bf16 momentum, fp32 state of bf16 weights)."""
    model = _model(dtype)
    opt = SkewAdam.from_model(model, log=False, **kwargs)
    _train(model, opt, 3, seed=1)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, 2, seed=2)
    buf.seek(0)
    saved = torch.load(buf, map_location="cpu", weights_only=True)
    fresh = _model(dtype)
    fresh.load_state_dict(saved["model"])
    opt2 = SkewAdam.from_model(fresh, log=False, **kwargs)
    opt2.load_state_dict(saved["opt"])
    _train(fresh, opt2, 2, seed=2)
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n
    for a, b in zip(model.parameters(), fresh.parameters()):
        for k, v in opt.state[a].items():
            assert v.dtype == opt2.state[b][k].dtype and torch.equal(v, opt2.state[b][k]), k


def test_a_nonfinite_gradient_skips_the_orthogonal_and_the_fused_groups_together():
    model = _model()
    opt = SkewAdam.from_model(model, log=False, orthogonal=True)
    _train(model, opt, 1, seed=1)
    before = copy.deepcopy(model.state_dict())
    for culprit in ("blocks.0.attn.wq.weight", "blocks.1.moe.experts.w1"):  # orthogonal, then fused-kernel group
        idx = torch.randint(0, 256, (2, 32))
        model(idx, idx).loss.backward()
        dict(model.named_parameters())[culprit].grad.view(-1)[0] = float("nan")
        opt.step()
        opt.zero_grad()
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), culprit
    assert opt.skipped_steps == 2


def test_refusals_name_the_fix():
    vec, mat = _params([(5,), (4, 3)])
    with pytest.raises(ValueError, match=r"update='orthogonal' orthogonalises matrices.*shape \(5,\)"):
        SkewAdam([{"params": [vec], "update": "orthogonal"}])
    with pytest.raises(ValueError, match="relative_step and beta2_decay shape the Adam-style update"):
        SkewAdam([{"params": [mat], "update": "orthogonal", "relative_step": True}])
    with pytest.raises(ValueError, match="Invalid update"):
        SkewAdam([mat], update="muon")
    with pytest.raises(ValueError, match="Invalid beta2_decay.*-0.8"):
        SkewAdam([mat], beta2_decay=0.8)
    with pytest.raises(ValueError, match="keeps no second moment"):
        SkewAdam([{"params": [mat], "update": "orthogonal", "use_factored": True}])
    opt = SkewAdam([{"params": [mat], "update": "orthogonal"}])
    mat.grad = torch.ones_like(mat)
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["update"] == "orthogonal"  # loading restores it, as torch restores hyperparameters
    sd["param_groups"][0]["update"] = "adam"
    with pytest.raises(ValueError, match=r"state has keys.*missing \['exp_avg_sq'\]"):
        SkewAdam([mat]).load_state_dict(sd)  # momentum only: not an Adam-style group's state


# ------------------------------------------------------------------------------------------- hidden matrices
def test_hidden_matrices_of_the_reference_model_are_attention_and_dense_ffn():
    """Not the embeddings (tok_emb, pos_emb; the head is tok_emb itself), norms, router or experts."""
    model = _model()
    names = hidden_matrices(model)
    expect = [f"blocks.{i}.attn.{w}.weight" for i in range(2) for w in ("wq", "wk", "wv", "wo")]
    expect += [f"blocks.0.ffn.{w}.weight" for w in ("w1", "w2", "w3")]  # block 1 is the MoE layer
    assert sorted(names) == sorted(expect)
    assert not any(n.startswith(("tok_emb", "pos_emb")) or ".router." in n or ".experts." in n for n in names)


@pytest.mark.parametrize("tied", [False, True], ids=["untied_head", "tied_head"])
def test_hidden_matrices_of_a_transformers_moe_leave_out_embeddings_head_router_and_experts(tied):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                     num_experts_per_tok=2, tie_word_embeddings=tied)
    model = transformers.MixtralForCausalLM(cfg)
    names = hidden_matrices(model)
    assert sorted(names) == sorted(f"model.layers.{i}.self_attn.{w}_proj.weight" for i in range(2)
                                   for w in ("q", "k", "v", "o"))
    groups = param_groups(model, orthogonal="experts", log=False)
    orth = {n for g in groups if g.get("update") == "orthogonal" for n in g["param_names"]}
    experts = {n for g in groups if g["tier"] == "expert" for n in g["param_names"]}
    assert experts and experts <= orth and set(names) <= orth  # the fused expert banks [E, ...] are orthogonal too
    assert not any("embed" in n or "lm_head" in n or "norm" in n or ".gate." in n for n in orth)


def test_default_groups_and_labels_do_not_change():
    """``orthogonal`` is opt-in: without it, param_groups is what it was (one group per tier, no update key)."""
    model = _model()
    groups = param_groups(model, log=False)
    assert [g["tier"] for g in groups] == ["backbone", "expert", "router"]
    assert not any("update" in g for g in groups)
    opt = SkewAdam.from_model(model, log=False)
    assert {g["update"] for g in opt.param_groups} == {"adam"}


def test_an_untied_head_of_the_vocab_shape_is_not_a_hidden_matrix():
    """A plain module's untied LM head [V, D] (nanoGPT, torchtitan's ``output``) has the token table's shape: left
    out, while the square position table's shape [T, D] = [D, D] still admits hidden matrices."""
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = torch.nn.Embedding(50, 8), torch.nn.Embedding(8, 8)
            self.wq, self.up = torch.nn.Linear(8, 8), torch.nn.Linear(8, 24)
            self.head = torch.nn.Linear(8, 50, bias=False)

    assert hidden_matrices(LM()) == ["wq.weight", "up.weight"]


def test_orthogonal_is_overridable_per_group_and_per_name():
    """A list of names picks exactly those tensors; ``orthogonal_options`` sets those groups' settings (lr, momentum,
    momentum dtype) and nothing else's; state follows the group (momentum only, int8 with its scales)."""
    model = _model()
    pick = ["blocks.0.attn.wq.weight", "blocks.1.attn.wo.weight"]
    groups = param_groups(model, orthogonal=pick, log=False,
                          orthogonal_options={"lr": 7e-3, "betas": (0.9, 0.99), "momentum_dtype": "int8"})
    [orth] = [g for g in groups if g.get("update") == "orthogonal"]
    assert orth["param_names"] == pick and orth["lr"] == 7e-3 and orth["betas"] == (0.9, 0.99)
    assert all("lr" not in g and g.get("update") is None for g in groups if g is not orth)
    opt = SkewAdam(groups, lr=1e-3)
    _train(model, opt, 1, seed=1)
    named = dict(model.named_parameters())
    assert set(opt.state[named[pick[0]]]) == {"step", "exp_avg", "exp_avg_scale"}
    assert opt.state[named[pick[0]]]["exp_avg"].dtype == torch.int8
    assert "row_var" in opt.state[named["blocks.0.attn.wk.weight"]]  # not picked: the backbone's Adam-style state
    with pytest.raises(ValueError, match=r"orthogonal names \['nope'\] are not trainable parameters"):
        param_groups(model, orthogonal=["nope"], log=False)


def test_the_planner_counts_the_gathered_bytes_of_sharded_hidden_matrices():
    """Under FSDP2 on N ranks (``Shard(0)``) each rank receives (N - 1) / N of every orthogonal matrix's fp32 update
    per step; banks sharded on experts and Adam-style arms gather nothing."""
    from skewadam import plan

    model = _model()
    hidden = sum(p.numel() for n, p in model.named_parameters() if n in set(hidden_matrices(model)))
    got = plan(model, optimizers=["skewadam", "skewadam-orthogonal", "skewadam-orthogonal-experts"], shards=4)
    assert got["skewadam"].gather_bytes == 0
    assert got["skewadam-orthogonal"].gather_bytes == hidden * 4 * 3 // 4
    assert got["skewadam-orthogonal-experts"].gather_bytes == hidden * 4 * 3 // 4  # its banks [E, A, B]: no gather


def test_the_orthogonal_kernel_refuses_records_that_do_not_fit_naming_the_parameter():
    """Every size `orthogonal.grad_stats` and `orthogonal.step_` index with is checked before anything is written:
    gradient, momentum, a bank's step counts, the statistics pass 1 hands to the update."""
    from skewadam.kernels.types import Group, ParamTensors

    def record(p, g, step, m=None, bank=False):
        return ParamTensors(p, g, step, m, None, None, None, None, tuple(p.shape), bank, 0, "w ('blocks.0.wq')")

    p, e = torch.zeros(4, 3), torch.zeros(2, 4, 3)
    cases = [
        (record(p, torch.zeros(3, 4), torch.zeros(())), r"'blocks.0.wq'.*gradient of shape \(3, 4\)"),
        (record(p, torch.zeros(4, 3), torch.zeros(()), torch.zeros(4, 2)),
         r"state 'exp_avg' has shape \(4, 2\), a parameter of shape \(4, 3\) needs shape \(4, 3\)"),
        (record(e, torch.zeros(2, 4, 3), torch.zeros(3), bank=True), r"step of shape \(3,\), expected .*\(2,\)"),
        (record(torch.zeros(5), torch.zeros(5), torch.zeros(())), r"takes matrices \[A, B\]"),
    ]
    for pt, match in cases:
        group = Group([pt], 1e-2, 0.95, 0.999, 1e-30, "add", 0.0, 0)
        before = [t.clone() for t in (pt.param, pt.step)]
        with pytest.raises(ValueError, match=match):
            orthogonal.grad_stats(group)
        with pytest.raises(ValueError, match=match):
            orthogonal.step_(group, [torch.ones((1, 1))])
        assert all(torch.equal(a, b) for a, b in zip(before, (pt.param, pt.step)))
    bank = Group([record(e, torch.ones(2, 4, 3), torch.zeros(2), bank=True)], 1e-2, 0.95, 0.999, 1e-30, "add", 0.0, 0)
    with pytest.raises(ValueError, match=r"pass-1 statistic has shape \(3, 1, 1\), expected \(2, 1, 1\)"):
        orthogonal.step_(bank, [torch.ones(3, 1, 1)])
    assert not e.any() and not bank.params[0].step.any()
    orthogonal.step_(bank, orthogonal.grad_stats(bank))  # the statistics pass 1 gives fit
    assert e.any() and bank.params[0].step.tolist() == [1.0, 1.0]


def test_the_recommended_recipe_builds_the_arm_with_int8_expert_momentum():
    """The recipe's settings spelled out (``orthogonal="experts"``, ``orthogonal_options={"use_momentum": True}``,
    ``momentum_dtype="int8"``, ``ns_dtype="auto"``, expert slices at ``ns_interval=4``) give the groups of arm
    skewadam-quality: every orthogonal group, the experts' too, keeps int8 momentum; the router keeps none; the state
    is what the planner counts."""
    model = _model()
    recipe = SkewAdam.from_model(model, log=False, lr=1e-2, orthogonal="experts",
                                 orthogonal_options={"use_momentum": True}, momentum_dtype="int8", ns_dtype="auto",
                                 tier_options={"expert": {"ns_interval": 4}})
    arm = arms.get("skewadam-quality").build(model, lr=1e-2)
    keys = ("tier", "update", "use_momentum", "use_factored", "momentum_dtype", "betas", "ns_dtype", "ns_interval",
            "param_names")
    assert [[g[k] for k in keys] for g in recipe.param_groups] == [[g[k] for k in keys] for g in arm.param_groups]
    orth = [g for g in recipe.param_groups if g["update"] == "orthogonal"]
    assert {g["tier"] for g in orth} == {"backbone", "expert"} and all(g["use_momentum"] for g in orth)
    assert [g["use_momentum"] for g in recipe.param_groups if g["tier"] == "router"] == [False]
    _train(model, recipe, 1, seed=0)
    for g in orth:
        for p in g["params"]:
            assert recipe.state[p]["exp_avg"].dtype == torch.int8
    planned = plan(model, optimizers=["skewadam-quality"])
    assert planned["skewadam-quality"].state.statistics == recipe.state_bytes().statistics
