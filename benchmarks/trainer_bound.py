"""The trainer at its bound (issue 24 item 6): how busy a trainer-bound pipeline keeps its
trainer, and where the rest of a step goes, side by side with another checkout.

The pipeline (default ``pipelines/sim_longtail.yaml`` at its staleness 2) trains 128 samples a
step at 5 ms a sample: 0.64 s of compute a step, a bound of 200 samples/s; its rollouts have
about 4x spare capacity. Each run is ``asyncflow run FILE --out DIR --force [--backend B]``;
from its ``metrics.jsonl`` and ``trace.json``, over the steady state (steps 2..N):

- cycle: the median time between two step ends; busy: the step's compute over the cycle;
- samples/s from the end of step 1 to the last;
- the trainer's gaps, medians in ms: ``publish`` (its PUBLISH span), ``after`` (from the
  publish's end to the next step's first READ: the ack, the report, the loop's sync) and
  ``first read`` (that READ's span: the store's answer with rows that were ready).

``--baseline DIR`` runs the same pipeline with ``PYTHONPATH=DIR`` (another checkout) too,
alternating with this one, ``--repeat`` times each.

    .venv/bin/python benchmarks/trainer_bound.py --backend ray --repeat 2 --baseline /tmp/base
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(file: str, backend: str, sets: list[str], pythonpath: str | None, compute_s: float):
    with tempfile.TemporaryDirectory(prefix="tb-") as out:
        return _run(out, file, backend, sets, pythonpath, compute_s)


def _run(out: str, file: str, backend: str, sets: list[str], pythonpath: str | None,
         compute_s: float) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-c", "from asyncflow.cli import main; main()", "run", file,
           "--out", out, "--force", "--backend", backend] + [a for s in sets for a in ("--set", s)]
    # `python -c` puts the working directory ahead of PYTHONPATH: a baseline run starts in its
    # own checkout, or it would import this one's asyncflow (as it did before this was fixed)
    p = subprocess.run(cmd, env=env, cwd=pythonpath or None, capture_output=True, text=True,
                       timeout=900)
    if p.returncode:
        raise SystemExit(f"run failed ({p.returncode}): {p.stdout[-2000:]}{p.stderr[-2000:]}")
    ms = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines() if x.strip()]
    ends = [m["time"] for m in ms]
    cycles = [b - a for a, b in zip(ends[1:], ends[2:])]
    cycle = statistics.median(cycles)
    sps = sum(m["samples"] for m in ms[2:]) / (ends[-1] - ends[1])
    ev = json.loads(Path(out, "trace.json").read_text())["traceEvents"]
    tid = next(e["tid"] for e in ev if e.get("name") == "PUBLISH")  # the trainer's replica 0
    tr = [e for e in ev if e.get("ph") == "X" and e.get("tid") == tid]
    pubs = {e["args"]["step"]: e for e in tr if e["name"] == "PUBLISH"}
    first = {}
    for e in tr:
        s = (e.get("args") or {}).get("step")
        if e["name"] == "READ" and s is not None and s not in first:
            first[s] = e
    pub_ms = [pubs[s]["dur"] / 1e3 for s in pubs if s >= 2]
    after = [(first[s + 1]["ts"] - (pubs[s]["ts"] + pubs[s]["dur"])) / 1e3
             for s in pubs if s >= 2 and s + 1 in first]
    read_ms = [first[s]["dur"] / 1e3 for s in first if s >= 3]
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    return {"cycle_ms": cycle * 1e3, "busy": compute_s / cycle, "samples_per_s": sps,
            "publish_ms": med(pub_ms), "after_ms": med(after), "first_read_ms": med(read_ms)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", default=str(ROOT / "pipelines" / "sim_longtail.yaml"))
    ap.add_argument("--backend", default="ray", choices=["ray", "local"])
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--baseline", default=None, help="another checkout, run alternately")
    ap.add_argument("--compute-s", type=float, default=0.64, help="a step's compute (s)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    builds = [("this", None)] + ([("baseline", args.baseline)] if args.baseline else [])
    rows = []
    print(f"{'build':<9} {'cycle ms':>9} {'busy':>7} {'samples/s':>10} {'publish':>8} "
          f"{'after':>7} {'1st read':>9}")
    for i in range(args.repeat):
        for name, path in builds:
            r = {"build": name, "run": i, **run(args.file, args.backend, args.sets, path,
                                                  args.compute_s)}
            rows.append(r)
            print(f"{name:<9} {r['cycle_ms']:>9.1f} {r['busy']:>7.1%} {r['samples_per_s']:>10.1f} "
                  f"{r['publish_ms']:>8.1f} {r['after_ms']:>7.1f} {r['first_read_ms']:>9.1f}",
                  flush=True)
    if args.baseline:
        a = [r["samples_per_s"] for r in rows if r["build"] == "this"]
        b = [r["samples_per_s"] for r in rows if r["build"] == "baseline"]
        print(f"samples/s this/baseline: {statistics.median(a) / statistics.median(b):.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
