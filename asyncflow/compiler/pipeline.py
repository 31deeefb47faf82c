"""The compiler, read top to bottom: one named pass a line, source text to ExecutionPlan.

Each pass is ``fn(value, ctx) -> value``, pure (graph passes copy the graph, then annotate node
and edge ``meta``); :mod:`asyncflow.compiler.runner` runs them, stops on user errors after the
pass that found them, and names the pass in any internal error.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from asyncflow.compiler.passes.bind import bind
from asyncflow.compiler.passes.cost import cost
from asyncflow.compiler.passes.lower import lower
from asyncflow.compiler.passes.overlap import overlap
from asyncflow.compiler.passes.placement import placement
from asyncflow.compiler.passes.staleness import staleness
from asyncflow.compiler.runner import Context, Pass, run_passes
from asyncflow.dsl import ast
from asyncflow.ir import Graph, build_graph
from asyncflow.plan import Plan


def _parse(src: tuple[str, str | None], ctx: Context) -> ast.Pipeline | None:
    from asyncflow.dsl.load import load_file, load_text

    path, text = src
    p = load_file(path, ctx.sets, ctx.diags) if text is None else load_text(text, path, ctx.sets, ctx.diags)
    ctx.pipeline = p
    return p


def _build(p: ast.Pipeline, ctx: Context) -> Graph:
    ctx.pipeline = p
    return build_graph(p)


def _validate(g: Graph, ctx: Context) -> Graph:
    from asyncflow.compiler.passes.validate import validate

    validate(g, ctx.diags)
    return g


PARSE = Pass("parse", _parse, "source text -> AST (YAML or .af), --set overrides applied")
FRONT = [
    Pass("build IR", _build, "AST -> Graph: nodes in source order, data edges from field names"),
]
PASSES = [
    Pass("validate", _validate, "the language's rules (AF3xx); stops here on any user error"),
    Pass("bind", bind, "each field's role and type from its producer; inputs bound by role (AF37x)"),
    Pass("staleness", staleness, "version lag of every task and edge, run-ahead, channel capacity"),
    Pass("placement", placement, "pools -> Ray bundles, replicas -> bundles, time-sharing order"),
    Pass("overlap", overlap, "streaming granularity of every edge, what runs concurrently"),
    Pass("lower", lower, "-> Plan: per-worker READ/COMPUTE/WRITE ops, weight-sync schedule"),
    Pass("cost", cost, "predicted step time: this plan, its synchronous form, the ideal"),
]
ALL = [PARSE, *FRONT, *PASSES]
PASS_NAMES = [p.name for p in ALL]


def display_path(path: str | os.PathLike) -> str:
    """``path`` relative to the working directory when it lies below it (machine-independent)."""
    s = str(path)
    try:
        rel = os.path.relpath(s)
    except ValueError:
        return s
    return Path(rel).as_posix() if not rel.startswith("..") else s


def compile_file(path: str | os.PathLike, sets: Sequence[str] = (), *, device_kind: str = "auto",
                 backend: str = "ray", dump_after: str | None = None, ctx: Context | None = None,
                 verify: bool = False, stop_after: str | None = None) -> Plan | str:
    """Compile a pipeline file to a Plan (or, with ``dump_after``, the text after that pass)."""
    ctx = ctx or Context()
    ctx.sets, ctx.device_kind, ctx.source_file = tuple(sets), device_kind, display_path(path)
    ctx.backend = backend
    return run_passes(ALL, (str(path), None), ctx, dump_after=dump_after, verify_graphs=verify,
                       stop_after=stop_after)


def compile_text(text: str, path: str = "<text>.yaml", sets: Sequence[str] = (), *,
                 device_kind: str = "auto", backend: str = "ray", dump_after: str | None = None,
                 ctx: Context | None = None, verify: bool = False, stop_after: str | None = None) -> Plan | str:
    """Compile source text; ``path``'s suffix picks the front end."""
    ctx = ctx or Context()
    ctx.sets, ctx.device_kind, ctx.source_file = tuple(sets), device_kind, display_path(path)
    ctx.backend = backend
    return run_passes(ALL, (path, text), ctx, dump_after=dump_after, verify_graphs=verify,
                       stop_after=stop_after)


def compile_pipeline(p: ast.Pipeline, *, device_kind: str = "auto", dump_after: str | None = None,
                     ctx: Context | None = None, verify: bool = False, stop_after: str | None = None) -> Plan | str:
    """Compile an AST (built by a front end, or directly by a program)."""
    ctx = ctx or Context()
    ctx.device_kind, ctx.pipeline = device_kind, p
    ctx.source_file = ctx.source_file or (display_path(p.path) if p.path else "")
    return run_passes([*FRONT, *PASSES], p, ctx, dump_after=dump_after, verify_graphs=verify,
                       stop_after=stop_after)
