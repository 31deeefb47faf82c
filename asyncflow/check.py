"""``asyncflow check``: load, build the IR, validate. Shared by every command."""
from __future__ import annotations

from asyncflow.diagnostics import Diagnostics
from asyncflow.dsl import ast
from asyncflow.dsl.load import load_file
from asyncflow.ir import Graph, build_graph


def check_file(path: str, sets=(), diags: Diagnostics | None = None) -> tuple[ast.Pipeline, Graph] | None:
    """The checked pipeline and its graph; every problem goes to ``diags`` (raised when not given)."""
    from asyncflow.compiler.passes.validate import validate

    own = diags is None
    diags = diags if diags is not None else Diagnostics()
    p = load_file(path, sets, diags)
    out = None
    if p is not None:
        g = build_graph(p)
        validate(g, diags)
        out = (p, g)
    if own:
        diags.raise_if_errors()
    return out if not diags.errors else None
