"""overlap: how each data edge streams, and which tasks run at the same time.

Granularities, finest first: ``sample`` < ``micro_batch`` < ``group`` < ``step``. A channel's
granularity is the unit in which rows on it become usable by its consumer. The rules (the tests
cite them by number):

1. A ``train`` task whose weights go out only through sync edges with ``max_staleness`` 0 (or
   through none) *needs* ``step``: the barrier that makes a staleness-0 plan the synchronous
   plan -- the trainer sees the whole step at once and orders it by row index.
2. An ``advantage`` task whose estimator has scope ``batch`` (reinforce_pp) needs ``step``.
3. An ``advantage`` task whose estimator has scope ``group`` (grpo, rloo) needs ``group``: all
   ``samples_per_prompt`` rows of one prompt.
4. A ``filter`` task needs ``group`` when ``samples_per_prompt`` > 1 (filters keep or drop whole
   groups, e.g. DAPO's dynamic sampling, so group statistics stay defined), else ``sample``.
5. Any other ``train`` task needs ``micro_batch`` (``args.micro_batch`` rows).
6. Every other task needs ``sample``: e.g. a reward is computed the moment its response exists.
7. A task *emits* the coarsest of ``group``/``step`` among what it needs (rules 1-4) and what its
   input edges carry -- a group-scoped advantage emits whole groups, and whatever is downstream
   of a step barrier arrives by step; otherwise it emits ``sample``. Sources and rollouts emit
   ``sample`` (prompt replication: each of a prompt's responses is its own request).
8. An edge's granularity is the coarser of its producer's emission (7) and its consumer's need
   (1-6). So reward -> grpo advantage is ``group``, grpo advantage -> train is ``group``,
   rollout -> train is ``micro_batch`` (async) or ``step`` (staleness 0).
9. A task reads ``read_rows`` rows at a time: 0 ("whatever is ready") when all its inputs are
   ``sample``, else the least common multiple of its inputs' unit rows (group:
   samples_per_prompt, micro_batch: micro_batch, step: samples_per_step), capped at a step.

Concurrency (Plan.concurrency, a list of groups of tasks that run at the same instant):

10. A task's *stage* is the number of ``step`` edges on the longest path into it; tasks of one
    stage stream into each other and run at once.
11. Tasks that share a pool time-share it: slot i of a stage holds the i-th task (in the pool's
    time-sharing order) of every pool with several tasks in that stage; a pool's only task in the
    stage, and every pool-less (CPU) task of the stage, is in every slot.
12. When some producer may run ahead of the trainer (run_ahead > 0), the run-ahead tasks of stage
    0 also join every slot of the later stages, unless they share a pool with a member of that
    slot: they generate the next step while this one trains.
"""
from __future__ import annotations

import math

from asyncflow.compiler.kinds import rules_of
from asyncflow.compiler.passes import annotated_copy, micro_batch, scheduling, topo_order
from asyncflow.compiler.passes.placement import pool_tasks
from asyncflow.compiler.runner import Context
from asyncflow.ir import Graph, SourceNode

RANK = {"sample": 0, "micro_batch": 1, "group": 2, "step": 3}


def _coarser(a: str, b: str) -> str:
    return a if RANK[a] >= RANK[b] else b


def need(graph: Graph, task: str, sync_alpha: dict[str, int]) -> str:
    """Rules 1-6: the granularity ``task`` needs on its inputs (its kind's rules say)."""
    d = graph.node(task).defn
    return rules_of(d.kind).need(d, sync_alpha.get(task, 0), scheduling(graph, task)["stream"],
                                 graph.pipeline.step.samples_per_prompt)


def unit_rows(graph: Graph, gran: str, dst: str) -> int:
    step = graph.pipeline.step
    return {"sample": 1, "group": step.samples_per_prompt, "step": step.samples_per_step,
            "micro_batch": micro_batch(graph, dst) if gran == "micro_batch" else 1}[gran]


def overlap(graph: Graph, ctx: Context | None = None) -> Graph:
    g = annotated_copy(graph)
    sps = g.pipeline.step.samples_per_step
    sync_alpha: dict[str, int] = {}
    for e, _ in g.sync_edges():
        sync_alpha[e.src] = max(sync_alpha.get(e.src, 0), e.max_staleness)
    in_edges: dict[str, list] = {}
    for e, m in g.data_edges():
        in_edges.setdefault(e.dst, []).append((e, m))
    order = topo_order(g)
    for n in order:  # rules 1-9, in topological order so producers' emissions are known
        node = g.node(n)
        meta = g.meta(n)
        if isinstance(node, SourceNode):
            meta["emits"] = "sample"
            meta["stage"] = 0
            continue
        nd = need(g, n, sync_alpha)
        emits = nd if nd in ("group", "step") else "sample"
        stage = 0
        units = []
        for e, m in in_edges.get(n, []):
            src = g.meta(e.src)
            gran = _coarser(src["emits"], nd)  # rule 8
            m["granularity"] = gran
            m["unit_rows"] = unit_rows(g, gran, n)
            if gran in ("group", "step"):
                emits = _coarser(emits, gran)  # rule 7
            stage = max(stage, src["stage"] + (1 if gran == "step" else 0))  # rule 10
            if gran != "sample":
                units.append(m["unit_rows"])
        meta["needs"] = nd
        if ctx is not None:
            rules_of(node.kind).check_need(node.defn, nd, g.pipeline.step.samples_per_prompt,
                                           ctx.diags)
        meta["emits"] = emits
        meta["stage"] = stage
        meta["read_rows"] = min(sps, math.lcm(*units)) if units else 0  # rule 9
    g.g.graph = dict(g.g.graph, concurrency=concurrency(g, order))
    return g


def concurrency(g: Graph, order: list[str]) -> list[list[str]]:
    """Rules 10-12."""
    pos = {n: i for i, n in enumerate(order)}
    pools = pool_tasks(g)
    pool_of = {t: p for p, ts in pools.items() for t in ts}
    stages: dict[int, list[str]] = {}
    for t in g.tasks():
        stages.setdefault(g.meta(t.name)["stage"], []).append(t.name)
    ahead = [t for t in stages.get(0, []) if g.meta(t).get("run_ahead", 0) > 0]
    groups: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()
    for s in sorted(stages):
        members = stages[s]
        by_pool: dict[str, list[str]] = {}
        free: list[str] = []
        for t in members:
            (by_pool.setdefault(pool_of[t], []) if t in pool_of else free).append(t)
        for lst in by_pool.values():
            lst.sort(key=lambda t: g.meta(t)["time_share"])
        slots = max([len(v) for v in by_pool.values()] + [1])
        for i in range(slots):  # rule 11
            grp = list(free)
            for lst in by_pool.values():
                if len(lst) == 1:
                    grp.append(lst[0])
                elif i < len(lst):
                    grp.append(lst[i])
            if s > 0:  # rule 12
                used = {pool_of.get(t) for t in grp} - {None}
                grp += [t for t in ahead if t not in grp and pool_of.get(t) not in used]
            key = tuple(sorted(grp, key=pos.__getitem__))
            if key and key not in seen:
                seen.add(key)
                groups.append(list(key))
    return groups
