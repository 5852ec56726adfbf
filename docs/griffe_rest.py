"""A griffe extension for the docs site: the docstrings' few reST constructs, in the Markdown the site renders.

The house writes Google-style docstrings the way torch.optim does: ``Example:`` sections of ``>>>`` lines, and
reST math (``:math:`x```, ``.. math::`` blocks) and ``.. Note::`` blocks where a formula or a deviation needs one.
``help()`` shows them as written; mkdocstrings parses only ``Examples:`` (plural) and Markdown, so this maps each
construct when the site loads a docstring, and leaves the source alone.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)
_INLINE_MATH = re.compile(r":math:`([^`]+)`")
_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)\.\. (?P<kind>math|Note|note|Warning|warning)::[ \t]*(?P<title>.*)\n"
                        r"(?P<body>(?:(?P=indent)[ \t]+\S.*\n|[ \t]*\n)*)", re.M)


def _directive(m: re.Match) -> str:
    indent, kind, title, body = m["indent"], m["kind"].lower(), m["title"].strip(), m["body"].rstrip()
    lines = [line.strip() for line in body.splitlines()]
    if kind == "math":
        return f"{indent}$$\n" + "".join(f"{indent}{line}\n" for line in lines if line) + f"{indent}$$\n\n"
    # an admonition: Markdown's `!!! note "title"` with the body indented by four spaces
    head = f'{indent}!!! {kind} "{title}"\n' if title else f"{indent}!!! {kind}\n"
    return head + "".join(f"{indent}    {line}\n" for line in lines) + "\n"


def rest_to_markdown(text: str) -> str:
    """The docstring ``text`` with ``Example:`` as ``Examples:``, reST math as ``$``/``$$`` and notes as admonitions."""
    text = _EXAMPLE.sub(r"\1Examples:", text)
    text = _DIRECTIVE.sub(_directive, text if text.endswith("\n") else text + "\n")
    return _INLINE_MATH.sub(lambda m: f"${m[1]}$", text)


class RestDocstrings(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rest_to_markdown(obj.docstring.value)
