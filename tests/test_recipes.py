"""Recipes (`skewadam.recipes`): `SkewAdam.from_model(model, recipe=...)` builds each one's configuration at its lr,
explicit arguments override it, and the state and Newton-Schulz FLOPs each recipe states for `paper-6.78b` are what
the census, the planner and a FLOP counter give. Also `from_model`'s census in print (``verbose``) and its refusal of
what is not a model."""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from skewadam import SkewAdam, plan
from skewadam.classify import label
from skewadam.groups import describe, orthogonal_flops, orthogonal_names, split_kwargs
from skewadam.kernels import orthogonal as orthogonal_kernel
from skewadam.kernels.orthogonal import newton_schulz
from skewadam.bench.models import MoETransformer, get_config
from skewadam.recipes import RECIPES, apply
from skewadam.state import format_bytes


def _groups(opt: SkewAdam) -> list[dict]:
    """The param groups without their tensors, for comparing two optimizers' configurations."""
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _model():
    torch.manual_seed(0)
    return MoETransformer(get_config("tiny"))


@pytest.fixture(scope="module")
def paper_model():
    with torch.device("meta"):
        model = MoETransformer(get_config("paper-6.78b"))
    return model, label(model)


# ------------------------------------------------------------------------------------------------ from_model
def test_from_model_without_a_recipe_is_the_paper_recipe_at_its_lr():
    model = _model()
    default = SkewAdam.from_model(model, log=False)
    assert _groups(default) == _groups(SkewAdam.from_model(model, recipe="paper", log=False))
    assert default.defaults["lr"] == RECIPES["paper"].lr == 1e-3
    assert {g["update"] for g in default.param_groups} == {"adam"}


def test_the_quality_recipe_is_the_studys_best_configuration_at_its_lr():
    """Every orthogonal group keeps int8 momentum and asks for bf16 Newton-Schulz where the device has it; the expert
    slices alone are orthogonalised every 4th step (docs/study/cheaper.md)."""
    model = _model()
    opt = SkewAdam.from_model(model, recipe="quality", log=False)
    spelled = SkewAdam.from_model(model, lr=3e-3, orthogonal="experts", orthogonal_options={"use_momentum": True},
                                  momentum_dtype="int8", ns_dtype="auto", tier_options={"expert": {"ns_interval": 4}},
                                  log=False)
    assert _groups(opt) == _groups(spelled) and opt.defaults == spelled.defaults
    orth = [g for g in opt.param_groups if g["update"] == "orthogonal"]
    assert {g["tier"] for g in orth} == {"backbone", "expert"}
    assert all(g["use_momentum"] and g["momentum_dtype"] == "int8" and g["ns_dtype"] == "auto" for g in orth)
    assert {g["tier"]: g["ns_interval"] for g in orth} == {"backbone": 1, "expert": 4}
    assert opt.defaults["lr"] == 3e-3


@pytest.mark.parametrize("native", [True, False], ids=["bf16_matmuls", "emulated_bf16"])
def test_the_quality_recipe_runs_newton_schulz_in_bf16_exactly_where_the_cpu_multiplies_bf16_natively(monkeypatch,
                                                                                                     native):
    """``ns_dtype="auto"``: bf16 on a CPU with AVX512-BF16 or AMX as torch reports it, fp32 (the fp32 weights' dtype)
    on one that emulates bf16; both asserted here whatever this machine's CPU is."""
    orthogonal_kernel.bf16_matmuls.cache_clear()
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    seen, original = [], orthogonal_kernel.newton_schulz_
    monkeypatch.setattr(orthogonal_kernel, "newton_schulz_", lambda x, *a: seen.append(x.dtype) or original(x, *a))
    try:
        model = _model()
        opt = SkewAdam.from_model(model, recipe="quality", log=False)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    finally:
        orthogonal_kernel.bf16_matmuls.cache_clear()
    assert seen and set(seen) == {torch.bfloat16 if native else torch.float32}


def test_the_lean_recipe_keeps_int8_momentum_and_the_least_state():
    model = _model()
    bytes_ = {name: describe(model, defaults=split_kwargs({"recipe": name})[1]).state_bytes
              for name in ("paper", "lean")}
    assert SkewAdam.from_model(model, recipe="lean", log=False).defaults["momentum_dtype"] == "int8"
    assert bytes_["lean"] < bytes_["paper"]


def test_explicit_keyword_arguments_override_a_recipe_and_dicts_key_by_key():
    model = _model()
    opt = SkewAdam.from_model(model, recipe="quality", lr=1e-3, momentum_dtype="bf16",
                              orthogonal_options={"lr": 5e-3}, log=False)
    assert opt.defaults["lr"] == 1e-3 != RECIPES["quality"].lr and opt.defaults["momentum_dtype"] == "bf16"
    orth = [g for g in opt.param_groups if g["update"] == "orthogonal"]
    assert orth and all(g["lr"] == 5e-3 and g["use_momentum"] for g in orth)  # the recipe's use_momentum stays
    assert apply("quality", {"orthogonal": False})["orthogonal"] is False
    assert RECIPES["quality"].settings["orthogonal_options"] == {"use_momentum": True}  # the registry is untouched


@pytest.mark.parametrize("recipe", ["fast", ["quality"], ("lean",), None, 3, {"quality": 1}])
def test_an_unknown_recipe_or_one_not_a_name_is_refused_naming_the_recipes(recipe):
    """A list, a tuple, None, a number or a dict (unhashable ones included) is refused as an unknown name is."""
    with pytest.raises(ValueError, match=re.escape(f"unknown recipe {recipe!r}: recipe= takes one name, one of "
                                                   f"paper, lean, quality")):
        SkewAdam.from_model(_model(), recipe=recipe)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_recipe_is_the_bench_arm_of_its_name(name):
    """``skewadam`` is the paper recipe's arm, ``skewadam-<recipe>`` each other's: the same param groups and
    settings as ``from_model(recipe=...)`` at one lr and weight decay (the bench's arms set their own)."""
    from skewadam.bench import arms

    model = _model()
    arm = arms.get("skewadam" if name == "paper" else f"skewadam-{name}")
    built = arm.build(model, lr=RECIPES[name].lr, weight_decay=0.0)
    made = SkewAdam.from_model(model, recipe=name)
    assert built.defaults == made.defaults
    assert [{**g, "params": [id(p) for p in g["params"]]} for g in built.param_groups] == \
        [{**g, "params": [id(p) for p in g["params"]]} for g in made.param_groups]


# ------------------------------------------------------------------------------------------------ stated figures
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_recipe_states_the_state_the_census_and_the_planner_give_on_the_papers_model(name, paper_model):
    model, found = paper_model
    recipe = RECIPES[name]
    group, opt = split_kwargs({"recipe": name})
    census = describe(model, labels=found, tier_options=group.get("tier_options"), defaults=opt,
                      orthogonal=group.get("orthogonal", False), orthogonal_options=group.get("orthogonal_options"))
    adamw = 2 * 4 * sum(p.numel() for p in found.trainable.values())  # fp32 exp_avg and exp_avg_sq
    assert recipe.state.startswith(f"{format_bytes(census.state_bytes)} ({census.state_bytes / adamw:.3f}x AdamW's "
                                   f"{format_bytes(adamw)}; ")
    (arm,) = re.findall(r"skewadam plan paper-6\.78b --optimizer (\S+)\)$", recipe.state)
    assert plan(model, optimizers=[arm])[arm].state.statistics == census.state_bytes


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_recipe_states_its_newton_schulz_flops_on_the_papers_model(name, paper_model):
    """Per step on average under the recipe's own settings: the hidden matrices every step, the expert slices every
    ``ns_interval``-th of theirs."""
    model, found = paper_model
    group, opt = split_kwargs({"recipe": name})
    orthogonal = group.get("orthogonal", False)
    flops = orthogonal_flops(model, orthogonal, found, defaults=opt, tier_options=group.get("tier_options"),
                             orthogonal_options=group.get("orthogonal_options"))
    if not orthogonal:
        assert flops == 0 and RECIPES[name].compute.startswith("none")
        return
    hidden = orthogonal_flops(model, True, found)
    every = group.get("tier_options", {}).get("expert", {}).get("ns_interval", 1)
    experts = (orthogonal_flops(model, orthogonal, found) - hidden) // every
    assert flops == hidden + experts
    slices = sum(found.trainable[n].shape[0] for n, t in found.tiers.items() if t == "expert")  # banks [E, A, B]
    assert RECIPES[name].compute.startswith(
        f"{_e(flops)} Newton-Schulz FLOPs per step on average ({_e(hidden)} for the {len(found.hidden)} hidden "
        f"matrices every step, {_e(experts * every)} for the {slices} expert slices every {every}th)")


def _e(x: float) -> str:
    """``x`` as the recipes write FLOPs: ``8.1e14``."""
    return f"{x:.1e}".replace("e+", "e")


def test_orthogonal_flops_are_the_matmul_flops_torch_counts_for_newton_schulz():
    model = _model()
    names = orthogonal_names(model, label(model), "experts")
    shapes = {n: p.shape for n, p in model.named_parameters() if n in set(names)}
    counter = FlopCounterMode(display=False)
    with counter:
        for shape in shapes.values():
            newton_schulz(torch.randn(shape))
    assert orthogonal_flops(model, "experts") == counter.get_total_flops() > 0


# ------------------------------------------------------------------------------------------------ the census, bad input
def test_verbose_prints_the_census_where_the_user_looks(capsys):
    SkewAdam.from_model(_model(), recipe="quality", verbose=True, log=False)
    out = capsys.readouterr().out
    assert out.startswith("SkewAdam tiers of MoETransformer") and all(t in out for t in ("backbone", "expert",
                                                                                         "router", "total"))
    SkewAdam.from_model(_model(), log=False)
    assert capsys.readouterr().out == ""  # quiet unless asked


def test_from_model_given_parameters_says_in_one_line_to_pass_the_model():
    model = _model()
    with pytest.raises(TypeError) as caught:
        SkewAdam.from_model(list(model.parameters()))
    message = str(caught.value)
    assert "\n" not in message and message.startswith("expected the model (an nn.Module), got list")
    assert "SkewAdam(params, tier=" in message
