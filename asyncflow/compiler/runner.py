"""The pass runner: runs named passes in order, names the pass in every internal error.

A :class:`Pass` is a name and a pure function ``fn(value, ctx) -> value`` (``parse`` takes the
file, ``build IR`` the AST, the graph passes a :class:`~asyncflow.ir.Graph` -- which they copy
before annotating ``meta`` -- and ``lower`` / ``cost`` return an :class:`~asyncflow.plan.Plan`).

The runner:

- stops with :class:`~asyncflow.errors.UserError` (every diagnostic so far) after the first pass
  that leaves user errors in ``ctx.diags`` -- in practice parse, validate or placement;
- turns any other exception into :class:`~asyncflow.errors.InternalError` naming the failing pass
  and the passes that ran before it (torch.fx's pass manager does the same);
- stops after ``dump_after`` and returns the text dump of that pass's result
  (:meth:`Graph.dump` for graph passes, the plan's JSON after ``lower`` / ``cost``);
- with ``verify=True`` runs :func:`verify` on the graph after every graph pass (the tests do).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from asyncflow.diagnostics import Diagnostics
from asyncflow.errors import AsyncflowError, InternalError

DEVICE_KINDS = ("auto", "gpu", "cpu")


@dataclass
class Context:
    """What every pass may read besides its input: options and the diagnostics sink."""

    diags: Diagnostics = field(default_factory=Diagnostics)
    sets: Sequence[str] = ()
    device_kind: str = "auto"  # auto | gpu | cpu (auto: GPU only if an engine needs one)
    backend: str = "ray"  # ray | local: what a sync edge's via defaults to (lower)
    source_file: str = ""  # as recorded in the plan (relative where possible)
    pipeline: Any = None  # the AST, once parsed (passes after lower read locations from it)
    # whether a pass may import a plug-in engine to read its capabilities (lower rule 9's
    # serve loop); check never does (a plug-in then has the default capabilities)
    load_engines: bool = True


@dataclass(frozen=True)
class Pass:
    name: str
    fn: Callable[[Any, Context], Any]
    doc: str = ""


class PassFailed(InternalError):
    """An internal error inside a pass; ``pass_name`` failed after ``before`` ran."""

    def __init__(self, pass_name: str, before: Sequence[str], cause: BaseException):
        self.pass_name = pass_name
        self.before = list(before)
        ran = ", ".join(self.before) if self.before else "none"
        super().__init__(f"compiler pass '{pass_name}' failed: {cause.__class__.__name__}: "
                         f"{cause} (passes run before it: {ran})")


def _dump(value: Any) -> str:
    from asyncflow.ir import Graph
    from asyncflow.plan import Plan

    if isinstance(value, Graph):
        return value.dump()
    if isinstance(value, Plan):
        return value.to_json()
    return repr(value) + "\n"


def run_passes(passes: Sequence[Pass], value: Any, ctx: Context, *, dump_after: str | None = None,
               verify_graphs: bool = False, stop_after: str | None = None) -> Any:
    """Run ``passes`` on ``value``; see the module docstring. ``stop_after`` returns the value
    (not its dump) after that pass."""
    names = [p.name for p in passes]
    for opt in (dump_after, stop_after):
        if opt is not None and opt not in names:
            raise ValueError(f"no pass named {opt!r}: the passes are {', '.join(names)}")
    done: list[str] = []
    for p in passes:
        try:
            value = p.fn(value, ctx)
            if verify_graphs:
                from asyncflow.ir import Graph

                if isinstance(value, Graph):
                    verify(value, p.name)
        except AsyncflowError:
            raise
        except Exception as exc:  # a bug: name the pass
            raise PassFailed(p.name, done, exc) from exc
        done.append(p.name)
        if ctx.diags.errors:
            ctx.diags.raise_if_errors()
        if dump_after == p.name:
            return _dump(value)
        if stop_after == p.name:
            return value
    return value


# -- verify: the spec each stage's graph must meet (tinygrad checks specs between stages) ------
# the node/edge meta keys each graph pass guarantees (cumulative)
STAGE_META = {
    "staleness": {"task": ("own_lag", "lag", "run_ahead"), "edge": ("staleness", "capacity")},
    "placement": {"task": ("workers", "time_share", "bundles"), "edge": ()},
    "overlap": {"task": ("stage", "emits", "read_rows"), "edge": ("granularity",)},
}
_ORDER = ("validate", "staleness", "placement", "overlap")


def verify(graph, stage: str) -> None:
    """Check that ``graph`` has what the passes up to ``stage`` promise; raise InternalError."""
    from asyncflow.ir import Graph, TaskNode
    from asyncflow.plan import GRANULARITIES

    if not isinstance(graph, Graph):
        raise InternalError(f"after {stage}: expected a Graph, got {type(graph).__name__}")
    problems: list[str] = []
    dag = graph.data_dag()
    import networkx as nx

    if not nx.is_directed_acyclic_graph(dag):
        problems.append("the data edges have a cycle")
    upto = _ORDER[: _ORDER.index(stage) + 1] if stage in _ORDER else ()
    for st in upto:
        spec = STAGE_META.get(st)
        if not spec:
            continue
        for t in graph.tasks():
            m = graph.meta(t.name)
            for k in spec["task"]:
                if k not in m:
                    problems.append(f"task {t.name} has no meta '{k}' (promised by {st})")
        for e, m in graph.data_edges():
            for k in spec["edge"]:
                if k not in m:
                    problems.append(f"edge {e.src}->{e.dst} has no meta '{k}' (promised by {st})")
    if "staleness" in upto:
        for e, m in graph.data_edges():
            src = graph.node(e.src)
            if isinstance(src, TaskNode) and m.get("staleness") != graph.meta(e.src).get("lag"):
                problems.append(f"edge {e.src}->{e.dst} staleness differs from its producer's lag")
            if m.get("capacity", 1) < 1:
                problems.append(f"edge {e.src}->{e.dst} has capacity < 1")
    if "overlap" in upto:
        for e, m in graph.data_edges():
            if m.get("granularity") not in GRANULARITIES:
                problems.append(f"edge {e.src}->{e.dst} has granularity {m.get('granularity')!r}")
    if problems:
        raise InternalError(f"graph after {stage} breaks its spec: " + "; ".join(problems))
