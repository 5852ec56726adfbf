"""Where the C++ kernel is built (`skewadam.kernels.cpu._build_dir`): one folder per environment, keyed on everything
the build depends on, so environments sharing ``~/.cache/torch_extensions`` never rebuild over each other; a build
says so before it starts."""

from __future__ import annotations

import fnmatch
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from skewadam.kernels import cpu


def test_the_build_folder_changes_with_everything_the_build_depends_on(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name, folder = cpu._build_dir()
    assert folder == str(tmp_path / name) and cpu._build_dir() == (name, folder)  # deterministic
    changes = {
        "torch installation": lambda m: m.setattr(torch, "__file__", "/other/venv/site-packages/torch/__init__.py"),
        "torch version": lambda m: m.setattr(torch, "__version__", "0.0.1+other"),
        "python": lambda m: m.setattr(sys, "executable", "/other/venv/bin/python3"),
        "python version": lambda m: m.setattr(sys, "version", "3.0.0 (other)"),
        "flags": lambda m: m.setattr(cpu, "_CFLAGS", [*cpu._CFLAGS, "-DOTHER"]),
        "compiler": lambda m: m.setenv("CXX", "clang++"),
        "cpu": lambda m: m.setattr(cpu, "_cpu_id", lambda: "model name: other\nflags: sse2\n"),
        "source": lambda m: m.setattr(cpu, "_SOURCES", _edited(0, tmp_path)),
        "a header": lambda m: m.setattr(cpu, "_SOURCES", _edited(-1, tmp_path)),
    }
    seen = {name}
    for what, change in changes.items():
        with monkeypatch.context() as m:
            change(m)
            other, _ = cpu._build_dir()
        assert other not in seen, f"the build folder ignores the {what}"
        seen.add(other)


def _edited(i: int, folder: Path) -> tuple[Path, ...]:
    """The kernel's files with file ``i`` replaced by an edited copy of the same name."""
    dst = folder / "edited" / cpu._SOURCES[i].name
    dst.parent.mkdir(exist_ok=True)
    dst.write_text(cpu._SOURCES[i].read_text() + "// edited\n")
    return tuple(dst if f == cpu._SOURCES[i] else f for f in cpu._SOURCES)


def test_the_build_covers_every_file_of_the_kernel_and_the_package_ships_them():
    import tomllib

    csrc = Path(cpu.__file__).with_name("csrc")
    assert set(cpu._SOURCES) == set(csrc.iterdir()) and len(cpu._SOURCES) > 1
    text = "\n".join(f.read_text() for f in cpu._SOURCES)
    assert {f.name for f in cpu._SOURCES[1:]} == set(re.findall(r'#include "(\w+\.h)"', text))  # every header used
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["skewadam.kernels"]
    assert all(any(fnmatch.fnmatch(f"csrc/{f.name}", pattern) for pattern in shipped) for f in cpu._SOURCES)


def test_a_build_is_announced_before_it_starts_and_timed_after_and_compiles_a_copy_in_its_folder(
        monkeypatch, tmp_path, capsys):
    """The compiler is replaced by a fake that writes the library: what is checked is what `_load` tells and passes."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls = []
    lib = SimpleNamespace(fields=dict)  # no records to check against types.py

    def fake_load(name, sources, *, extra_cflags, extra_ldflags, build_directory):
        calls.append(sources)
        if len(calls) == 1:
            assert "compiling SkewAdam's C++ kernel, once per environment, ~1 min" in capsys.readouterr().err
        extra_ldflags.append("-lappended")  # as torch does: the flags of the build key must not change
        Path(build_directory, f"{name}.so").write_bytes(b"")
        return lib

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert cpu._load() is lib
    assert "compiled the C++ kernel in" in capsys.readouterr().err
    name, folder = cpu._build_dir()
    assert calls == [[str(Path(folder, "skewadam_cpu.cpp"))]]  # not the checkout: build.ninja names no worktree
    assert all(Path(folder, f.name).read_bytes() == f.read_bytes() for f in cpu._SOURCES) and cpu.built()
    assert cpu._load() is lib and capsys.readouterr().err == "" and len(calls) == 2  # built: loads silently


@pytest.mark.skipif(not cpu.available(), reason="no C++ compiler here")
def test_the_real_build_is_found_again_after_loading():
    cpu.load()
    assert cpu.built()  # the key does not change once torch has appended its flags
