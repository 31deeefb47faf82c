"""Recovery after faults, measured on the sim pipeline (``pipelines/sim_longtail.yaml`` shrunk).

1. SIGKILL (``ray.kill``) of one of 4 rollout workers on Ray when train step K starts: the
   seconds from the kill until the worker is restarted (a new actor, the newest weights), and
   until throughput is back (the first step that ends after the kill with a step time within
   25% of the median step time before it).
2. Death of the train worker with checkpoints every 2 steps: the seconds from the kill until the
   run, restarted in-process from the newest checkpoint, has its workers ready again, and until
   its first step after the restart is trained.

    .venv/bin/python benchmarks/recovery.py [--backend ray|local] [--steps 10]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from asyncflow.compiler.pipeline import compile_file  # noqa: E402
from asyncflow.runtime.driver import Driver  # noqa: E402

SETS = ("step.prompts_per_step=8", "step.samples_per_prompt=4",
        "tasks.generate.args.latency.median=0.01", "tasks.generate.args.latency.max=0.1",
        "tasks.update.args.seconds_per_sample=0.002")


def _plan(steps: int):
    return compile_file(os.path.join(os.path.dirname(__file__), "..", "pipelines", "sim_longtail.yaml"),
                        sets=SETS + (f"step.steps={steps}",), device_kind="cpu")


def rollout_kill(backend: str, steps: int, at: int) -> dict:
    d = Driver(_plan(steps), backend, max_restarts=3, lease_s=60.0,
               inject=[f"kill@step{at}:generate/1"])
    r = d.run()
    ev = {e["event"]: e for e in r.events}
    t_kill = ev["kill"]["t"]
    t0 = d.t0
    before = [m["step_time"] for m in r.metrics if t0 + m["time"] <= t_kill and m["step"] > 0]
    med = statistics.median(before) if before else None
    back = next((t0 + m["time"] for m in r.metrics
                 if t0 + m["time"] > t_kill and med and m["step_time"] <= 1.25 * med), None)
    return {"restarted_s": ev["restart"]["t"] - t_kill if "restart" in ev else None,
            "throughput_back_s": (back - t_kill) if back else None,
            "median_step_s": med, "steps": len(r.metrics)}


def trainer_kill(backend: str, steps: int, at: int) -> dict:
    out = tempfile.mkdtemp(prefix="af-recovery-")
    d = Driver(_plan(steps), backend, out_dir=out, checkpoint_every=2, max_restarts=3,
               inject=[f"kill@step{at}:update/0"])
    r = d.run()
    ev = {e["event"]: e for e in r.events}
    t_kill = ev["kill"]["t"]
    first = next((d.t0 + m["time"] for m in r.metrics if d.t0 + m["time"] > t_kill), None)
    return {"detected_s": ev["trainer_restart"]["t"] - t_kill,
            "ready_again_s": ev["resumed"]["t"] - t_kill,
            "first_step_after_s": (first - t_kill) if first else None,
            "resumed_from_step": ev["resumed"]["from_step"], "steps": len(r.metrics)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="ray")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    r = rollout_kill(a.backend, a.steps, 4)
    print(f"[{a.backend}] rollout worker killed at step 4 of {a.steps}: restarted after "
          f"{r['restarted_s']:.2f} s, throughput back after {r['throughput_back_s']:.2f} s "
          f"(median step {r['median_step_s']:.3f} s)")
    t = trainer_kill(a.backend, a.steps, 5)
    print(f"[{a.backend}] trainer killed at step 5 (checkpoints every 2): detected after "
          f"{t['detected_s']:.2f} s, workers ready again after {t['ready_again_s']:.2f} s, first "
          f"step trained after {t['first_step_after_s']:.2f} s (resumed from step "
          f"{t['resumed_from_step']})")


if __name__ == "__main__":
    main()
