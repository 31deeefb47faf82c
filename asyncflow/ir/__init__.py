"""The graph IR: a networkx MultiDiGraph of small frozen dataclasses.

==========  =====================================================================
element     meaning
==========  =====================================================================
SourceNode  a ``data`` source: it produces its ``fields``
TaskNode    a task; ``defn`` is its AST node (kind, engine, inputs, outputs, ...)
DataEdge    producer -> consumer, for the ``fields`` the consumer reads from it
SyncEdge    train task -> task using its model: weights, with ``max_staleness``
==========  =====================================================================

Nodes are keyed by name (sources and tasks share one namespace). Each node and edge also has a
``meta`` dict where analyses (compiler passes) put what they find; the core classes never grow.
Data edges are derived from field names: a task that lists ``prompt`` as an input gets an edge
from every producer of ``prompt``. Sync edges are the only back edges.
"""
from asyncflow.ir.graph import DataEdge, Graph, SourceNode, SyncEdge, TaskNode, build_graph

__all__ = ["Graph", "SourceNode", "TaskNode", "DataEdge", "SyncEdge", "build_graph"]
