"""Where the plan's workers go on the machines: what a pool's bundles and a process ask Ray for
(placement rules 3, 6, 7: :func:`device_groups`, :func:`process_resources`), whether the
cluster (or this machine, without Ray) can hold the pools at all (AF604, AF609:
:func:`check_feasible`), and CPU pinning of a plan on CPU slots (:func:`cpu_cores`, :func:`pin`).
No Ray here: the Ray backend asks, these functions answer.
"""
from __future__ import annotations

import math
import os

from asyncflow.diagnostics import error
from asyncflow.loc import SourceLoc, Sources


def check_feasible(plan, nodes: list[dict], where: str = "the Ray cluster's") -> None:
    """Fail at once, located at the pool in the pipeline file, when a pool's bundle asks for a
    GPU or a custom resource that no node of the cluster has (AF604), or when the pools ask for
    more of one than the whole cluster has (AF609): Ray would otherwise wait for the placement
    group forever. CPU slots are not checked: they are scaled down to fit (sim)."""
    total: dict[str, float] = {}  # the cluster's resources, summed over its nodes
    for n in nodes:
        for k, v in n.items():
            total[k] = total.get(k, 0.0) + float(v)
    used: dict[str, float] = {}
    for pool in plan.pools:
        for b in pool.bundles:
            for res, need in b.resources.items():
                need = float(need or 0)
                if res == "CPU" or need <= 0:
                    continue
                have = max((float(n.get(res, 0)) for n in nodes), default=0.0)
                if have + 1e-9 < need:
                    hint = ("no GPU is visible: run with --device-kind cpu (the default 'auto' "
                            "picks CPU slots when there is no GPU)" if res == "GPU" else
                            f"start a node with `ray start --resources '{{\"{res}\": {need:g}}}'`"
                            " or remove the pool's resources entry")
                    cluster = ", ".join(f"{k} {v:g}" for k, v in sorted(total.items())
                                        if not k.startswith(("node:", "memory", "object_store_memory")))
                    raise pool_error(plan, pool, "AF604", hint, need=need, resource=res,
                                      have=have, cluster=cluster)
    for pool in plan.pools:  # every bundle fits a node: do all of them fit the cluster?
        for b in pool.bundles:
            for res, need in b.resources.items():
                if res == "CPU" or float(need or 0) <= 0:
                    continue
                used[res] = used.get(res, 0.0) + float(need)
                if used[res] > total.get(res, 0.0) + 1e-9:
                    need_all = sum(float(x.resources.get(res, 0) or 0)
                                   for p in plan.pools for x in p.bundles)
                    raise pool_error(plan, pool, "AF609", "give the pools fewer devices, or "
                                      f"add nodes with {res}", need=need_all, resource=res,
                                      have=total.get(res, 0.0), where=where)


def pool_error(plan, pool, code: str, hint: str, **fields):
    """A runtime error located at ``pool`` in the pipeline file, quoting its line."""
    loc = source_loc(pool.loc, plan.source_file or "<plan>", len(pool.name))
    sources = Sources()
    sources.add_file(loc.file)
    return error(code, loc, hint, sources=sources, pool=pool.name, **fields)


def source_loc(text: str, fallback: str = "<plan>", width: int = 0):
    """A plan's "file:line:col" (``PoolPlan.loc``, ``TaskPlan.loc``) as a SourceLoc spanning
    ``width`` columns; the start of ``fallback`` when the plan has no location."""
    return SourceLoc.parse(text, width) or SourceLoc(fallback, 1, 1)


def cpu_cores(plan, ncpu: int) -> dict[str, list[int]]:
    """worker id -> the CPU cores its process is pinned to, for a plan on CPU slots.

    Ray reserves CPU slots but does not pin processes, so on a small machine the OS spreads the
    rollout and train processes over all cores and they slow each other down (grpo_digits on 2
    cores: the train step took 0.16 s next to the rollout instead of 0.08 s alone). Here each
    pool bundle gets its own consecutive cores, in pool order, and every worker on a bundle
    (colocated tasks) shares that bundle's cores, as tasks on one GPU share the GPU. Workers with
    no pool (reward, advantage: plain functions) are not pinned. Nothing is pinned when the
    plan's slots do not fit the machine's cores (a sim plan with more slots than cores)."""
    if getattr(plan, "device_kind", "CPU") != "CPU" or ncpu < 1:
        return {}
    slots: dict[tuple[str, int], list[int]] = {}
    nxt = 0
    for pool in plan.pools:
        for b in pool.bundles:
            n = max(1, int(math.ceil(float(b.resources.get("CPU", 0) or 0))))
            slots[(pool.name, b.index)] = list(range(nxt, nxt + n))
            nxt += n
    if nxt > ncpu:
        return {}
    out: dict[str, list[int]] = {}
    for w in plan.workers:
        cores = sorted({c for i in (w.bundles or []) for c in slots.get((w.pool or "", i), [])})
        if cores:
            out[w.id] = cores
    return out


def device_groups(plan, pool) -> list[list[int]]:
    """A pool's devices (bundle indices) grouped by the processes that hold them (placement
    rules 6-7): devices a process holds together are one group, and groups that share a
    process's device merge. Each group is one Ray bundle, since Ray gives an actor resources of
    one bundle only: a replica over two devices needs a bundle of two."""
    parent = list(range(len(pool.bundles)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for w in plan.workers:
        if w.pool == pool.name and w.bundles:
            for b in w.bundles[1:]:
                parent[find(b)] = find(w.bundles[0])
    groups: dict[int, list[int]] = {}
    for i in range(len(pool.bundles)):
        groups.setdefault(find(i), []).append(i)
    return sorted(groups.values())


def process_resources(workers, bundle: dict, scale: float = 1.0) -> dict:
    """What one process of the plan asks Ray for: the sum of its workers' shares (placement
    rule 3: each worker's share of each of its devices) of the Ray bundle it sits in. GPUs:
    a fraction of one device, or whole devices (rule 7; Ray takes no fraction above 1); CPUs
    scaled as the bundles were (:meth:`RayBackend._placement_groups`), never above the bundle."""
    n = len(workers[0].bundles) or 1
    out: dict = {}
    for key, ray_key in (("GPU", "num_gpus"), ("CPU", "num_cpus")):
        share = sum(float(w.resources.get(key, 0) or 0) for w in workers) * n
        if share <= 0 or key not in bundle:
            continue
        if key == "GPU":
            share = float(round(share)) if share > 1 or n > 1 else min(1.0, share)
        else:
            share = share * scale
        out[ray_key] = min(float(bundle[key]), math.floor(share * 10_000) / 10_000)
    return out


def pin(cores: list[int]) -> list[int]:
    """Pin this process (its threads to come: torch's intra-op pool) to ``cores``; the cores
    this machine does not have are ignored. Returns the cores now in effect."""
    if not hasattr(os, "sched_setaffinity"):
        return []
    have = os.sched_getaffinity(0)
    want = {c for c in cores if c in have}
    if want:
        os.sched_setaffinity(0, want)
    return sorted(os.sched_getaffinity(0))
