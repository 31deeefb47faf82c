"""staleness: annotate every task and data edge with the policy-version lag it may carry.

Versions are counted per trained model: a ``train`` task bumps its model's version once per
step, and a task using that model receives the weights through a ``sync`` edge with
``max_staleness`` a (DESIGN.md: a train step producing version n+1 consumes a row of version v
only if n - v <= a). Formulas (node meta / edge meta keys in brackets):

1. ``own_lag(t)`` [own_lag]: the largest ``max_staleness`` of the sync edges into ``t``; 0 for a
   task with no model, a frozen model, or a train task (its own weights are current).
2. ``lag(t)`` [lag]: ``max(own_lag(t), lag of every producer of t's inputs)``; a data source has
   lag 0. So a reward, advantage or filter task propagates the largest lag of its inputs, and a
   train task's lag is the largest lag its inputs carry (its ``version_lag`` in the plan).
3. an edge's staleness [staleness] is its producer's lag.
4. ``run_ahead(t)`` [run_ahead]: how many steps ahead of the trainer ``t`` may work. A task fed
   weights through sync edges may run ``min(max_staleness)`` of them ahead (the runtime's gate);
   a train task runs at 0 (it defines the step); any other task runs as far ahead as its
   producers let it (the largest run_ahead among them); a data source prefetches as far as its
   furthest consumer.
5. an edge's capacity [capacity], in rows (one row per sample: a prompt is replicated
   ``samples_per_prompt`` times as it enters the store):
   ``clamp((run_ahead(src) + 2) * samples_per_step, samples_per_step, min(steps * samples_per_step,
   MAX_CAPACITY_ROWS))`` -- the step its consumer is on, every step the producer may run ahead,
   and the next one in flight (so the rows a gated producer may start the moment a new version is
   published are already there), never more than the whole run or MAX_CAPACITY_ROWS. The driver
   feeds the data sources' channels up to their capacity (rows of steps below
   ``trained + capacity / samples_per_step``); the gate holds every later channel within it.

Each sync edge gets meta ``model`` (the model whose weights it carries).
"""
from __future__ import annotations

from asyncflow.compiler.kinds import rules_of
from asyncflow.compiler.passes import annotated_copy, topo_order
from asyncflow.compiler.runner import Context
from asyncflow.ir import Graph, SourceNode

MAX_CAPACITY_ROWS = 1 << 20


def capacity(run_ahead: int, samples_per_step: int, steps: int) -> int:
    """Rule 5: a channel's capacity in rows."""
    hi = max(samples_per_step, min(steps * samples_per_step, MAX_CAPACITY_ROWS))
    return max(samples_per_step, min((run_ahead + 2) * samples_per_step, hi))


def staleness(graph: Graph, ctx: Context | None = None) -> Graph:
    g = annotated_copy(graph)
    step = g.pipeline.step
    sync_in: dict[str, list[int]] = {}
    for e, m in g.sync_edges():
        sync_in.setdefault(e.dst, []).append(e.max_staleness)
        if ctx is not None and e.max_staleness >= step.steps:
            ctx.diags.add("AF406", e.defn.locs.get("max_staleness", e.defn.loc),
                          alpha=e.max_staleness, steps=step.steps)
        m["model"] = g.node(e.dst).defn.model if not isinstance(g.node(e.dst), SourceNode) else None
    preds: dict[str, list[str]] = {}
    succs: dict[str, list[str]] = {}
    for e, _ in g.data_edges():
        preds.setdefault(e.dst, []).append(e.src)
        succs.setdefault(e.src, []).append(e.dst)
    order = topo_order(g)
    for n in order:  # rules 1, 2, 4 for tasks (sources first get lag 0)
        m = g.meta(n)
        node = g.node(n)
        if isinstance(node, SourceNode):
            m["lag"] = 0
            continue
        d = node.defn
        frozen = d.model is not None and d.model in g.pipeline.models and g.pipeline.models[d.model].frozen
        trains = rules_of(d.kind).trains
        own = 0 if (trains or frozen) else max(sync_in.get(n, [0]))
        m["own_lag"] = own
        m["lag"] = max([own] + [g.meta(p)["lag"] for p in preds.get(n, [])])
        if trains:
            m["run_ahead"] = 0
        elif n in sync_in and not frozen:
            m["run_ahead"] = min(sync_in[n])
        else:
            m["run_ahead"] = max([0] + [g.meta(p).get("run_ahead", 0) for p in preds.get(n, [])])
    for n in order:  # rule 4 for sources: as far as the furthest consumer
        if isinstance(g.node(n), SourceNode):
            g.meta(n)["run_ahead"] = max([0] + [g.meta(c)["run_ahead"] for c in succs.get(n, [])])
    for e, m in g.data_edges():  # rules 3, 5
        src = g.meta(e.src)
        m["staleness"] = src["lag"]
        m["capacity"] = capacity(src["run_ahead"], step.samples_per_step, step.steps)
    return g
