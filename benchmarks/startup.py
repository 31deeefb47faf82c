"""Start-up of ``asyncflow run`` on Ray, phase by phase: until every worker is ready.

Each run is ``asyncflow run FILE --steps 1`` in a fresh process; the phases are the run's own
(``trace.json`` ``otherData.startup_s``, also printed under the run summary):

- ``imports and compile``: from the first import of asyncflow to the driver (CLI, compile, data);
- ``backend``: a local Ray of our own comes up (``ray.init``);
- ``store and control``: the sample-store and control actors;
- ``workers placed``: placement groups, one actor per worker;
- ``workers ready``: every worker's process started, its engine built, its first sync done.

Configurations run interleaved (A B A B ...) so a noisy machine slows both alike; ``lean`` is the
default, ``full`` sets ``ASYNCFLOW_RAY_FULL=1`` (Ray starts its dashboard head and autoscaler
monitor as it would by itself).

    .venv/bin/python benchmarks/startup.py [--pipelines grpo_digits,sim_longtail] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_once(pipeline: str, env_extra: dict) -> dict:
    out = tempfile.mkdtemp(prefix="af-startup-")
    exe = os.path.join(os.path.dirname(sys.executable), "asyncflow")
    path = os.path.join(ROOT, "pipelines", f"{pipeline}.yaml")
    t0 = time.time()
    p = subprocess.run([exe, "run", path, "--steps", "1", "--quiet", "--force", "--out", out],
                       capture_output=True, text=True, env={**os.environ, **env_extra})
    wall = time.time() - t0
    if p.returncode != 0:
        raise SystemExit(f"{pipeline}: run failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    phases = json.load(open(os.path.join(out, "trace.json")))["otherData"]["startup_s"]
    return {"phases": phases, "process_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipelines", default="grpo_digits,sim_longtail")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--configs", default="lean,full")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    envs = {"lean": {}, "full": {"ASYNCFLOW_RAY_FULL": "1"}}
    configs = args.configs.split(",")
    results: dict = {}
    for pipeline in args.pipelines.split(","):
        for _ in range(args.repeat):
            for c in configs:
                r = run_once(pipeline, envs[c])
                results.setdefault((pipeline, c), []).append(r)
                print(f"{pipeline:<14} {c:<5} " + " · ".join(
                    f"{k} {v:.2f}" for k, v in r["phases"].items()), flush=True)
    print("\nmedian seconds per phase (Ray up and every worker ready = all but the first)")
    for pipeline in args.pipelines.split(","):
        names = list(results[(pipeline, configs[0])][0]["phases"])
        print(f"\n{pipeline}")
        print(f"{'phase':<22}" + "".join(f"{c:>10}" for c in configs))
        for k in names + ["ray up to ready", "whole start-up", "process (1 step)"]:
            vals = []
            for c in configs:
                rs = results[(pipeline, c)]
                if k == "ray up to ready":
                    xs = [sum(v for n, v in r["phases"].items() if n != names[0]) for r in rs]
                elif k == "whole start-up":
                    xs = [sum(r["phases"].values()) for r in rs]
                elif k == "process (1 step)":
                    xs = [r["process_s"] for r in rs]
                else:
                    xs = [r["phases"][k] for r in rs]
                vals.append(statistics.median(xs))
            print(f"{k:<22}" + "".join(f"{v:>10.2f}" for v in vals))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{p}/{c}": v for (p, c), v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
