"""The compiler's passes, one module each (the order lives in :mod:`asyncflow.compiler.pipeline`).

Small helpers the passes share live here: the batch numbers of a pipeline, the models that
some ``train`` task updates (the *policy-like* models whose versions staleness counts), and the
scheduling keys with their defaults filled in (:func:`scheduling`, :func:`launch_groups`,
:func:`replaced`; docs/language.md, "Scheduling keys").
"""
from __future__ import annotations

import math
from fractions import Fraction

from asyncflow.compiler.kinds import rules_of
from asyncflow.ir import Graph
from asyncflow.kinds import KINDS, SCHED


def train_tasks_of(graph: Graph) -> dict[str, str]:
    """model -> the (first) train task that updates it."""
    out: dict[str, str] = {}
    for t in graph.tasks():
        d = t.defn
        if rules_of(d.kind).trains and d.model is not None:
            out.setdefault(d.model, t.name)
    return out


def micro_batch(graph: Graph, task: str) -> int:
    """A train task's ``args.micro_batch`` (default: the whole step), clamped to [1, step]."""
    sps = graph.pipeline.step.samples_per_step
    mb = graph.node(task).defn.args.get("micro_batch", sps)
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
        return sps
    return min(mb, sps)


def scheduling(graph: Graph, task: str) -> dict:
    """The scheduling keys of ``task`` as the plan carries them (``TaskPlan`` fields): what the
    source says, else the kind's default (:data:`asyncflow.kinds.SCHED`); a kind that does not
    take a key keeps the plan's neutral value ("" / 1.0 / False).

    ``stream`` defaults to ``args.micro_batch < samples_per_step`` (no micro_batch: False);
    ``on_update`` of a ``schedule: queue`` rollout fed by a ``consume: first_ready`` trainer at
    ``max_staleness`` >= 1 to ``continue`` (else ``finish``), and such a rollout's ``redundancy``
    (on a trained model) to one group more than ``prompts_per_step`` a step
    (:func:`launches_ahead`)."""
    d = graph.node(task).defn
    takes = KINDS[d.kind].needs + KINDS[d.kind].takes
    out: dict = {"schedule": "", "redundancy": 1.0, "on_update": "", "consume": "",
                 "stream": False, "refill": False}
    for key, spec in SCHED.items():
        if key not in takes:
            continue
        v = getattr(d, key)
        if v is None and key == "stream":
            mb = d.args.get("micro_batch")
            v = isinstance(mb, int) and not isinstance(mb, bool) and \
                1 <= mb < graph.pipeline.step.samples_per_step
        elif v is None and key == "on_update" and out["schedule"] == "queue" \
                and task in first_ready_feeds(graph.pipeline):
            v = "continue"  # finish would drain every slot before adopting: the buffer's defeat
        elif v is None and key == "redundancy" and launches_ahead(graph.pipeline, task):
            pps = graph.pipeline.step.prompts_per_step
            v = (pps + 1) / pps  # one group ahead a step (launch_groups: exactly pps + 1)
        elif v is None:
            v = spec.default
        out[key] = float(v) if key == "redundancy" else v
    return out


def trained_models(p) -> set[str]:
    """The models some ``train`` task of pipeline ``p`` updates (not frozen)."""
    return {t.model for t in p.tasks.values()
            if rules_of(t.kind).trains and t.model in p.models and not p.models[t.model].frozen}


def first_ready_feeds(p) -> dict[str, str]:
    """Task -> the ``consume: first_ready`` train task whose weights a sync edge of pipeline
    ``p`` brings it at ``max_staleness`` >= 1. Such a ``schedule: queue`` rollout's
    ``on_update`` defaults to ``continue`` (README, "Scheduling": with ``finish`` the trainer
    waits for the slowest sample either way; AF329 where nothing else keeps the buffer going)."""
    return {s.dst: s.src for s in p.sync if s.src in p.tasks and s.max_staleness >= 1
            and p.tasks[s.src].consume == "first_ready"}


def launches_ahead(p, task: str, trained: set[str] | None = None) -> bool:
    """Whether ``task``, a ``schedule: queue`` rollout on a trained model with no ``redundancy``
    written, is fed by a ``consume: first_ready`` trainer at ``max_staleness`` >= 1 (pipeline
    ``p``; ``trained``: :func:`trained_models`, when the caller has it): a step then launches
    one group more than it trains by default (README, "Scheduling": with exactly
    ``prompts_per_step`` groups a version the buffer holds no spare group, and a step waits for
    its slowest one; one more lifts the simulated long tail at alpha 1 from 85% to 100% of the
    trainer's bound)."""
    d = p.tasks[task]
    if not rules_of(d.kind).samples or d.redundancy is not None or d.schedule == "batch":
        return False
    return (d.model in (trained_models(p) if trained is None else trained)
            and task in first_ready_feeds(p))


def launch_groups(graph: Graph) -> int:
    """Groups fed per step: ``ceil(prompts_per_step * redundancy)`` of the rollouts on a model some
    train task updates (the largest), else ``prompts_per_step``. Exact for decimal redundancies
    (1.1 x 10 is 11 groups, not 12)."""
    pps = graph.pipeline.step.prompts_per_step
    trained = trained_models(graph.pipeline)
    most = pps
    for t in graph.tasks():
        d = t.defn
        if rules_of(d.kind).samples and d.model in trained and d.redundancy is not None:
            r = d.redundancy
            r = Fraction(r) if isinstance(r, int) else Fraction(repr(float(r)))
            most = max(most, math.ceil(pps * r))
        elif launches_ahead(graph.pipeline, t.name, trained):
            most = max(most, pps + 1)
    return most


def replaced(graph: Graph) -> list[str]:
    """The drop reasons whose groups are replaced by new prompts (``StepPlan.replace``):
    ``filter`` when a filter refills, ``staleness`` when a trainer consumes ``first_ready``."""
    reasons = {rules_of(t.defn.kind).replaces(scheduling(graph, t.name)) for t in graph.tasks()}
    return sorted(reasons - {None})


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
