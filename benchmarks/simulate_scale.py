"""Simulator scale: how the cost of ``asyncflow simulate`` grows with the rollout fleet.

    python benchmarks/simulate_scale.py [--devices 16,64,256,1024,4096,10000] [--steps 20]
                                        [--big-steps 5] [--per-device 2] [--slots 4]
                                        [--alpha 1] [--json PATH]
                                        [--baseline DIR [--repeat 2]]
                                        [--sweep SPLITS [--jobs N]]

``--baseline DIR``: before/after, side by side. Each size runs in subprocesses, once with
``PYTHONPATH=DIR`` (another checkout of asyncflow, e.g. the commit before a change) and once
with this checkout, alternating which goes first, ``--repeat`` times; printed per size: the
wall seconds (build + simulate, the best of the repeats) and simulated samples/s (samples
trained / those seconds) of each, their ratio, the CPU seconds of each (what a shared
machine's load does not inflate), and whether both simulated the same run (the same samples,
steps, step ends and virtual time; the number of events may differ: a wake-up that could find
nothing is not made).

``--sweep SPLITS``: the resource planner's sweep (``asyncflow simulate FILE --sweep
split=SPLITS``) on each size, one simulation after the other (``--jobs 1``) and one per CPU
(``--jobs N``), side by side: the whole command's wall seconds, their ratio, and whether both
gave the same runs.

Every pipeline is built in code (a YAML file written to a temporary directory, the shape of
``pipelines/sim_longtail.yaml``): N rollout devices = N replicas of ``generate`` (sim engine,
``slots`` each, per-sample latency lognormal, median 5 s, sigma 1.0, capped at 60 s), a reward, a
GRPO advantage, and one sim trainer replica (micro-batches of up to 256 rows) on N/16 train
devices (``devices_per_replica``, data parallel) at 20 ms a sample: the train step is
2N x 0.02 / (N/16) = 0.64 s at every N, so the virtual timeline has the same shape across
sizes. The batch is per device: ``per-device`` samples a step for every rollout device
(prompts_per_step = per-device x N / 8, 8 samples a prompt), so the work simulated grows
linearly with N. Staleness bound ``alpha`` (default 1).

Printed per size: compile seconds, build seconds (the Simulation's workers), simulate seconds
(wall), events, events/s, samples trained, microseconds of simulation (build + run) per trained
sample, the simulated throughput and the rollout pool's utilization. Sizes of 4,096 devices and
more run ``--big-steps`` steps (default 5) instead of ``--steps``.

Measured on the 2-core development machine (defaults), with the runtime's SampleStore: 1,024
devices x 20 steps (2,048 samples/step) 10.4 s; with ``--per-device 4`` (4,096 samples/step)
21.7 s; 10,000 devices x 5 steps (20,000 samples/step) 52 s. The cost per sample grew with N:
the store's eligibility scan covered every live row, and a trainer's in-order step read
intersects its rows with the window on every read. The simulator now runs on the event-indexed
:class:`asyncflow.simulate.vstore.VStore` (no scans); before/after figures (``--baseline``) are
in benchmarks/README.md: 1.7-2.8x less CPU a sample at 64-1,024 devices x 16 samples each.

Goal (issue 24): 1,024 rollout devices x 16 samples each x 20 steps in at most 30 s, and at
least 50,000 simulated samples/s (327,680 samples in 30 s are 10,923 a second: the second
figure asks for 6.6 s). The first is met on the 2-core machine (20.8 s, quiet, 2026-11-27), the
second is not: benchmarks/README.md says where the time goes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

YAML = """\
pipeline: scale_{n}
description: {n} sim rollout devices, {per} samples a step per device (simulate_scale.py)
models:
  policy: {{init: asyncflow.models:tiny_decoder, args: {{layers: 2, hidden: 64}}}}
data:
  prompts:
    source: asyncflow.datasets:digits
    args: {{n: 1000, seed: 0}}
    fields: [prompt, answer]
pools:
  rollout: {{devices: {n}}}
  train: {{devices: {train}}}
step: {{prompts_per_step: {prompts}, samples_per_prompt: 8, steps: {steps}}}
tasks:
  generate:
    kind: rollout
    engine: sim
    model: policy
    pool: rollout
    replicas: {n}
    inputs: [prompt]
    outputs: [response, logprobs]
    args:
      slots: {slots}
      latency: {{dist: lognormal, median: 5.0, sigma: 1.0, max: 60.0, seed: 5}}
  score:
    kind: reward
    fn: asyncflow.rewards:digits_match
    inputs: [prompt, answer, response]
    outputs: [reward]
  advantage: {{kind: advantage, estimator: grpo, inputs: [reward], outputs: [advantages]}}
  update:
    kind: train
    engine: sim
    model: policy
    pool: train
    devices_per_replica: {train}
    loss: grpo
    inputs: [prompt, response, logprobs, advantages]
    args: {{seconds_per_sample: 0.02, micro_batch: {micro}}}
sync:
  - {{from: update, to: generate, max_staleness: {alpha}}}
"""


def pipeline_yaml(n: int, steps: int, per_device: int = 2, slots: int = 4, alpha: int = 1) -> str:
    """The YAML text of the ``n``-device pipeline (module docstring)."""
    if (per_device * n) % 8:
        raise ValueError(f"per_device x devices ({per_device} x {n}) must be a multiple of 8")
    return YAML.format(n=n, per=per_device, train=max(1, n // 16), prompts=per_device * n // 8,
                       steps=steps, slots=slots, alpha=alpha,
                       micro=math.gcd(256, per_device * n))


def one(n: int, steps: int, per_device: int, slots: int, alpha: int, tmp: str) -> dict:
    from asyncflow.compiler.pipeline import compile_file
    from asyncflow.simulate import Simulation

    path = os.path.join(tmp, f"scale_{n}.yaml")
    with open(path, "w") as f:
        f.write(pipeline_yaml(n, steps, per_device, slots, alpha))
    t = time.perf_counter()
    plan = compile_file(path)
    compile_s = time.perf_counter() - t
    t, c = time.perf_counter(), time.process_time()
    sim = Simulation(plan)
    build_s = time.perf_counter() - t
    r = sim.run()
    cpu_s = time.process_time() - c  # build + simulate: this process's CPU (a loaded machine)
    trained = sum(r.samples)
    generated = sim.fed * plan.step.samples_per_prompt  # rows fed (some still in flight)
    return {"devices": n, "steps": len(r.step_ends), "steps_asked": steps,
            "samples_per_step": plan.step.samples_per_step, "slots": slots, "alpha": alpha,
            "compile_s": compile_s, "build_s": build_s, "simulate_s": r.wall_s, "cpu_s": cpu_s,
            "events": r.events, "events_per_s": r.events / r.wall_s if r.wall_s else 0.0,
            "samples": trained, "rows_fed": generated,
            "us_per_sample": 1e6 * (build_s + r.wall_s) / trained if trained else 0.0,
            "virtual_s": r.virtual_s, "step_ends": list(r.step_ends),
            "samples_per_s_virtual": r.samples_per_s,
            "rollout_utilization": r.pools.get("rollout", {}).get("utilization"),
            "stalled": r.stalled}


def _sub(pythonpath: str, n: int, steps: int, a, tmp: str) -> dict:
    """One size in a subprocess with ``PYTHONPATH=pythonpath``: its result row."""
    import subprocess

    out = os.path.join(tmp, f"r_{n}_{abs(hash(pythonpath))}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--devices", str(n), "--steps", str(steps),
           "--big-steps", str(steps), "--per-device", str(a.per_device), "--slots", str(a.slots),
           "--alpha", str(a.alpha), "--json", out]
    env = {**os.environ, "PYTHONPATH": pythonpath}
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)[0]


def compare(a, sizes: list[int]) -> int:
    """``--baseline``: before/after side by side (module docstring)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = []
    with tempfile.TemporaryDirectory(prefix="af-scale-") as tmp:
        for n in sizes:
            steps = a.big_steps if n >= 4096 else a.steps
            best = {"before": None, "after": None}
            for i in range(a.repeat):
                order = [("before", a.baseline), ("after", here)]
                for name, path in (order if i % 2 == 0 else order[::-1]):
                    r = _sub(path, n, steps, a, tmp)
                    r["wall"] = r["build_s"] + r["simulate_s"]
                    if best[name] is None or r["wall"] < best[name]["wall"]:
                        best[name] = r
            b, f = best["before"], best["after"]
            same = all(b.get(k) == f.get(k) for k in ("samples", "virtual_s", "steps", "step_ends"))
            rows.append((n, steps, b, f, same))
            print(f"  {n} devices: before {b['wall']:.2f} s, after {f['wall']:.2f} s",
                  file=sys.stderr)
    print(f"simulate cost, before ({a.baseline}) / after (this checkout): {a.per_device} "
          f"samples/step per device, {a.slots} slots a replica, alpha {a.alpha}, best of "
          f"{a.repeat}")
    head = (f"{'devices':>7} {'steps':>5} {'samples/step':>12} {'samples':>8} "
            f"{'before s':>9} {'after s':>8} {'before smp/s':>12} {'after smp/s':>11} "
            f"{'speedup':>7} {'before cpu s':>12} {'after cpu s':>11} {'cpu speedup':>11} "
            f"{'same run':>8}")
    print(head)
    print("-" * len(head))
    for n, steps, b, f, same in rows:
        print(f"{n:>7} {steps:>5} {f['samples_per_step']:>12} {f['samples']:>8} "
              f"{b['wall']:>9.2f} {f['wall']:>8.2f} {b['samples'] / b['wall']:>12.0f} "
              f"{f['samples'] / f['wall']:>11.0f} {b['wall'] / f['wall']:>6.2f}x "
              f"{b['cpu_s']:>12.2f} {f['cpu_s']:>11.2f} {b['cpu_s'] / f['cpu_s']:>10.2f}x "
              f"{'yes' if same else 'NO':>8}")
    return 0 if all(r[4] for r in rows) else 1


def sweep(a, sizes: list[int]) -> int:
    """``--sweep SPLITS``: ``asyncflow simulate FILE --sweep split=SPLITS --json`` on each size's
    pipeline, with ``--jobs 1`` (one simulation after the other) and ``--jobs`` N (one per
    CPU, :mod:`asyncflow.simulate.parallel`), alternating which goes first, ``--repeat`` times:
    the best wall seconds of each, their ratio, and whether both gave the same runs."""
    import subprocess

    jobs = a.jobs or len(os.sched_getaffinity(0))
    rows = []
    with tempfile.TemporaryDirectory(prefix="af-scale-") as tmp:
        for n in sizes:
            steps = a.big_steps if n >= 4096 else a.steps
            path = os.path.join(tmp, f"scale_{n}.yaml")
            with open(path, "w") as f:
                f.write(pipeline_yaml(n, steps, a.per_device, a.slots, a.alpha))
            best: dict = {}
            for i in range(a.repeat):
                for j in ((1, jobs) if i % 2 == 0 else (jobs, 1)):
                    t = time.perf_counter()
                    out = subprocess.run([sys.executable, "-m", "asyncflow.cli", "simulate", path,
                                          "--sweep", f"split={a.sweep}", "--json", "-j", str(j)],
                                         check=True, capture_output=True, text=True).stdout
                    wall = time.perf_counter() - t
                    d = json.loads(out)
                    runs = [{k: v for k, v in r.items() if k not in ("wall_s", "events_per_s")}
                            for r in d["runs"]]
                    if j not in best or wall < best[j][0]:
                        best[j] = (wall, runs, d["best"])
                    print(f"  {n} devices, --jobs {j}: {wall:.2f} s", file=sys.stderr)
            (w1, r1, b1), (wn, rn, bn) = best[1], best[jobs]
            rows.append((n, steps, len(r1), w1, wn, r1 == rn, b1))
    print(f"simulate --sweep split={a.sweep}: --jobs 1 against --jobs {jobs} (whole command, "
          f"best of {a.repeat}), {a.per_device} samples/step per device")
    head = (f"{'devices':>7} {'steps':>5} {'values':>6} {'jobs 1 s':>8} {f'jobs {jobs} s':>9} "
            f"{'speedup':>7} {'same runs':>9} {'best':>10}")
    print(head)
    print("-" * len(head))
    for n, steps, k, w1, wn, same, b in rows:
        print(f"{n:>7} {steps:>5} {k:>6} {w1:>8.2f} {wn:>9.2f} {w1 / wn:>6.2f}x "
              f"{'yes' if same else 'NO':>9} {b:>10}")
    return 0 if all(r[5] for r in rows) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="16,64,256,1024,4096,10000")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--big-steps", type=int, default=5, help="steps at 4,096 devices and more")
    ap.add_argument("--per-device", type=int, default=2, help="samples a step per rollout device")
    ap.add_argument("--slots", type=int, default=4, help="slots per rollout replica")
    ap.add_argument("--alpha", type=int, default=1, help="max_staleness")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--baseline", default=None,
                    help="before/after: PYTHONPATH of the asyncflow to compare with")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each side (--baseline, "
                    "--sweep)")
    ap.add_argument("--sweep", default=None, metavar="SPLITS",
                    help="a split sweep (e.g. auto, or 960:128,896:192) run with --jobs 1 and "
                         "--jobs N side by side")
    ap.add_argument("--jobs", type=int, default=0, help="--sweep: N (default: one per CPU)")
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.devices.split(",")]
    if a.baseline:
        return compare(a, sizes)
    if a.sweep:
        return sweep(a, sizes)
    rows = []
    with tempfile.TemporaryDirectory(prefix="af-scale-") as tmp:
        for n in sizes:
            steps = a.big_steps if n >= 4096 else a.steps
            rows.append(one(n, steps, a.per_device, a.slots, a.alpha, tmp))
            r = rows[-1]
            print(f"  {n} devices: compile {r['compile_s']:.2f} s, simulate "
                  f"{r['build_s'] + r['simulate_s']:.2f} s", file=sys.stderr)
    print(f"simulate cost: {a.per_device} samples/step per device, {a.slots} slots a replica, "
          f"alpha {a.alpha}")
    head = (f"{'devices':>7} {'steps':>5} {'samples/step':>12} {'compile s':>9} {'build s':>7} "
            f"{'sim s':>7} {'events':>9} {'events/s':>9} {'samples':>8} {'us/sample':>9} "
            f"{'virt samples/s':>14} {'roll util':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['devices']:>7} {r['steps']:>5} {r['samples_per_step']:>12} "
              f"{r['compile_s']:>9.2f} {r['build_s']:>7.2f} {r['simulate_s']:>7.2f} "
              f"{r['events']:>9} {r['events_per_s']:>9.0f} {r['samples']:>8} "
              f"{r['us_per_sample']:>9.1f} {r['samples_per_s_virtual']:>14.1f} "
              f"{r['rollout_utilization'] or 0:>9.3f}" + (f"  STALLED: {r['stalled']}"
                                                          if r["stalled"] else ""))
    for r in rows:
        wall = r["build_s"] + r["simulate_s"]
        print(f"{r['devices']:>7} devices: {r['samples'] / wall if wall else 0:,.0f} simulated "
              f"samples/s ({r['samples']} samples in {wall:.1f} s wall, {r['cpu_s']:.1f} s CPU)")
    for r in rows:
        if r["devices"] == 1024 and r["steps"] >= 20:
            s = r["build_s"] + r["simulate_s"]
            per = r["samples"] // (r["steps"] * 1024)
            if per >= 16:  # the goal: 16,384 samples a step (16 a device)
                rate = r["samples"] / s if s else 0.0
                # (the two figures differ: 327,680 samples in 30 s is 10,923 a second)
                print(f"1,024 devices x {per} samples x {r['steps']} steps: {s:.1f} s wall "
                      f"(goal <= 30 s: {'met' if s <= 30 else 'NOT met'}), {rate:,.0f} "
                      f"simulated samples/s (goal >= 50,000/s: "
                      f"{'met' if rate >= 50_000 else 'NOT met'})")
            else:
                print(f"1,024 devices x {per} samples x {r['steps']} steps: {s:.1f} s wall (the "
                      "goal is at --per-device 16)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
