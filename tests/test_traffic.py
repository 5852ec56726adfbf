"""The memory-traffic model (`skewadam.kernels.traffic`): the bytes each kernel's passes move per tier, dtype and
momentum storage, the C++ kernel's schedule by what fits a core's cache, the guide's tables as the model gives them,
and ``skewadam bench-step --roofline`` dividing the model's bytes by the times it measures."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from skewadam.bench import roofline
from skewadam.bench.bench_step import page_size
from skewadam.cli import main
from skewadam.kernels import cpu, traffic
from skewadam.state import state_flags

F32, BF16 = torch.float32, torch.bfloat16
MiB = 1 << 20
GUIDE = Path(__file__).parents[1] / "docs" / "guide" / "kernels.md"

# (label, shape, flags): the rows of the guide's traffic table
EXPERT = state_flags({"tier": "expert"})
MATRIX = state_flags({"tier": "backbone"})
FULL = state_flags({"tier": "router"})
ONE_D = MATRIX
ROWS = [
    ("expert bank [32, 1024, 256]", (32, 1024, 256), EXPERT, "fp32"),
    ("expert bank [8, 2048, 1024]", (8, 2048, 1024), EXPERT, "fp32"),
    ("backbone matrix [512, 256], momentum", (512, 256), MATRIX, "fp32"),
    ("backbone matrix [4096, 256], momentum", (4096, 256), MATRIX, "fp32"),
    ("backbone matrix [512, 256], bf16 momentum", (512, 256), MATRIX, "bf16"),
    ("backbone matrix [4096, 256], bf16 momentum", (4096, 256), MATRIX, "bf16"),
    ("backbone matrix [512, 256], int8 momentum", (512, 256), MATRIX, "int8"),
    ("backbone matrix [4096, 256], int8 momentum", (4096, 256), MATRIX, "int8"),
    ("router [64, 1024] (full second moment)", (64, 1024), FULL, "fp32"),
    ("router [512, 1024]", (512, 1024), FULL, "fp32"),
    ("1-D [65536] (momentum, full second moment)", (65536,), ONE_D, "fp32"),
    ("1-D [1048576]", (1048576,), ONE_D, "fp32"),
]


def _per_param(t: traffic.Traffic, numel: int) -> list[float]:
    return [(p.read + p.written) / numel for p in t.passes] + [t.bytes / numel]


def test_an_expert_bank_in_a_core_cache_moves_16_bytes_a_parameter_in_fp32_and_8_in_bf16():
    # pass 1 reads g; pass 2 re-reads it from the cache; pass 3 reads g and p, writes p
    for dtype, size in ((F32, 4), (BF16, 2)):
        t = traffic.cpp((32, 1024, 256), dtype, EXPERT, cache=MiB)
        assert t.schedule == "early" and _per_param(t, 32 * 1024 * 256) == [size, 0, 3 * size, 4 * size]
        assert t.read == 3 * size * 32 * 1024 * 256  # g twice and p: 3/4 of AdamW's reads


def test_without_the_non_finite_check_an_fp32_expert_slice_reads_its_gradient_once():
    # skip_nonfinite=False: pass 3 right after pass 2, the gradient in cache; bf16 keys wait for every slice's pass 1
    n = 32 * 1024 * 256
    for dtype, size, schedule, reads in ((F32, 4, "whole", 2), (torch.float64, 8, "whole", 2), (BF16, 2, "early", 3)):
        t = traffic.cpp((32, 1024, 256), dtype, EXPERT, skip_nonfinite=False, cache=MiB // 2 * size)
        assert (t.schedule, t.read) == (schedule, reads * size * n)


def test_adamw_reads_four_streams_and_writes_three_a_stream_reads_two_and_writes_one():
    for dtype, size in ((F32, 4), (BF16, 2)):
        adamw, stream = traffic.adamw(10, dtype), traffic.stream(10, dtype)
        assert (adamw.read, adamw.bytes) == (40 * size, 70 * size)
        assert (stream.read, stream.bytes) == (20 * size, 30 * size)


def test_the_cpp_schedule_follows_what_fits_a_core_cache():
    shape = (32, 1024, 256)  # 1 MiB fp32 slices
    assert traffic.cpp(shape, F32, EXPERT, cache=MiB).schedule == "early"
    # a split fp32 slice takes its clip from pass 1's weighted column sums: no third read of its gradient
    split = traffic.cpp(shape, F32, EXPERT, cache=MiB // 2)
    assert split.schedule == "split" and _per_param(split, 32 * 1024 * 256) == [4, 0, 12, 16]
    big = (8, 2048, 1024)  # 8 MiB fp32 slices
    # fp64 statistics and bf16 slices above cpu.WEIGHTED_BF16_MAX keep pass 2, which reads the gradient a third time
    assert 2048 * 1024 * 2 > cpu.WEIGHTED_BF16_MAX
    assert _per_param(traffic.cpp(big, BF16, EXPERT, cache=MiB), 8 * 2048 * 1024) == [2, 2, 6, 10]
    assert _per_param(traffic.cpp(big, torch.float64, EXPERT, cache=MiB), 8 * 2048 * 1024) == [8, 8, 24, 40]
    # with momentum a unit is done whole when its pass-2 streams (g and m) fit: 24 bytes, else 28 (AdamW's)
    fused = traffic.cpp((256, 1024), F32, MATRIX, cache=2 * MiB)
    assert fused.schedule == "fused" and fused.bytes == 24 * 256 * 1024
    split = traffic.cpp((256, 1024), F32, MATRIX, cache=MiB)
    assert split.schedule == "split" and split.bytes == 28 * 256 * 1024



def test_the_model_schedules_for_this_machine_s_cache_by_default(monkeypatch):
    monkeypatch.setattr(cpu, "cache_bytes", lambda: 1 << 10)
    assert traffic.cpp((32, 1024, 256), F32, EXPERT).schedule == "split"
    monkeypatch.setattr(cpu, "cache_bytes", lambda: 1 << 30)
    assert traffic.cpp((32, 1024, 256), F32, EXPERT).schedule == "early"


def test_int8_momentum_counts_its_scales_and_a_relative_step_reads_the_weights_in_pass_1():
    t = traffic.cpp((4096, 256), F32, state_flags({"momentum_dtype": "int8"}), cache=MiB)
    codes_and_scales = 4096 * 256 + 4096 * 4  # one fp32 scale per 256 values
    assert t.passes[1] == traffic.Pass("pass 2", 4096 * 256 * 4 + codes_and_scales, codes_and_scales)
    rel = traffic.cpp((32, 1024, 256), F32, EXPERT, relative_step=True, cache=MiB)
    assert rel.passes[0].read == 2 * 32 * 1024 * 256 * 4


def test_triton_reads_in_every_pass_what_it_needs_from_memory_with_no_pass_2_for_weighted_units():
    n = 32 * 1024 * 256
    assert _per_param(traffic.triton((32, 1024, 256), F32, EXPERT), n) == [4, 0, 12, 16]
    assert _per_param(traffic.triton((32, 1024, 256), BF16, EXPERT), n) == [2, 0, 6, 8]
    assert _per_param(traffic.triton((32, 1024, 256), torch.float64, EXPERT), n) == [8, 8, 24, 40]
    assert _per_param(traffic.triton((4096, 256), F32, MATRIX), 4096 * 256) == [4, 12, 12, 28]
    assert _per_param(traffic.triton((65536,), F32, ONE_D), 65536) == [4, 20, 16, 40]


def _num(x: float) -> str:
    return f"{x:.0f}" if x == int(x) else f"{x:.2f}"


def _table_row(label, shape, flags, momentum, dtype) -> str:
    """A row of the guide's table: the C++ kernel's schedule (1 MiB cache), its bytes per parameter by pass and in
    all, over fused AdamW's, its reads over AdamW's; the Triton kernel's bytes, over AdamW's."""
    n = torch.Size(shape).numel()
    flags = flags._replace(momentum=momentum) if flags.momentum else flags
    t = traffic.cpp(shape, dtype, flags, cache=MiB)
    tr = traffic.triton(shape, dtype, flags)
    adamw = traffic.adamw(n, dtype)
    return (f"| {label} | {t.schedule} | {' | '.join(map(_num, _per_param(t, n)))} | {t.bytes / adamw.bytes:.2f} | "
            f"{t.read / adamw.read:.2f} | {_num(tr.bytes / n)} | {tr.bytes / adamw.bytes:.2f} |")


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_the_kernels_guide_tabulates_the_traffic_model(dtype):
    text = GUIDE.read_text()
    heading = {F32: "fp32 weights", BF16: "bf16 weights"}[dtype]
    section = text[text.index(f"Bytes per parameter, {heading}"):]
    for label, shape, flags, momentum in ROWS:
        row = _table_row(label, shape, flags, momentum, dtype)
        assert row in section[: section.index("\n\n", section.index("|"))], row


def test_roofline_divides_the_modeled_bytes_by_the_measured_times(monkeypatch, capsys):
    monkeypatch.setattr(roofline, "MOE", [("w", (64, 32), "backbone", {}), ("e", (2, 16, 8), "expert", {}),
                                          ("r", (4, 32), "router", {})])
    monkeypatch.setattr(roofline, "PATHS", [("big 1-D", [("b", (4096,), "backbone", {})])])
    res = roofline.roofline(rounds=2, steps=1, warmup=1)
    assert [r["row"] for r in res["rows"]] == ["backbone", "expert", "router", "all (one optimizer)", "big 1-D"]
    expert = res["rows"][1]
    assert expert["bytes"]["skewadam"] == traffic.cpp((2, 16, 8), F32, EXPERT).bytes
    assert expert["bytes"]["adamw"] == 28 * 256 and expert["bytes"]["stream"] == 12 * 256
    assert expert["reads"] == {"skewadam": 12 * 256, "adamw": 16 * 256}
    assert all(t > 0 for r in res["rows"] for t in r["median_s"].values())
    out = roofline.format_roofline(res)
    assert re.search(r"^expert \(early\) +256 +16\.00 .* 0\.75x +[0-9.]+x$", out, re.M), out
    assert res["add_over_dot"] > 0
    assert re.search(r"^a\.add_\(b\) / torch\.dot\(a, b\), fp32, the whole set's size: [0-9]+\.[0-9]{2} ", out, re.M)
    assert f"CPU: {res['cpu']}, {page_size()} pages; " in out
    assert main(["bench-step", "--roofline", "--rounds", "1", "--steps", "1", "--warmup", "0"]) == 0
    assert "eff/adamw" in capsys.readouterr().out
    unchecked = roofline.roofline(rounds=1, steps=1, warmup=0, skip_nonfinite=False)
    assert unchecked["rows"][1]["schedules"] == ["whole"] and unchecked["rows"][1]["reads"]["skewadam"] == 8 * 256
    assert "no non-finite check" in roofline.format_roofline(unchecked)


@pytest.mark.parametrize("argv, message", [
    (["--roofline", "--optimizers", "adamw"], "drop --preset, --optimizers"),
    (["--momentum", "int8"], "--momentum, --deepspeed and --unchecked go with --roofline"),
    (["--unchecked"], "--momentum, --deepspeed and --unchecked go with --roofline"),
])
def test_bench_step_refuses_options_that_do_not_go_with_roofline(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench-step", *argv])


def test_streams_benchmark_prints_each_op_with_the_traffic_models_stream_counts(capsys):
    spec = importlib.util.spec_from_file_location("streams", Path(__file__).parents[1] / "benchmarks" / "streams.py")
    streams = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(streams)
    streams.main(["--numel", "4096", "--rounds", "2", "--steps", "1"])
    out = capsys.readouterr().out
    assert re.search(r"^fused AdamW +4 +3 ", out, re.M) and re.search(r"^a\.add_\(b\) +2 +1 ", out, re.M), out
    assert re.search(r"^a\.add_\(b\) / dot\(a, b\): [0-9]+\.[0-9]{2} ", out, re.M), out
    assert f"{page_size()} pages; " in out
    with pytest.raises(SystemExit):
        streams.main(["--numel", "0"])


def _transparent_huge_pages(setting: str = "enabled") -> str | None:
    """This kernel's transparent huge page ``setting``, "enabled" (always, madvise, never) or "defrag" (always,
    defer, defer+madvise, madvise, never), or None where it has none."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage", setting).read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


@pytest.mark.parametrize("torch_asks", [False, True], ids=["THP_MEM_ALLOC_ENABLE unset", "THP_MEM_ALLOC_ENABLE=1"])
def test_page_size_reports_4_kib_unless_a_large_tensor_gets_huge_pages(torch_asks):
    """Under `madvise` a tensor gets 2 MiB pages where torch asks for them (the kernel compacting memory for them) and
    4 KiB ones where it does not; under `never` 4 KiB whatever it asks (under `always`, or a defrag setting that
    takes a huge page only if one is free, it depends on free memory: not checked)."""
    mode = _transparent_huge_pages()
    if mode not in ("madvise", "never") or not Path("/proc/self/smaps_rollup").exists():
        pytest.skip(f"transparent huge pages {mode!r}: what a tensor gets is not fixed here")
    huge = torch_asks and mode == "madvise"
    if huge and _transparent_huge_pages("defrag") not in ("always", "defer+madvise", "madvise"):
        pytest.skip("transparent huge page defrag does not compact for madvised memory: a huge page depends on free "
                    "memory")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if torch_asks:
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    code = "from skewadam.bench.bench_step import page_size; print(page_size())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == ("2 MiB" if huge else "4 KiB")
