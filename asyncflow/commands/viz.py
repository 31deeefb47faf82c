"""``asyncflow viz X -o OUT``: draw a pipeline, a plan, or a run's trace / metrics.

What X is decides what is drawn (:func:`kind_of`):

=============================  ==========================================================
X                              drawing
=============================  ==========================================================
``*.yaml``/``*.yml``/``*.af``  compiled, then its dataflow graph (svg / png / pdf / html)
plan ``*.json``                the same graph from a saved ``compile --json``
``trace.json`` (Chrome trace)  the run's timeline: ``asyncflow.viz.timeline.draw_timeline``
``*.jsonl`` (metrics)          the run's metrics: ``asyncflow.viz.metrics.draw_metrics``
=============================  ==========================================================

The timeline and metrics drawers are imported only when needed; where they are missing the
command says so (AF601-style coded message, exit 2) instead of failing obscurely.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import List, Optional

import typer

from asyncflow.console import SetOpt, out, usage_error

PIPELINE_SUFFIXES = (".yaml", ".yml", ".af")
DRAWERS = {"trace": ("asyncflow.viz.timeline", "draw_timeline"),
           "metrics": ("asyncflow.viz.metrics", "draw_metrics")}


def kind_of(path: str) -> str:
    """"pipeline" | "plan" | "trace" | "metrics" (by suffix, then by a peek at the JSON)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in PIPELINE_SUFFIXES:
        return "pipeline"
    if suffix == ".jsonl":
        return "metrics"
    if suffix == ".json":
        if p.name.endswith("trace.json"):
            return "trace"
        try:
            head = json.loads(p.read_text())
        except (OSError, ValueError):
            return "plan"
        if isinstance(head, dict) and "format" in head and "tasks" in head and "pipeline" in head:
            return "plan"
        if isinstance(head, (list, dict)) and (isinstance(head, list) or "traceEvents" in head):
            return "trace"
        return "plan"
    return "unknown"


def _drawer(kind: str):
    module, fn = DRAWERS[kind]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        return None
    return getattr(mod, fn, None)


def draw(path: str, out: str, sets=(), device_kind: str = "auto") -> Path:
    """Draw ``path`` to ``out``; return ``out``. Raises ValueError for what it cannot draw."""
    kind = kind_of(path)
    if kind in DRAWERS:
        fn = _drawer(kind)
        if fn is None:
            module, name = DRAWERS[kind]
            raise ValueError(f"cannot draw a {kind} here: {module}.{name} is not installed")
        fn(path, out)
        return Path(out)
    if kind == "pipeline":
        from asyncflow.compiler import compile_file

        plan = compile_file(path, sets, device_kind=device_kind)
    elif kind == "plan":
        from asyncflow.plan import Plan

        plan = Plan.from_json(Path(path).read_text())
    else:
        raise ValueError(f"cannot tell what '{path}' is: give a pipeline (.yaml, .yml, .af), a plan "
                         ".json, a trace.json or a metrics .jsonl")
    outp = Path(out)
    if outp.suffix.lower() in (".html", ".htm"):
        from asyncflow.viz.html import plan_html

        outp.write_text(plan_html(plan))
        return outp
    if outp.suffix.lower() == ".dot":
        from asyncflow.viz.graph import to_dot

        outp.write_text(to_dot(plan))
        return outp
    from asyncflow.viz.graph import render

    return render(plan, outp)


def register(app: typer.Typer) -> None:
    @app.command()
    def viz(target: str = typer.Argument(..., metavar="FILE|PLAN|TRACE",
                                         help="a pipeline (.yaml/.af), a plan .json, a trace.json or metrics.jsonl"),
            output: Optional[str] = typer.Option(None, "-o", "--output",
                                                 help="out.svg | out.png | out.pdf | out.html | out.dot"),
            set_: Optional[List[str]] = SetOpt,
            device_kind: str = typer.Option("auto", "--device-kind", help="gpu, cpu or auto")) -> None:
        """Draw the dataflow graph (pipeline or plan) or a run's timeline (trace)."""
        if not Path(target).exists():
            usage_error(f"no such file: {target}")
        kind = kind_of(target)
        default = {"trace": ".html", "metrics": ".html"}.get(kind, ".svg")
        dest = output or str(Path(Path(target).name).with_suffix(default))
        try:
            draw(target, dest, set_ or (), device_kind)
        except (ValueError, RuntimeError) as exc:
            usage_error(str(exc))
        out.print(f"wrote {dest}", markup=False)
