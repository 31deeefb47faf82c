"""``asyncflow compile``'s estimate, simulated: this plan and its synchronous form (every sync
edge at staleness 0) run in virtual time for a few steps, replacing the cost pass's closed-form
step times (:mod:`asyncflow.compiler.passes.cost`), which miss how a long tail, streaming,
redundancy, refill and first_ready interact (README, "Simulate").

The two simulations run at once, in processes of their own, where there are two CPUs and each
has at least ``PARALLEL_SAMPLES`` samples to simulate (:mod:`asyncflow.simulate.parallel`).
The closed form stays where simulating would take too long (more than ``MAX_SAMPLES`` samples
to simulate) or a plan has no cost hint; the estimate's first note says which one it is.
"""
from __future__ import annotations

import copy
import dataclasses
import time

from asyncflow.plan import Estimate, Plan

STEPS = 12  # steps simulated (the steady state is measured after the first)
MAX_SAMPLES = 60_000  # samples per simulation above which compile keeps the closed form
# samples per simulation from which this plan and its synchronous form are simulated at once,
# in processes of their own (asyncflow.simulate.parallel; below, starting them costs more than
# it saves)
PARALLEL_SAMPLES = 8_192


def sync_sets(plan: Plan) -> list[str]:
    """``--set`` overrides that make ``plan``'s pipeline synchronous (staleness 0 everywhere)."""
    return [f"sync.{i}.max_staleness=0" for i, s in enumerate(plan.sync) if s.max_staleness]


def simulated(plan: Plan, file: str, sets=(), steps: int = STEPS) -> Estimate | None:
    """The estimate of ``plan`` (compiled from ``file`` with ``sets``) by simulation, or None
    when it would cost too much or nothing has a cost."""
    from asyncflow.compiler import compile_file
    from asyncflow.simulate.core import has_costs, simulate

    est = plan.estimate
    n = max(2, min(steps, plan.step.steps))
    if plan.step.samples_per_step * n > MAX_SAMPLES:
        return None
    if not has_costs(plan):
        return None
    t0 = time.perf_counter()
    extra = sync_sets(plan)
    try:
        mine_plan = copy.deepcopy(plan)  # simulate sets the plan's steps
        if not extra:
            mine = sync = simulate(mine_plan, steps=n)
        else:  # the two at once where there are two CPUs and enough to simulate
            from asyncflow.simulate.parallel import default_jobs, simulate_all

            jobs = default_jobs(2) if plan.step.samples_per_step * n >= PARALLEL_SAMPLES else 1
            mine, sync = simulate_all([(mine_plan, {"steps": n}), (compile_file(
                file, list(sets) + extra), {"steps": n})], jobs)
    except Exception as e:  # the estimate never fails a compile: the closed form stays
        if est is not None:
            est.notes.insert(0, f"closed form: the simulation failed ({e.__class__.__name__}: "
                                f"{e}); asyncflow simulate shows why")
        return None
    if mine.stalled or sync.stalled or mine.samples_per_s <= 0 or sync.samples_per_s <= 0:
        return None
    wall = time.perf_counter() - t0
    sps = plan.step.samples_per_step
    step, step_sync = sps / mine.samples_per_s, sps / sync.samples_per_s
    busiest = max(mine.pools.items(), key=lambda kv: kv[1]["utilization"], default=None)
    if busiest is None:
        busiest = max(mine.tasks.items(), key=lambda kv: kv[1]["utilization"], default=None)
        bound = f"task {busiest[0]}" if busiest else ""
    else:
        bound = f"pool {busiest[0]} ({busiest[1]['utilization']:.0%} busy)"
    r = lambda x: round(x, 6)  # noqa: E731
    said = (f"; the closed form said {est.samples_per_s:.1f} / {est.samples_per_s_sync:.1f} "
            "samples/s") if est else ""
    notes = [f"simulated: {n} steps of this plan"
             + (" and of its synchronous form (staleness 0)" if extra else "")
             + f" in {wall:.2f} s (asyncflow simulate){said}"]
    notes += [x for x in (est.notes if est else []) if "not modelled" not in x]
    # ideal: the busiest pool's device work per step, as the simulation spent it
    work = [v["busy_s"] / max(1, v["devices"]) / len(mine.step_ends) for v in mine.pools.values()]
    ideal = max(work, default=0.0) or (est.ideal_step_time if est else 0.0)
    return dataclasses.replace(
        est or Estimate(0, 0, 0, 0, 0, 1), step_time=r(step), step_time_sync=r(step_sync),
        ideal_step_time=r(ideal),
        samples_per_s=r(mine.samples_per_s), samples_per_s_sync=r(sync.samples_per_s),
        speedup=r(step_sync / step) if step > 0 else 1.0, notes=notes, bottleneck=bound)
