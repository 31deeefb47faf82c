"""The compiler's passes, one module each (the order lives in :mod:`asyncflow.compiler.pipeline`).

Small helpers the passes share live here: the batch numbers of a pipeline, and the models that
some ``train`` task updates (the *policy-like* models whose versions staleness counts).
"""
from __future__ import annotations

from asyncflow.ir import Graph


def train_tasks_of(graph: Graph) -> dict[str, str]:
    """model -> the (first) train task that updates it."""
    out: dict[str, str] = {}
    for t in graph.tasks():
        d = t.defn
        if d.kind == "train" and d.model is not None:
            out.setdefault(d.model, t.name)
    return out


def micro_batch(graph: Graph, task: str) -> int:
    """A train task's ``args.micro_batch`` (default: the whole step), clamped to [1, step]."""
    sps = graph.pipeline.step.samples_per_step
    mb = graph.node(task).defn.args.get("micro_batch", sps)
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
        return sps
    return min(mb, sps)


def annotated_copy(graph: Graph) -> Graph:
    """A copy of ``graph`` for a pass to annotate: the structure and every ``meta`` dict are new,
    the meta *values* are shared. Passes only set top-level meta keys (never change a value in
    place), so this keeps them pure at a fraction of :meth:`Graph.copy`'s deep copy."""
    import networkx as nx

    src = graph.g
    g = nx.MultiDiGraph()
    g.graph.update(src.graph)
    g.add_nodes_from((n, {"node": d["node"], "meta": dict(d["meta"])}) for n, d in src.nodes(data=True))
    g.add_edges_from((u, v, k, {"edge": d["edge"], "meta": dict(d["meta"])})
                     for u, v, k, d in src.edges(keys=True, data=True))
    return Graph(graph.pipeline, g)


def topo_order(graph: Graph) -> list[str]:
    """``graph.topo_order()``, computed once and kept in the graph's attributes (the passes never
    change the structure, only annotations)."""
    cached = graph.g.graph.get("topo_order")
    if cached is not None and len(cached) == graph.g.number_of_nodes():
        return cached
    order = graph.topo_order()
    graph.g.graph["topo_order"] = order
    return order
