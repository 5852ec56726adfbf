"""The docs' code runs: every ```python block of the README and the guide executes, on small models; every ```bash
command is run when cheap and parsed by its real argparse parser when not; the README's relative links resolve.

How a page's code is run (the contract a docs writer follows):

- A page's ```python blocks run in order, in one namespace, in a fresh temporary directory (a later block may use
  what an earlier one made, as a reader would).
- ``<!-- docs-test: setup`` ... ``-->``: code in an HTML comment (the rendered page does not show it) that runs
  where it stands: the small model a block calls ``model``, a dataset, an import. Keep it minimal.
- ``<!-- docs-test: compile-only REASON -->`` right before a block: the block is compiled, not run (it needs a GPU
  or several processes); REASON says which.
- ```bash blocks: comments and line continuations are read as a shell would; commands joined by ``&&`` are
  checked one by one. ``skewadam plan`` (without ``--measure``), ``skewadam tiers``, any ``--help`` and
  ``skewadam bench --preset smoke`` run in-process; every other ``skewadam`` command, every ``python SCRIPT`` and
  ``torchrun ... SCRIPT`` is parsed by its real parser (the CLI's, the script's own argparse) so a renamed flag
  fails; ``python -c`` runs; ``pip install`` names extras of pyproject.toml and pins of constraints.txt; a command
  the checker does not know fails. A path ending in ``config.json`` that does not exist is made first, a tiny
  Mixtral config (the docs' placeholder for "your config").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
import runpy
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The pages whose code runs: the README, the site's home, its development page and the guide.
PAGES = sorted({ROOT / "README.md", ROOT / "docs" / "index.md", ROOT / "docs" / "development.md",
                *(ROOT / "docs" / "guide").glob("*.md")})

@dataclasses.dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    setup: str = ""  # docs-test setup comments since the previous block
    compile_only: str = ""  # the reason, when the block is compiled only

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


_FENCE = re.compile(r"^(?P<indent>[ ]{0,3})(?P<fence>`{3,})(?P<lang>[\w+-]*)[^\n]*$")
_SETUP = re.compile(r"<!--\s*docs-test:\s*setup\s*\n(?P<code>.*?)-->", re.S)
_COMPILE_ONLY = re.compile(r"<!--\s*docs-test:\s*compile-only\s+(?P<why>[^\n]*?)\s*-->\s*$")  # right before


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page`` in order, each with the docs-test comments that precede it."""
    out, lines, i, between = [], page.read_text().splitlines(), 0, []
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            between.append(lines[i])
            i += 1
            continue
        start, fence, body = i, m["fence"], []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(m["indent"]):])
            i += 1
        i += 1
        text = "\n".join(between)
        setup = "".join(s["code"] for s in _SETUP.finditer(text))
        only = _COMPILE_ONLY.search(text)
        out.append(Block(page, start + 1, m["lang"], "\n".join(body) + "\n", setup, only["why"] if only else ""))
        between = []
    return out


# ---------------------------------------------------------------------------------------------------- python
@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if any(b.lang == "python" for b in blocks(p))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_of_the_page_runs(page, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    for block in (b for b in blocks(page) if b.lang == "python"):
        if block.setup:
            exec(compile(block.setup, f"{block.where} (setup)", "exec"), namespace)
        code = compile(block.code, block.where, "exec")
        ran += 1
        if block.compile_only:
            continue
        try:
            exec(code, namespace)
        except Exception as e:
            raise AssertionError(f"{block.where}: the block raised {type(e).__name__}: {e}") from e
    assert ran, f"{page}: no python block"


# ------------------------------------------------------------------------------------------------------ bash
def commands(block: Block) -> list[list[str]]:
    """The commands of a bash block as argv lists: continuations joined, comments dropped, ``&&`` split."""
    text = block.code.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            out.append(words[:cut])
            words = words[cut + 1:]
    return [argv for argv in out if argv]


_BASH = [(b, argv) for p in PAGES for b in blocks(p) if b.lang in ("bash", "sh", "shell") for argv in commands(b)]


class _Parsed(Exception):
    """Raised by the patched ``parse_args``: the script's parser accepted its arguments."""


def _parse_script(script: str, args: list[str], monkeypatch) -> None:
    """Run ``script``'s own argparse parser on ``args`` (the script stops right after parsing)."""
    path = ROOT / script
    assert path.is_file(), f"no such script: {script}"
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, argv=None, namespace=None):
        parse(self, argv, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    with pytest.raises(_Parsed):
        runpy.run_path(str(path), run_name="__main__")


def _make_placeholders(argv: list[str]) -> None:
    for arg in argv:
        if arg.endswith("config.json") and not Path(arg).exists():
            transformers = pytest.importorskip("transformers")
            Path(arg).parent.mkdir(parents=True, exist_ok=True)
            transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       num_local_experts=8).to_json_file(arg)


def _cheap(args: list[str]) -> bool:
    if "--help" in args or "-h" in args:
        return True
    if args[0] in ("plan", "tiers"):
        return "--measure" not in args
    return args[:1] == ["bench"] and args[args.index("--preset") + 1:][:1] == ["smoke"] if "--preset" in args \
        else False


def _skewadam(args: list[str], tmp_path: Path) -> None:
    from skewadam.cli import build_parser, main

    _make_placeholders(args)
    if not _cheap(args):
        build_parser().parse_args(args)
        return
    if args[0] == "bench" and "--out" not in args:
        args = [*args, "--out", str(tmp_path / "bench")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = main(args)
        except SystemExit as e:
            code = e.code
    assert code in (0, None), f"`skewadam {' '.join(args)}` exited {code}:\n{out.getvalue()[-2000:]}"
    assert out.getvalue().strip(), f"`skewadam {' '.join(args)}` printed nothing"


def _pip(args: list[str]) -> None:
    assert args[0] == "install", args
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    pins = dict(re.findall(r"^([\w.-]+)==(\S+)", (ROOT / "constraints.txt").read_text(), re.M))
    for i, arg in enumerate(args[1:], 1):
        if args[i - 1] == "-c":
            assert (ROOT / arg).is_file(), f"no constraints file {arg}"
        elif m := re.fullmatch(r"(?:\.|-e \.|skewadam)\[([\w,-]+)\]", arg):
            assert set(m[1].split(",")) <= extras, f"`{arg}`: pyproject.toml's extras are {sorted(extras)}"
        elif m := re.fullmatch(r"([\w.-]+)==(\S+)", arg):
            assert pins.get(m[1]) == m[2], f"`{arg}`: constraints.txt pins {m[1]}=={pins.get(m[1])}"


@pytest.mark.slow
@pytest.mark.parametrize("block, argv", _BASH, ids=[f"{b.where}:{' '.join(a)[:60]}" for b, a in _BASH])
def test_every_bash_command_runs_or_parses(block, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):  # VAR=value before a command
        name, value = argv[0].split("=", 1)
        monkeypatch.setenv(name, value)
        argv = argv[1:]
    cmd, args = argv[0], argv[1:]
    if cmd == "skewadam":
        _skewadam(args, tmp_path)
    elif cmd in ("python", "python3") and args[:2] == ["-m", "skewadam"]:
        _skewadam(args[2:], tmp_path)
    elif cmd in ("python", "python3") and args[:2] == ["-m", "pytest"]:
        named = [a.split("::")[0] for a in args[2:] if not a.startswith("-") and "/" in a]
        assert all((ROOT / t).exists() for t in named), f"`{' '.join(argv)}` names a test file that is not there"
    elif cmd in ("python", "python3") and args[:1] == ["-c"]:
        exec(compile(args[1], f"{block.where} (python -c)", "exec"), {"__name__": "__main__"})
    elif cmd in ("python", "python3"):
        _parse_script(args[0], args[1:], monkeypatch)
    elif cmd == "torchrun":
        from torch.distributed.run import parse_args

        launch = parse_args(args)
        _parse_script(launch.training_script, launch.training_script_args, monkeypatch)
    elif cmd == "pip":
        _pip(args)
    else:
        pytest.fail(f"{block.where}: `{cmd}` is no command this checker knows: teach it, or leave it out of bash "
                    "blocks")


def test_the_checker_reads_a_shell_block_as_a_shell_would():
    block = Block(ROOT / "x.md", 1, "bash", "a --x 1 \\\n  --y 'two words'  # note\nb && c -z  # more\n")
    assert commands(block) == [["a", "--x", "1", "--y", "two words"], ["b"], ["c", "-z"]]


def test_a_renamed_flag_fails_the_script_parser(monkeypatch):
    _parse_script("examples/train_fsdp.py", ["--steps", "5"], monkeypatch)
    with pytest.raises(SystemExit):
        _parse_script("examples/train_fsdp.py", ["--stepz", "5"], monkeypatch)


# ----------------------------------------------------------------------------------------------------- links
_LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of ``page``: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#{1,6}\s+(.*)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "CHANGELOG.md"], ids=lambda p: p.name)
def test_the_readmes_relative_links_resolve(page):
    """README.md and CHANGELOG.md (read on GitHub, outside the site) link files and anchors that exist."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in (m["target"] for m in _LINK.finditer(text)):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert not broken, f"{page.name}: links that resolve to nothing: {broken}"
