"""The study presets hold what their study claims: the 10x study (``--preset study-20m``) trains a model of at least
20M parameters with the bench model's expert share, for at least 1,000 steps, every arm over 3 learning rates, and
its model's hidden matrices are every attention and dense-FFN weight (none taken for a head by its shape)."""

from __future__ import annotations

from skewadam.bench import arms
from skewadam.bench.config import get_preset
from skewadam.bench.models import MoETransformer, get_config
from skewadam.classify import classify, hidden_matrices


def test_study_20m_trains_20m_parameters_for_1000_steps_with_3_lrs_per_arm():
    bench = get_preset("study-20m")
    model = MoETransformer(get_config(bench.base.model))
    params = dict(model.named_parameters())
    expert = sum(params[n].numel() for n, tier in classify(model).items() if tier == "expert")
    cpu = MoETransformer(get_config("cpu"))
    cpu_expert = sum(p.numel() for n, p in cpu.named_parameters() if classify(cpu)[n] == "expert")
    assert model.num_params() >= 20_000_000
    assert abs(expert / model.num_params() - cpu_expert / cpu.num_params()) < 0.01
    assert bench.base.steps >= 1000 and bench.base.threads == 1
    assert set(bench.optimizers) == {"adamw", "muon", "skewadam", "skewadam-lean",
                                     "skewadam-quality"}
    for name in bench.optimizers:
        grid = bench.lrs[name]
        assert len(grid) == 3 and list(grid) == sorted(grid), name
        assert name in arms.ARMS


def test_study_20m_model_orthogonalises_every_attention_and_dense_ffn_matrix():
    model = MoETransformer(get_config("cpu-20m"))
    expected = [n for n, p in model.named_parameters() if p.ndim == 2 and (".attn." in n or ".ffn." in n)]
    assert hidden_matrices(model) == expected
    assert len(expected) == 8 * 4 + 4 * 3  # 8 blocks' attention, 4 dense blocks' SwiGLU
