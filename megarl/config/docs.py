"""Field docstrings of the schema (the string literal under each dataclass field)."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing


def field_docs(cls) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(cls=None) -> str:
    """Human-readable listing of every key, its default and its docstring."""
    from megarl.config.schema import MegaRLConfig

    cls = cls or MegaRLConfig
    lines = []
    for section in dataclasses.fields(cls):
        sub = typing.get_type_hints(cls)[section.name]
        lines.append(f"{section.name}:")
        docs = field_docs(sub)
        defaults = sub()
        for f in dataclasses.fields(sub):
            lines.append(f"  {f.name} = {getattr(defaults, f.name)!r}")
            lines.append(f"      {docs.get(f.name, '')}")
    return "\n".join(lines)
