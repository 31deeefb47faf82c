"""``asyncflow check``: every diagnostic ``compile`` would report, through the same pass list."""
from __future__ import annotations

from typing import Any

from asyncflow.diagnostics import Diagnostics
from asyncflow.dsl import ast
from asyncflow.errors import UserError
from asyncflow.ir import Graph

# the last of the passes that find independent errors: up to it, check goes on after an error
# (a schema error and a broken rule are both reported); the passes after it need a clean graph
LAST_FRONT_PASS = "validate"


def check_file(path: str, sets=(), diags: Diagnostics | None = None) -> tuple[ast.Pipeline, Graph] | None:
    """The checked pipeline and its graph (as built, before any pass annotates a copy of it).

    Runs the compiler's pass list (:data:`asyncflow.compiler.pipeline.ALL`) with its runner, so
    ``check`` reports what ``compile`` does, later passes' warnings included. Where ``compile``
    stops at the first pass with an error, ``check`` goes on through the passes up to
    ``validate`` that have something to work on, so that every independent error of the file is
    reported at once. Every problem goes to ``diags`` (raised as one UserError when not given);
    None when there is an error."""
    from asyncflow.compiler.pipeline import ALL, display_path
    from asyncflow.compiler.runner import Context, Pass, run_passes

    own = diags is None
    diags = diags if diags is not None else Diagnostics()
    names = [p.name for p in ALL]
    front = names.index(LAST_FRONT_PASS) if LAST_FRONT_PASS in names else 0
    started: list[int] = []  # indices of the passes run, in order
    results: dict[int, Any] = {}  # pass index -> its result

    def keeping(i: int, p: Pass) -> Pass:
        def fn(value, ctx):
            started.append(i)
            results[i] = value = p.fn(value, ctx)
            return value

        return Pass(p.name, fn, p.doc)

    passes = [keeping(i, p) for i, p in enumerate(ALL)]
    ctx = Context(diags=diags, sets=tuple(sets), source_file=display_path(path),
                  load_engines=False)  # check never imports an engine
    value: Any = (str(path), None)
    start = 0
    while start < len(passes):
        try:  # the runner stops after the first pass that leaves an error
            run_passes(passes[start:], value, ctx)
            break
        except UserError as e:  # the runner's (ctx.diags), or one a pass raised on its own
            for d in e.diagnostics:
                if d not in diags.items:
                    diags.items.append(d)
        stopped = started[-1] if started else len(passes)
        value = results.get(stopped)
        if stopped >= front or value is None:
            break
        start = stopped + 1
    if own:
        diags.raise_if_errors()
    graph = next((v for _, v in sorted(results.items()) if isinstance(v, Graph)), None)
    if diags.errors or ctx.pipeline is None or graph is None:
        return None
    return ctx.pipeline, graph
