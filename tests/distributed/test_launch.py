"""The launch harness (`launch.launch`): a launch is judged by the results it wrote; gloo's abort at process exit is
retried, any other failure is not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from launch import ATTEMPTS, GLOO_EXIT_ABORT, launch


def _script(tmp_path: Path, body: str) -> list[str]:
    """A command running ``body`` with ``out`` (the results file) and ``runs`` (a launch counter file) defined."""
    code = (f"import json, os, sys, pathlib\nout = pathlib.Path({str(tmp_path / 'results.json')!r})\n"
            f"runs = pathlib.Path({str(tmp_path / 'runs')!r})\n"
            f"n = int(runs.read_text()) + 1 if runs.exists() else 1\nruns.write_text(str(n))\n{body}")
    return [sys.executable, "-c", code]


ABORT = f"sys.stderr.write({GLOO_EXIT_ABORT!r} + '\\n'); sys.stderr.flush(); os.abort()"


def test_a_launch_that_aborts_at_exit_after_writing_its_results_is_accepted(tmp_path):
    launch(_script(tmp_path, f"out.write_text(json.dumps({{'ok': 1}}))\n{ABORT}"), result=tmp_path / "results.json")
    assert (tmp_path / "runs").read_text() == "1"


def test_a_launch_that_aborts_before_its_results_are_written_is_retried(tmp_path):
    body = f"if n < 2:\n    {ABORT}\nout.write_text(json.dumps({{'ok': n}}))"
    launch(_script(tmp_path, body), result=tmp_path / "results.json")
    assert (tmp_path / "runs").read_text() == "2"


def test_a_stale_results_file_does_not_pass_for_a_new_launch(tmp_path):
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(pytest.fail.Exception, match=f"attempt {ATTEMPTS}"):
        launch(_script(tmp_path, ABORT), result=tmp_path / "results.json")
    assert (tmp_path / "runs").read_text() == str(ATTEMPTS)


def test_a_half_written_results_file_is_not_complete(tmp_path):
    with pytest.raises(pytest.fail.Exception):
        launch(_script(tmp_path, f"out.write_text('{{\"ok\": ')\n{ABORT}"), result=tmp_path / "results.json")


def test_any_other_failure_fails_at_once_with_the_output(tmp_path):
    with pytest.raises(pytest.fail.Exception, match="ZeroDivisionError"):
        launch(_script(tmp_path, f"out.write_text('{{}}')\n1 / 0"), result=tmp_path / "results.json")
    assert (tmp_path / "runs").read_text() == "1"
