"""The package's layout: every import (lazy ones too) follows the layer order its docstring states, the core imports
without the optional dependencies, and no module grows past ~500 lines."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import skewadam

SRC = Path(skewadam.__file__).parent
MODULES = sorted(SRC.rglob("*.py"))
OPTIONAL = ("transformers", "accelerate", "torchtitan", "matplotlib", "tqdm")


def _name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """The layer unit of a module: the package facade ``skewadam``, or its top-level module or subpackage."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "skewadam"


def _layers() -> tuple[dict[str, int], set[tuple[str, str]]]:
    """``{unit: layer}`` and the allowed exceptions ``{(importer, imported module)}``, parsed from the docstring."""
    doc = skewadam.__doc__
    layers = {}
    for number, units in re.findall(r"^\s+(\d+)\. (\S.*?)\s{2,}", doc, re.M):
        for unit in units.split(", "):
            layers[unit] = int(number)
    exceptions = {(a, b) for a, b in re.findall(r"``(\w+) -> (skewadam\.[\w.]+|[\w.]+)``", doc)}
    return layers, {(a, b if b.startswith("skewadam.") else f"skewadam.{b}") for a, b in exceptions}


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every skewadam module ``path`` imports, at any depth (function bodies included)."""
    module = _name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from pkg import module` imports the module, `from pkg import name` the package
                sub = f"{base}.{alias.name}"
                is_module = (SRC.parent / sub.replace(".", "/")).with_suffix(".py").exists() or \
                    (SRC.parent / sub.replace(".", "/") / "__init__.py").exists()
                out.append((node.lineno, sub if is_module else base))
    return [(line, m) for line, m in out if m.startswith("skewadam.")]  # `skewadam` itself is always loaded first


def _violations(imports: dict[str, list[tuple[int, str]]], layers, exceptions) -> tuple[list[str], set]:
    """Imports of a unit at or above the importer's layer, and the exceptions used: ``imports`` maps a module's
    name to its `_imports`."""
    wrong, used = [], set()
    for module, found in imports.items():
        importer = _unit(module)
        for line, target in found:
            unit = _unit(target)
            if unit == importer:
                continue  # within one module or package
            if (importer, target) in exceptions:
                used.add((importer, target))
            elif layers[unit] >= layers[importer]:
                wrong.append(f"{module}:{line} imports {target} (layer {layers[unit]} >= {importer}'s "
                             f"{layers[importer]})")
    return wrong, used


def test_every_import_follows_the_layer_order_in_the_package_docstring():
    layers, exceptions = _layers()
    assert {"tiers", "state", "kernels", "optimizer", "bench", "cli", "skewadam"} <= set(layers)
    unplaced = sorted({_unit(_name(p)) for p in MODULES} - set(layers))
    assert not unplaced, f"modules in no layer of the package docstring: {unplaced}"
    wrong, used = _violations({_name(p): _imports(p) for p in MODULES}, layers, exceptions)
    assert not wrong, "\n".join(wrong)
    assert used == exceptions, f"exceptions the code no longer needs: {sorted(exceptions - used)}"
    # the check can fail: an upward import, a same-layer one and an unlisted exception are each caught
    wrong, _ = _violations({"skewadam.state": [(1, "skewadam.optimizer.x"), (2, "skewadam.kernels.eager")],
                            "skewadam.classify": [(3, "skewadam.validation")],
                            "skewadam.optimizer": [(4, "skewadam.bench.arms")]}, layers, exceptions)
    assert [w.split(" ")[0] for w in wrong] == ["skewadam.state:1", "skewadam.state:2", "skewadam.classify:3",
                                                "skewadam.optimizer:4"]


def test_the_layer_check_sees_lazy_and_relative_imports():
    """The parser is not vacuous: a lazy import inside a function and ``from . import x`` are both found."""
    optimizer = SRC / "optimizer.py"
    found = dict((m, line) for line, m in _imports(optimizer))
    assert "skewadam.distributed" in found and "skewadam.groups" in found  # both imported inside methods
    assert "skewadam.kernels" in found  # `from . import kernels`
    lazy = [n for n in ast.walk(ast.parse(optimizer.read_text())) if isinstance(n, ast.FunctionDef)
            and any(isinstance(s, ast.ImportFrom) for s in ast.walk(n))]
    assert lazy


def test_the_core_imports_and_runs_without_the_optional_dependencies():
    """transformers, accelerate, torchtitan, matplotlib and tqdm blocked (``sys.modules[name] = None``, what an
    absent package looks like to ``import`` and ``importlib.util.find_spec``): every module but the integrations
    imports, SkewAdam steps, the planner plans, and the command line builds its parser."""
    modules = [_name(p) for p in MODULES if _unit(_name(p)) != "integrations" and p.name != "__main__.py"]
    code = textwrap.dedent(f"""
        import importlib, sys

        for m in {OPTIONAL!r}:  # as if not installed: `import m` raises ImportError, find_spec(m) is None
            sys.modules[m] = None
        for m in {modules!r}:
            importlib.import_module(m)
        import torch, skewadam, skewadam.cli
        p = torch.nn.Parameter(torch.randn(4, 3)); p.grad = torch.randn(4, 3)
        skewadam.SkewAdam([p]).step()
        assert skewadam.plan("paper-6.78b", optimizers=["skewadam"])["skewadam"].state.statistics == 1_380_029_764
        skewadam.cli.build_parser()
        try:
            import tqdm
        except ImportError:
            pass
        else:
            raise AssertionError("tqdm was not blocked")
        loaded = sorted(m for m, mod in sys.modules.items() if m.split(".")[0] in {OPTIONAL!r} and mod is not None)
        assert not loaded, loaded
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_triton_step_temporaries_are_counted_without_triton():
    """The planner asks ``BACKENDS["triton"].step_transient_bytes`` where triton is not installed: the module it names
    imports no triton and counts what it counts with triton; the kernel module itself says what to install."""
    from skewadam.kernels import BACKENDS

    tensors = [((8, 64, 32), True), ((64,), False), ((5, 9), False)]
    expected = BACKENDS["triton"].step_transient_bytes(tensors, torch.bfloat16)
    code = textwrap.dedent(f"""
        import sys

        sys.modules["triton"] = None  # as if not installed
        import torch
        from skewadam.kernels import BACKENDS

        assert BACKENDS["triton"].step_transient_bytes({tensors!r}, torch.bfloat16) == {expected}
        assert not BACKENDS["triton"].available("cuda")
        try:
            import skewadam.kernels.triton
        except ImportError as e:
            assert "pip install triton" in str(e), e
        else:
            raise AssertionError("skewadam.kernels.triton imported without triton")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert expected > 0 and proc.returncode == 0, proc.stderr[-3000:]


def test_no_module_is_over_500_lines():
    """Python modules and the C++ kernel's files alike (kernels/csrc: one translation unit and its headers)."""
    files = [*MODULES, *sorted((SRC / "kernels" / "csrc").glob("*.[ch]*"))]
    long = {str(p.relative_to(SRC)): n for p in files if (n := len(p.read_text().splitlines())) > 500}
    assert len(files) > len(MODULES) and not long, long


def test_the_optimizer_class_is_at_most_300_lines():
    """`SkewAdam` holds the param groups, their checks' calls, lazy state and the records; the step is
    `skewadam.functional`'s and the checks `skewadam.validation`'s."""
    tree = ast.parse((SRC / "optimizer.py").read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SkewAdam"]
    assert cls.end_lineno - cls.lineno + 1 <= 300
