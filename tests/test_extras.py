"""Optional dependencies (`skewadam.bench.extras`): found without importing them, and imported quietly (the lines
third-party packages log while loading are ours to silence; the user's warnings, and later ones, are not)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from skewadam.bench.extras import NOISY_LOGGERS, missing, quiet_imports


def test_missing_names_what_is_absent_and_what_for_without_importing(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if not installed
    assert missing({"tqdm": "progress bars", "json": "-", "no_such_module_xyz": "nothing"}) == [
        "tqdm (progress bars)", "no_such_module_xyz (nothing)"]


def test_quiet_imports_silences_the_noisy_loggers_only_inside_and_restores_them(caplog):
    log = logging.getLogger(NOISY_LOGGERS[0])
    log.setLevel(logging.INFO)
    with caplog.at_level(logging.WARNING):
        with quiet_imports():
            log.warning("Failed to load _C.so")  # silenced
            logging.getLogger("mine").warning("a warning of the user's")  # not ours to silence
            log.error("a real error")  # errors still show
        log.warning("later")  # restored
    assert [r.getMessage() for r in caplog.records] == ["a warning of the user's", "a real error", "later"]
    assert log.level == logging.INFO


def test_building_a_transformers_preset_prints_nothing_but_the_result():
    pytest.importorskip("transformers")
    code = textwrap.dedent("""
        from skewadam.bench.presets import load_model
        model = load_model("mixtral-8x7b")
        print(type(model).__name__)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "MixtralForCausalLM" and proc.stderr == ""
