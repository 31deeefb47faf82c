"""Several simulations at once: ``asyncflow simulate --sweep ... --jobs N``.

A simulation is one Python loop on one core (the runtime's own loop code, per sample: README,
"Simulate"), and a sweep's simulations are independent: each value's plan is compiled here,
then simulated in a process of its own, at most ``jobs`` at a time, and the results come back
in the sweep's order. A simulation is deterministic (its draws are keyed by row), so the
results are the very ones ``--jobs 1`` gives in this process; only the wall time differs.

The processes are forked from this one where it runs no other Python thread (fast, nothing
to import again; numpy's BLAS pool, a native thread every process here has, resets itself in
a forked child, and a child never calls BLAS, torch or Ray); otherwise (a Ray client, a logger
thread) from a fork server, a process that started clean, so no lock another thread holds is
copied into a child; or spawned where neither exists.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
from concurrent.futures import ProcessPoolExecutor

from asyncflow.plan import Plan


def default_jobs(runs: int) -> int:
    """One process per CPU this process may run on, at most one per simulation."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, runs))


def _context():
    methods = mp.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return mp.get_context("fork")
    if "forkserver" in methods:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["asyncflow.simulate.core"])
        return ctx
    return mp.get_context("spawn")


def _one(job: tuple):
    from asyncflow.simulate import simulate

    plan, kw = job
    return simulate(plan, **kw)


def simulate_all(runs: list[tuple[Plan, dict]], jobs: int) -> list:
    """``simulate(plan, **kw)`` of each ``(plan, kw)``, ``jobs`` at a time (1: one after the
    other, here); the results in ``runs``' order. An exception in a simulation is raised here,
    as ``jobs=1`` would."""
    jobs = max(1, min(int(jobs), len(runs)))
    if jobs == 1:
        return [_one(r) for r in runs]
    with ProcessPoolExecutor(max_workers=jobs, mp_context=_context()) as pool:
        return list(pool.map(_one, runs))


__all__ = ["default_jobs", "simulate_all"]
