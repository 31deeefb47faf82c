"""The runtime's own cost: samples/s with near-free engines, and µs per sample per task and op.

``pipelines/sim_longtail.yaml`` with 16,384 samples a step (4,096 prompts x 4) and engines that
cost almost nothing: a rollout sample takes 10 ms of modelled time in one of 16,384 slots, the
trainer 50 µs a sample (micro-batches of 1,024). The engines' ceiling is the trainer's, 20,000
samples/s; everything below it is the runtime (store, workers, driver, control) and the sim
engine's own Python (drawing each row's latency and outputs). Each configuration runs through the
CLI in a subprocess, one after the other in this one invocation:

- samples/s in the steady state (the median step of steps 2..N, and the mean), and its share of
  the 20,000 ceiling;
- per task and op kind, **CPU µs per sample**: the worker loop thread's CPU time in each op
  (``workers.json`` ``cpu_s``, ``time.thread_time`` between op changes) over the run's samples --
  the runtime's bookkeeping, apart from the time it waits;
- per task and op kind, **wall µs per sample** from ``trace.json`` (waits included: a READ that
  blocks on an empty store counts here, not above).

A trainer's micro-batch is a few sequences, so ``--micro-batch`` takes a list and sweeps it
(a step of 16,384 samples is 1,024 micro-batches of 16). ``--base CHECKOUT`` runs every
configuration with that checkout's asyncflow too (``PYTHONPATH=CHECKOUT``), alternating A/B
``--repeat`` times, and prints the two side by side with their ratio:

    .venv/bin/python benchmarks/runtime.py                      # local r1, ray r1, ray r4
    .venv/bin/python benchmarks/runtime.py --only local-1 --steps 8 --json out.json
    .venv/bin/python benchmarks/runtime.py --only ray-1 --micro-batch 16,64,1024 --base ../base
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIPELINE = os.path.join(ROOT, "pipelines", "sim_longtail.yaml")
CONFIGS = {"local-1": ("local", 1), "local-4": ("local", 4), "ray-1": ("ray", 1),
           "ray-4": ("ray", 4)}


def overrides(prompts: int, replicas: int, steps: int, train_us: float, micro: int) -> list[str]:
    sets = {
        "step.prompts_per_step": prompts, "step.steps": steps,
        "tasks.generate.replicas": replicas, "pools.rollout.devices": replicas,
        "tasks.generate.args.slots": max(64, prompts * 4 // replicas),
        "tasks.generate.args.latency": 0.01,
        "tasks.update.args.seconds_per_sample": train_us / 1e6,
        "tasks.update.args.micro_batch": micro,
    }
    out = []
    for k, v in sets.items():
        out += ["--set", f"{k}={v}"]
    return out


def run_one(name: str, backend: str, replicas: int, args, micro: int,
            checkout: str | None = None) -> dict:
    """One configuration through the CLI; ``checkout``: with that checkout's asyncflow."""
    out = tempfile.mkdtemp(prefix=f"af-runtime-{name}-")
    exe = os.path.join(os.path.dirname(sys.executable), "asyncflow")
    cmd = [exe, "run", PIPELINE, "--backend", backend, "--quiet", "--force", "--out", out,
           *overrides(args.prompts, replicas, args.steps, args.train_us, micro)]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout or ROOT))
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    if p.returncode != 0:
        raise SystemExit(f"{name}: asyncflow run failed ({p.returncode}):\n{p.stdout[-3000:]}"
                         f"\n{p.stderr[-3000:]}")
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steady = [m for m in metrics if m["step"] >= 2]  # step 1 (index 1) and 0 warm up
    times = [m["step_time"] for m in steady] or [m["step_time"] for m in metrics]
    spp = metrics[0]["samples"]
    samples = sum(m["samples"] for m in metrics)
    workers = json.load(open(os.path.join(out, "workers.json")))
    cpu: dict = collections.defaultdict(float)
    for w in workers.values():
        for op, s in (w.get("cpu_s") or {}).items():
            cpu[(w["task"], op)] += s
    trace = json.load(open(os.path.join(out, "trace.json")))["traceEvents"]
    wall_op: dict = collections.defaultdict(float)
    for e in trace:
        if e.get("ph") == "X":
            wall_op[(e["cat"], e["name"])] += e["dur"] / 1e6
    return {
        "name": name, "backend": backend, "replicas": replicas, "micro_batch": micro,
        "checkout": os.path.abspath(checkout or ROOT), "samples_per_step": spp,
        "samples_per_s_median": spp / statistics.median(times),
        "samples_per_s_mean": spp * len(times) / sum(times),
        "process_wall_s": wall, "samples": samples,
        "cpu_us": {f"{t}.{op}": s / samples * 1e6 for (t, op), s in sorted(cpu.items())},
        "wall_us": {f"{t}.{op}": s / samples * 1e6 for (t, op), s in sorted(wall_op.items())},
        "out": out,
    }


def table(results: list[dict], key: str, title: str) -> None:
    rows = sorted({k for r in results for k in r[key]})
    names = [r["name"] for r in results]
    print(f"\n{title}")
    w = max([12] + [len(n) + 2 for n in names])
    print(f"{'task.op':<22}" + "".join(f"{n:>{w}}" for n in names))
    for k in rows:
        vals = [r[key].get(k) for r in results]
        if all(v is None or v < 0.05 for v in vals):
            continue
        print(f"{k:<22}" + "".join(f"{v:>{w}.1f}" if v is not None else f"{'-':>{w}}" for v in vals))
    tot = [sum(r[key].values()) for r in results]
    print(f"{'total':<22}" + "".join(f"{v:>{w}.1f}" for v in tot))


def side_by_side(pairs: list[tuple[str, list[dict], list[dict]]], ceiling: float) -> None:
    """samples/s (median step, best of the repeats) of this checkout and the base, and the
    ratio; then the trainer's CPU µs per sample of each."""
    print(f"\n{'config':<14}{'base':>10}{'this':>10}{'ratio':>8}{'% ceiling':>11}"
          f"{'  trainer CPU µs/sample (READ+ACK+COMPUTE) base -> this'}")
    for name, a, b in pairs:
        sa = max(r["samples_per_s_median"] for r in a)
        sb = max(r["samples_per_s_median"] for r in b)
        cpu = [statistics.median(sum(v for k, v in r["cpu_us"].items()
                                     if k.split(".")[1] in ("READ", "ACK", "COMPUTE")
                                     and k.startswith(r["trainer"] + ".")) for r in rs)
               for rs in (a, b)]
        print(f"{name:<14}{sa:>10.0f}{sb:>10.0f}{sb / sa:>7.2f}x{sb / ceiling:>10.0%}"
              f"  {cpu[0]:.1f} -> {cpu[1]:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="local-1,ray-1,ray-4",
                    help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=4096, help="prompts a step (x4 samples)")
    ap.add_argument("--train-us", type=float, default=50.0, help="trainer µs per sample")
    ap.add_argument("--micro-batch", default="1024",
                    help="the trainer's micro-batch, or a comma-separated sweep: 16,64,1024")
    ap.add_argument("--base", default=None,
                    help="another checkout (e.g. the commit before a change): run it too, side by side")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each (A/B alternating)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        micros = [int(x) for x in str(args.micro_batch).split(",")]
    except ValueError:
        ap.error("--micro-batch: integers, comma-separated")
    if args.train_us <= 0 or args.prompts < 1 or args.steps < 2 or min(micros) < 1 \
            or args.repeat < 1:
        ap.error("--train-us must be > 0, --prompts, --micro-batch and --repeat >= 1, "
                 "--steps >= 2")
    if args.base and not os.path.isdir(os.path.join(args.base, "asyncflow")):
        ap.error(f"--base: {args.base} is not a checkout of asyncflow")
    bad = [n for n in args.only.split(",") if n not in CONFIGS]
    if bad:
        ap.error(f"--only: unknown {', '.join(bad)} (choose from {', '.join(CONFIGS)})")
    ceiling = 1e6 / args.train_us
    results, pairs = [], []
    sides = [("base", args.base), ("this", None)] if args.base else [("this", None)]
    for name in args.only.split(","):
        backend, replicas = CONFIGS[name]
        for micro in micros:
            label = f"{name}/mb{micro}" if len(micros) > 1 or args.base else name
            got: dict = {side: [] for side, _ in sides}
            for rep in range(args.repeat):
                for side, checkout in (sides if rep % 2 == 0 else sides[::-1]):
                    r = run_one(name, backend, replicas, args, micro, checkout)
                    r["name"], r["side"], r["trainer"] = (
                        label if side == "this" else f"{label}@base"), side, "update"
                    got[side].append(r)
                    results.append(r)
                    print(f"{r['name']:<20} {r['samples_per_s_median']:>9.0f} samples/s (median "
                          f"step; mean {r['samples_per_s_mean']:.0f}), "
                          f"{r['samples_per_s_median'] / ceiling:.0%} of the {ceiling:.0f} "
                          f"ceiling; process {r['process_wall_s']:.1f} s", flush=True)
            if args.base:
                pairs.append((label, got["base"], got["this"]))
    shown = [r for r in results if r["side"] == "this"] if args.repeat > 1 else results
    table(shown, "cpu_us", "CPU µs per sample (worker loop threads, per task.op)")
    table(shown, "wall_us", "wall µs per sample (trace spans, waits included)")
    if pairs:
        side_by_side(pairs, ceiling)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
