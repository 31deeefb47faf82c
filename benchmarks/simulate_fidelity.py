"""Simulator fidelity: ``asyncflow simulate`` against the real run of the very same plan.

    python benchmarks/simulate_fidelity.py [--steps 20] [--backend local|ray] [--quick]
                                           [--only NAME,...] [--repeat K] [--json PATH]
                                           [--calibrate-steps 6 | --no-calibrate]
                                           [--keep-calibration DIR]

For each configuration it compiles the plan once, simulates it (:func:`asyncflow.simulate.
simulate`, virtual time) and runs it for real (:class:`asyncflow.runtime.driver.Driver`, the sim
engine sleeping its device times), then prints both throughputs and their ratio:

- ``steady``: samples of steps 1..N-1 over the time from the end of step 0 to the end of the
  last step (``benchmarks/overlap.py``'s definition, on both sides);
- ``whole``: every step's samples over the time from the moment rows can flow (the real run's
  step-0 clock start, ``Driver.ready``; virtual time 0) to the end of the last step.

Configurations: ``pipelines/sim_longtail.yaml`` at alpha 0/1/2/4; the scheduling keys on the same
workload (``first_ready`` with ``on_update: continue``, ``redundancy: 1.5``, ``schedule: batch`` at
alpha 1; ``stream: false`` at alpha 0, where the trainer is on the critical path);
``pipelines/agentic_sim.yaml``; and, named ``W ...``, the scheduling keys on
``benchmarks/scheduling.py``'s workload (one 64-slot replica, a longer tail, a 2 ms/sample
trainer), which is rollout-bound at every alpha: on sim_longtail alpha >= 1 is train-bound, so
there the keys hardly change the timeline. ``--quick``: 8 steps and six of them.

Measured on the 2-core development machine (20 steps; sim/real of the steady throughput):
local 0.97-1.05 for all 19 (18 within 1.025; ``W first_ready+continue``: 1.004-1.05 from run to
run, the final step waiting on whichever long-tail sample the timing-dependent staleness drops
left in it); ray 0.95-1.52, a fixed 0.05-0.17 s per step of Ray store reads (the trainer's, one
per micro-batch), publishes and version syncs, so the shorter the step the larger the gap.

Calibrated (``asyncflow simulate --calibrate``, :mod:`asyncflow.simulate.calibrate`): before
the measured run, a separate short real run of the same plan (``--calibrate-steps``, 6) into a
temporary run directory; the simulation with the costs fitted to that run is printed beside the
uncalibrated one (two tables), each with its count within 5% (and 2.5%).

Goal (issue "Simulate"): the simulated steady throughput within 5% of the real run's. What the
simulator leaves out (its module docstring) is Python and Ray overhead: written samples flushed
in 5 ms batches, 10 ms control syncs, Ray call latency, the driver's 10 ms (local) / 50 ms (ray)
poll. Those make the real run slower, never faster, so ``sim/real`` above 1 by a few percent is
the expected sign; a ratio below 1, or far above, points to a modelling difference.

Warm start: the local backend's workers are threads of this process, and the first call of the
advantage task imports torch (about 1.5 s here) inside step 0, which would count against the
real run's whole-run throughput only. The benchmark imports it before the runs (``--cold``: not).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

LONGTAIL = "pipelines/sim_longtail.yaml"
AGENTIC = "pipelines/agentic_sim.yaml"

CONFIGS: list[tuple[str, str, list[str]]] = [
    *[(f"longtail a={a}", LONGTAIL, [f"sync.0.max_staleness={a}"]) for a in (0, 1, 2, 4)],
    ("first_ready+continue a=1", LONGTAIL,
     ["sync.0.max_staleness=1", "tasks.update.consume=first_ready",
      "tasks.generate.on_update=continue"]),
    ("redundancy 1.5 a=1", LONGTAIL, ["sync.0.max_staleness=1", "tasks.generate.redundancy=1.5"]),
    ("schedule batch a=1", LONGTAIL, ["sync.0.max_staleness=1", "tasks.generate.schedule=batch"]),
    ("stream false a=0", LONGTAIL, ["sync.0.max_staleness=0", "tasks.update.stream=false"]),
    ("agentic_sim a=2", AGENTIC, []),
]
# benchmarks/scheduling.py's workload: one rollout replica of 64 slots, a longer tail (sigma 1.5,
# capped at 2 s), 64 samples a step and a 2 ms/sample trainer: rollout-bound at every alpha, so
# the scheduling keys change the throughput (on sim_longtail, alpha >= 1 is train-bound)
SCHED = [
    "tasks.generate.replicas=1", "pools.rollout.devices=1", "tasks.generate.args.slots=64",
    "tasks.generate.args.latency={dist: lognormal, median: 0.05, sigma: 1.5, max: 2.0, seed: 5}",
    "step.prompts_per_step=16", "step.samples_per_prompt=4",
    "tasks.update.args.seconds_per_sample=0.002", "tasks.update.args.micro_batch=16",
]
PARETO = "tasks.generate.args.latency={dist: pareto, scale: 0.03, alpha: 1.2, max: 2.0, seed: 5}"
CONFIGS += [
    ("W a=0", LONGTAIL, SCHED + ["sync.0.max_staleness=0"]),
    ("W a=1 finish", LONGTAIL, SCHED + ["sync.0.max_staleness=1"]),
    ("W a=1 continue", LONGTAIL, SCHED + ["sync.0.max_staleness=1",
                                          "tasks.generate.on_update=continue"]),
    ("W a=1 abort", LONGTAIL, SCHED + ["sync.0.max_staleness=1", "tasks.generate.on_update=abort"]),
    ("W first_ready+continue a=1", LONGTAIL,
     SCHED + ["sync.0.max_staleness=1", "tasks.update.consume=first_ready",
              "tasks.generate.on_update=continue"]),
    ("W pareto redundancy 1.5 a=1", LONGTAIL,
     SCHED + ["sync.0.max_staleness=1", PARETO, "tasks.generate.on_update=continue",
              "tasks.generate.redundancy=1.5"]),
    ("W pareto redundancy 1.0 a=1", LONGTAIL,
     SCHED + ["sync.0.max_staleness=1", PARETO, "tasks.generate.on_update=continue"]),
    ("W schedule batch a=1", LONGTAIL,
     SCHED + ["sync.0.max_staleness=1", "tasks.generate.on_update=continue",
              "tasks.generate.schedule=batch"]),
    ("W stream false a=0", LONGTAIL, SCHED + ["sync.0.max_staleness=0",
                                              "tasks.update.args.seconds_per_sample=0.01",
                                              "tasks.update.stream=false"]),
    ("W stream true a=0", LONGTAIL, SCHED + ["sync.0.max_staleness=0",
                                             "tasks.update.args.seconds_per_sample=0.01"]),
]
QUICK = ["longtail a=0", "longtail a=2", "agentic_sim a=2", "W a=1 continue",
         "W first_ready+continue a=1", "W pareto redundancy 1.5 a=1"]


def throughput(ends: list[float], samples: list[int], start: float) -> tuple[float, float]:
    """(steady, whole) samples/s from step end times (seconds, one clock) and rows per step."""
    if not ends:
        return 0.0, 0.0
    span = ends[-1] - ends[0]
    steady = sum(samples[1:]) / span if len(ends) > 1 and span > 0 else 0.0
    whole_t = ends[-1] - start
    return steady, (sum(samples) / whole_t if whole_t > 0 else 0.0)


def real_run(plan, backend: str) -> dict:
    from asyncflow.runtime.driver import Driver

    d = Driver(plan, backend)
    t = time.time()
    r = d.run()
    ms = r.metrics
    ends = [m["time"] for m in ms]
    # step 0's clock starts when rows can flow (Driver.ready): time of its end - its step_time
    start = ms[0]["time"] - ms[0]["step_time"] if ms else 0.0
    steady, whole = throughput(ends, [m["samples"] for m in ms], start)
    return {"steady": steady, "whole": whole, "steps": len(ms), "wall_s": time.time() - t,
            "step_ends": [e - start for e in ends],
            # rows dropped (every reason but filter/redundant) and redundant groups' rows cancelled
            "dropped": sum(int(m.get("dropped") or 0) for m in ms)
            + int(ms[-1].get("cancelled") or 0 if ms else 0),
            "staleness_max": max((m["staleness_max"] or 0 for m in ms), default=0)}


def sim_run(plan, calibration=None) -> dict:
    from asyncflow.simulate import simulate

    r = simulate(plan, calibration=calibration)
    steady, whole = throughput(r.step_ends, r.samples, 0.0)
    assert abs(steady - r.samples_per_s) < 1e-6 * max(1.0, steady)
    return {"steady": steady, "whole": whole, "steps": len(r.step_ends), "wall_s": r.wall_s,
            "step_ends": list(r.step_ends), "drops": r.drops, "dropped": sum(r.drops.values()),
            "cancelled": r.cancelled,
            "staleness_max": max(r.staleness_max, default=0), "events": r.events,
            "stalled": r.stalled}


def calibration(plan, backend: str, steps: int, keep: str | None = None):
    """A short real run of ``plan`` (``steps`` steps) into a temporary run directory (``keep``:
    into that directory, kept, to fit other ways later), and the costs fitted to it
    (:func:`asyncflow.simulate.calibrate.calibrate`)."""
    import contextlib
    import tempfile

    from asyncflow.runtime.driver import Driver
    from asyncflow.simulate.calibrate import calibrate

    where = contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory(
        prefix="asyncflow-calibrate-")
    with where as d:
        Driver(plan.with_steps(steps), backend, out_dir=d).run()
        return calibrate(plan, d)


def keep_dir(root: str, name: str) -> str:
    """Where ``--keep-calibration root`` keeps configuration ``name``'s calibration run (read
    back by benchmarks/calibration_fit.py)."""
    return os.path.join(root, re.sub(r"[^A-Za-z0-9_.=+-]+", "_", name))


def one(name: str, path: str, sets: list[str], steps: int, backend: str, repeat: int,
        cal_steps: int = 0, keep: str | None = None) -> dict:
    from asyncflow.compiler.pipeline import compile_file

    plan = compile_file(path, sets=sets + [f"step.steps={steps}"])
    sim = sim_run(compile_file(path, sets=sets + [f"step.steps={steps}"]))
    cal = calibration(plan, backend, cal_steps, keep) if cal_steps else None
    reals = [real_run(plan, backend) for _ in range(repeat)]
    best = max(reals, key=lambda r: r["steady"])  # noise only ever slows a real run down
    row = {"config": name, "file": path, "sets": sets, "sim": sim, "real": best,
           "real_all": [{"steady": r["steady"], "whole": r["whole"]} for r in reals],
           "ratio_steady": sim["steady"] / best["steady"] if best["steady"] else None,
           "ratio_whole": sim["whole"] / best["whole"] if best["whole"] else None}
    if cal is not None:
        cs = sim_run(plan, cal)
        row.update(sim_cal=cs, calibration=cal.describe(),
                   ratio_steady_cal=cs["steady"] / best["steady"] if best["steady"] else None,
                   ratio_whole_cal=cs["whole"] / best["whole"] if best["whole"] else None)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--backend", default="local", choices=["local", "ray"])
    ap.add_argument("--quick", action="store_true", help="8 steps, 4 configurations")
    ap.add_argument("--only", default=None, help="comma-separated configuration names")
    ap.add_argument("--repeat", type=int, default=1,
                    help="real runs per configuration (the fastest is kept)")
    ap.add_argument("--cold", action="store_true", help="do not import torch before the runs")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--calibrate-steps", type=int, default=6,
                    help="steps of the separate short real run the calibration is fitted to")
    ap.add_argument("--no-calibrate", action="store_true", help="the uncalibrated table only")
    ap.add_argument("--keep-calibration", default=None, metavar="DIR",
                    help="keep each calibration run in DIR/<configuration> (else removed)")
    a = ap.parse_args(argv)
    steps = 8 if a.quick and a.steps == 20 else a.steps
    names = [n.strip() for n in a.only.split(",")] if a.only else (QUICK if a.quick else None)
    configs = [c for c in CONFIGS if names is None or c[0] in names]
    if not configs:
        ap.error(f"no configuration named {a.only!r} (known: {', '.join(c[0] for c in CONFIGS)})")
    if a.keep_calibration:  # a kept run is never overwritten (its --json would no longer match)
        taken = [d for d in (keep_dir(a.keep_calibration, c[0]) for c in configs)
                 if os.path.exists(d)]
        if taken:
            ap.error(f"--keep-calibration: {', '.join(taken)} already exists (a new DIR, or "
                     "remove it)")
    if a.backend == "ray":
        from asyncflow.runtime.ray_connect import ensure_ray

        ensure_ray()
    if not a.cold:
        import asyncflow.algos.advantages  # noqa: F401  (imports torch: not a step's cost)
    rows = []
    for name, path, sets in configs:
        t = time.time()
        keep = keep_dir(a.keep_calibration, name) if a.keep_calibration else None
        rows.append(one(name, path, sets, steps, a.backend, a.repeat,
                        0 if a.no_calibrate else a.calibrate_steps, keep))
        print(f"  {name}: {time.time() - t:.1f} s", file=sys.stderr)
    print_table(rows, a.backend, steps, "")
    if not a.no_calibrate:
        print()
        print_table(rows, a.backend, steps, "_cal")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def print_table(rows: list[dict], backend: str, steps: int, which: str) -> None:
    """One table: the uncalibrated simulation (``which`` "") or the calibrated one ("_cal")."""
    sim, rs, rw = "sim" + which, "ratio_steady" + which, "ratio_whole" + which
    head = (f"{'config':<26} {'real':>8} {'sim':>8} {'sim/real':>8}   {'real':>8} {'sim':>8} "
            f"{'sim/real':>8}  {'dropped':>11}  {'sim wall':>8}")
    print(f"simulated{' (calibrated by a separate short run)' if which else ''} vs real "
          f"({backend}, {steps} steps): samples/s, steady | whole run | rows dropped real/sim")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['config']:<26} {r['real']['steady']:>8.1f} {r[sim]['steady']:>8.1f} "
              f"{r[rs] or 0:>8.3f}   {r['real']['whole']:>8.1f} "
              f"{r[sim]['whole']:>8.1f} {r[rw] or 0:>8.3f}  "
              f"{r['real']['dropped']:>5}/{r[sim]['dropped']:<5}  {r[sim]['wall_s']:>7.2f}s")
    for tol in (0.05, 0.025):
        off = [r for r in rows if r[rs] is None or abs(r[rs] - 1) > tol]
        print(f"steady within {tol:.1%}: {len(rows) - len(off)}/{len(rows)}"
              + (f" (not: {', '.join(r['config'] for r in off)})" if off else ""))


if __name__ == "__main__":
    sys.exit(main())
