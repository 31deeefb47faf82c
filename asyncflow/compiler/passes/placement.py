"""placement: pools -> Ray placement-group bundles, replicas -> bundles, colocation order.

Rules:

1. A pool of ``devices: n`` becomes n bundles, one per device. A device is a GPU
   (``{"GPU": 1, "CPU": 1}``) or, where there is none, a CPU slot (``{"CPU": 1}``); the pool's
   ``resources`` map (custom Ray resources each device needs) is added to every bundle. The kind
   comes from ``--device-kind``: ``gpu``, ``cpu``, or ``auto`` (the default), which picks GPU
   only when a pooled task uses an engine that cannot run without one (vllm, deepspeed) --
   compile never imports torch to look for a GPU; the runtime may still re-resolve ``auto``.
2. A pooled task's replica r takes bundles ``[r*d, (r+1)*d)`` (d = ``devices_per_replica``).
   ``replicas * d`` above the pool's devices is infeasible: AF401 at the task's ``replicas``
   (this must not crash even when validate already said so).
3. Tasks on one pool are colocated: they time-share its devices, every one starting at bundle 0.
   Their time-sharing order is rollout, logprob, value, (reward, filter, advantage, custom),
   train; ties by topological order. Each worker asks for ``1/k`` of each of its bundles
   (k = tasks on the pool, rounded down to 1e-4) so all of them fit at once.
4. A task without ``pool`` runs on a CPU worker outside the pools: no bundle, resources
   ``{"CPU": 0}`` (it is I/O- and Python-bound; Ray schedules it anywhere), ``replicas`` copies.
5. A pool's ``resources`` may not name ``GPU`` or ``CPU`` (the device kind sets those): AF402.
6. Processes (as verl's colocated workers): the workers that time-share one set of a pool's
   devices (the same bundles) run in one process, ``POOL:B`` (``POOL:B0-B1`` for several
   devices): torch and the engine libraries are imported once per device, not once per task.
   Replica r of every task without a pool and without an engine runs in the process ``cpu:r``.
   A pool's ``share_process: false`` gives each of its workers a process of its own (its id),
   as does an engine task without a pool.

7. Devices: each pooled worker names its ``devices``, the indices of its bundles counted over
   the pools in order (pool ``a`` of 2 devices holds 0-1, the next pool starts at 2): the device
   (``cuda:N``) a one-node run without Ray uses; on Ray a worker takes the ids Ray assigns its
   process. A worker asks for its share of each of its bundles' GPU and CPU (rule 3). On GPUs,
   a process over several devices must hold them whole: Ray gives a process part of one GPU or
   whole GPUs, never part of several, so a worker of ``devices_per_replica > 1`` that
   time-shares its devices with another process (a task of another ``devices_per_replica`` on
   the pool, or ``share_process: false``) is AF407.

Node meta: ``time_share``, ``bundles`` (every bundle index it uses), ``workers`` (list of
``{id, replica, bundles, devices, resources, process}``). Graph attribute ``placement``: ``{device_kind, pools:
{name: {devices, bundles, tasks}}}``.
"""
from __future__ import annotations

import math

from asyncflow.compiler.passes import annotated_copy, topo_order
from asyncflow.compiler.runner import Context
from asyncflow.engines.base import capabilities
from asyncflow.ir import Graph, TaskNode
from asyncflow.kinds import KINDS

CPU_TASK_RESOURCES = {"CPU": 0}


def device_kind(graph: Graph, option: str = "auto") -> str:
    """Rule 1: "GPU" or "CPU"."""
    option = (option or "auto").lower()
    if option == "gpu":
        return "GPU"
    if option == "cpu":
        return "CPU"
    for t in graph.tasks():
        if t.defn.pool is not None and capabilities(t.defn.engine, load=False).accelerator:
            return "GPU"
    return "CPU"


def _share(k: int) -> float:
    return math.floor(10_000 / max(1, k)) / 10_000


def placement(graph: Graph, ctx: Context) -> Graph:
    g = annotated_copy(graph)
    p = g.pipeline
    kind = device_kind(g, ctx.device_kind)
    topo = {n: i for i, n in enumerate(topo_order(g))}
    on_pool: dict[str, list[str]] = {name: [] for name in p.pools}
    for t in g.tasks():
        if t.defn.pool in on_pool:
            on_pool[t.defn.pool].append(t.name)
    pools = {}
    first = 0  # rule 7: the pool's first device, counted over the pools in order
    for name, pool in p.pools.items():
        extra = {}
        for r, v in pool.resources.items():  # rule 5
            if r in ("GPU", "CPU"):
                ctx.diags.add("AF402", pool.locs.get(f"resources.{r}", pool.loc), pool=name, key=r)
            else:
                extra[r] = v
        base = {"GPU": 1, "CPU": 1} if kind == "GPU" else {"CPU": 1}
        bundles = [dict(base, **extra) for _ in range(pool.devices)]
        order = sorted(on_pool[name], key=lambda n: (KINDS[g.node(n).kind].order, topo[n]))
        pools[name] = {"devices": pool.devices, "bundles": bundles, "tasks": order}
        share = _share(len(order))
        for ts, n in enumerate(order):  # rules 2, 3
            d = g.node(n).defn
            m = g.meta(n)
            m["time_share"] = ts
            need = d.replicas * d.devices_per_replica
            workers = []
            if need > pool.devices:
                at = d.locs.get("replicas") or d.locs.get("devices_per_replica") or d.loc
                ctx.diags.add("AF401", at, task=n, need=need, replicas=d.replicas,
                              dpr=d.devices_per_replica, pool=name, devices=pool.devices)
            else:
                res = {kind: share, "CPU": share} if kind == "GPU" else {kind: share}
                res.update({r: round(v * share, 4) if isinstance(v, (int, float)) else v
                            for r, v in extra.items()})
                for r in range(d.replicas):
                    b = list(range(r * d.devices_per_replica, (r + 1) * d.devices_per_replica))
                    proc = f"{name}:{b[0]}" if len(b) == 1 else f"{name}:{b[0]}-{b[-1]}"
                    if not pool.share_process:  # rule 6
                        proc = f"{n}/{r}"
                    workers.append({"id": f"{n}/{r}", "replica": r, "bundles": b,
                                    "devices": [first + i for i in b],
                                    "resources": dict(res), "process": proc})
            m["workers"] = workers
            m["bundles"] = sorted({b for w in workers for b in w["bundles"]})
        if kind == "GPU":
            _whole_devices(g, ctx, name, order)
        first += pool.devices
    for t in g.tasks():  # rule 4 (and tasks on an unknown pool: validate reports those)
        m = g.meta(t.name)
        if "workers" in m:
            continue
        m["time_share"] = 0
        m["bundles"] = []
        own = t.defn.engine is not None  # rule 6
        m["workers"] = [{"id": f"{t.name}/{r}", "replica": r, "bundles": [], "devices": [],
                         "resources": dict(CPU_TASK_RESOURCES),
                         "process": f"{t.name}/{r}" if own else f"cpu:{r}"}
                        for r in range(t.defn.replicas)]
    g.g.graph = dict(g.g.graph, placement={"device_kind": kind, "pools": pools})
    return g


def _whole_devices(g: Graph, ctx: Context, pool: str, tasks: list[str]) -> None:
    """Rule 7: on a GPU pool, a process over several devices is the only process on them."""
    procs: dict[str, tuple[str, set]] = {}  # process -> (a task of it, its bundles)
    for n in tasks:
        for w in g.meta(n).get("workers", []):
            procs.setdefault(w["process"], (n, set(w["bundles"])))
    for proc, (n, bundles) in procs.items():
        if len(bundles) < 2:
            continue
        other = next((q for q, (_, b) in procs.items() if q != proc and b & bundles), None)
        if other is None:
            continue
        d = g.node(n).defn
        share = g.pipeline.pools[pool]
        at = (share.locs.get("share_process") if not share.share_process else None) or \
            d.locs.get("devices_per_replica") or d.loc
        ctx.diags.add("AF407", at, task=n, n=len(bundles), pool=pool, other=other)
        return


def pool_tasks(graph: Graph) -> dict[str, list[str]]:
    """pool -> its tasks in time-sharing order (after placement)."""
    return {n: v["tasks"] for n, v in graph.g.graph.get("placement", {}).get("pools", {}).items()}


__all__ = ["placement", "device_kind", "pool_tasks", "TaskNode"]
