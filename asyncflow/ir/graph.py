"""Graph IR: build from the AST, copy, and dump deterministically."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterator

import networkx as nx

from asyncflow.dsl import ast
from asyncflow.kinds import SCHED_KEYS


@dataclass(frozen=True)
class SourceNode:
    name: str
    fields: tuple[str, ...]
    defn: ast.DataDef


@dataclass(frozen=True)
class TaskNode:
    name: str
    defn: ast.TaskDef

    @property
    def kind(self) -> str:
        return self.defn.kind


@dataclass(frozen=True)
class DataEdge:
    src: str
    dst: str
    fields: tuple[str, ...]


@dataclass(frozen=True)
class SyncEdge:
    src: str
    dst: str
    max_staleness: int
    defn: ast.SyncDef


class Graph:
    """A pipeline's dataflow graph plus the AST it came from."""

    def __init__(self, pipeline: ast.Pipeline, g: nx.MultiDiGraph | None = None):
        self.pipeline = pipeline
        self.g = g if g is not None else nx.MultiDiGraph()

    # -- access ---------------------------------------------------------------------------
    def node(self, name: str) -> SourceNode | TaskNode:
        return self.g.nodes[name]["node"]

    def meta(self, name: str) -> dict:
        return self.g.nodes[name]["meta"]

    def tasks(self) -> Iterator[TaskNode]:
        for n in self.g.nodes:
            node = self.g.nodes[n]["node"]
            if isinstance(node, TaskNode):
                yield node

    def sources(self) -> Iterator[SourceNode]:
        for n in self.g.nodes:
            node = self.g.nodes[n]["node"]
            if isinstance(node, SourceNode):
                yield node

    def data_edges(self) -> Iterator[tuple[DataEdge, dict]]:
        for u, v, k, attrs in self.g.edges(keys=True, data=True):
            if k == "data":
                yield attrs["edge"], attrs["meta"]

    def sync_edges(self) -> Iterator[tuple[SyncEdge, dict]]:
        for u, v, k, attrs in self.g.edges(keys=True, data=True):
            if k.startswith("sync"):
                yield attrs["edge"], attrs["meta"]

    def edge_meta(self, src: str, dst: str, key: str = "data") -> dict:
        return self.g.edges[src, dst, key]["meta"]

    def data_dag(self) -> nx.DiGraph:
        """The data edges alone, as a plain DiGraph (must be acyclic)."""
        d = nx.DiGraph()
        d.add_nodes_from(self.g.nodes)
        d.add_edges_from((e.src, e.dst) for e, _ in self.data_edges())
        return d

    def topo_order(self) -> list[str]:
        """Nodes in a deterministic topological order of the data edges (ties by source order)."""
        order = {n: i for i, n in enumerate(self.g.nodes)}
        return list(nx.lexicographical_topological_sort(self.data_dag(), key=lambda n: order[n]))

    def producers(self) -> dict[str, list[str]]:
        """field -> the names of the nodes that produce it."""
        out: dict[str, list[str]] = {}
        for n in self.g.nodes:
            node = self.g.nodes[n]["node"]
            fields = node.fields if isinstance(node, SourceNode) else node.defn.outputs
            for f in fields:
                out.setdefault(f, []).append(n)
        return out

    def copy(self) -> "Graph":
        """A copy whose meta dicts can be changed without touching this graph's."""
        g = self.g.copy()
        for n in g.nodes:
            g.nodes[n]["meta"] = copy.deepcopy(g.nodes[n]["meta"])
        for u, v, k in g.edges(keys=True):
            g.edges[u, v, k]["meta"] = copy.deepcopy(g.edges[u, v, k]["meta"])
        return Graph(self.pipeline, g)

    # -- text dump ------------------------------------------------------------------------
    def dump(self, meta: bool = True) -> str:
        """A deterministic text form, for golden tests and ``--dump-after``."""
        p = self.pipeline
        lines = [f"graph {p.name}"]
        for n in self.g.nodes:
            node = self.g.nodes[n]["node"]
            if isinstance(node, SourceNode):
                lines.append(f"  source {n} -> {', '.join(node.fields)}")
            else:
                d = node.defn
                attrs = [f"{a}={getattr(d, a)}" for a in
                         ("engine", "model", "pool", "fn", "estimator", "loss", "env")
                         if getattr(d, a) is not None]
                if d.pool is not None or d.replicas != 1:
                    attrs.append(f"replicas={d.replicas}")
                attrs += [f"{a}={getattr(d, a)}" for a in SCHED_KEYS if getattr(d, a) is not None]
                lines.append(f"  task {n}: {d.kind} ({', '.join(d.inputs)}) -> "
                             f"({', '.join(d.outputs)}) {' '.join(attrs)}".rstrip())
            if meta and self.g.nodes[n]["meta"]:
                lines.append(f"    meta {_fmt(self.g.nodes[n]['meta'])}")
        for e, m in sorted(self.data_edges(), key=lambda x: (x[0].src, x[0].dst)):
            lines.append(f"  data {e.src} -> {e.dst} [{', '.join(e.fields)}]"
                         + (f" {_fmt(m)}" if meta and m else ""))
        for e, m in sorted(self.sync_edges(), key=lambda x: (x[0].src, x[0].dst)):
            lines.append(f"  sync {e.src} -> {e.dst} max_staleness={e.max_staleness}"
                         + (f" {_fmt(m)}" if meta and m else ""))
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.dump()


def _fmt(d: dict) -> str:
    return "{" + ", ".join(f"{k}={d[k]!r}" for k in sorted(d)) + "}"


def held_out(p: ast.Pipeline) -> str | None:
    """The data source that feeds evaluation only (rule 1 of
    :mod:`asyncflow.compiler.passes.evalplan`); None: no eval, or it evaluates on the training
    source itself (a field some task reads has no other producer)."""
    if p.eval is None or p.eval.data not in p.data:
        return None
    name = p.eval.data
    elsewhere = {f for d in p.data.values() if d.name != name for f in d.fields}
    elsewhere |= {f for t in p.tasks.values() for f in t.outputs}
    read = {f for t in p.tasks.values() for f in t.inputs}
    return name if all(f in elsewhere for f in p.data[name].fields if f in read) else None


def build_graph(p: ast.Pipeline) -> Graph:
    """The IR of ``p``: nodes in source order, data edges from field names, sync edges.

    Built even for an invalid pipeline (a field with no producer gets no edge; one with two
    producers gets two) so that validation can report every problem with its location.
    """
    graph = Graph(p)
    g = graph.g
    evaluation_only = held_out(p)  # an eval: source feeds no task
    for d in p.data.values():
        if d.name != evaluation_only:
            g.add_node(d.name, node=SourceNode(d.name, d.fields, d), meta={})
    for t in p.tasks.values():
        if t.name in g.nodes:  # a task named like a data source: validation reports it
            continue
        g.add_node(t.name, node=TaskNode(t.name, t), meta={})
    producers = graph.producers()
    for t in p.tasks.values():
        if not isinstance(g.nodes[t.name]["node"], TaskNode):
            continue
        by_src: dict[str, list[str]] = {}
        for f in t.inputs:
            for src in producers.get(f, []):
                by_src.setdefault(src, []).append(f)
        for src, fields in by_src.items():
            g.add_edge(src, t.name, key="data", edge=DataEdge(src, t.name, tuple(fields)), meta={})
    for i, s in enumerate(p.sync):
        if s.src in g.nodes and s.dst in g.nodes:
            g.add_edge(s.src, s.dst, key=f"sync{i}", edge=SyncEdge(s.src, s.dst, s.max_staleness, s),
                       meta={})
    return graph
