"""How ``asyncflow simulate --calibrate`` reads a run's step time, compared on the same runs.

    python benchmarks/simulate_fidelity.py --backend ray --json F.json --keep-calibration DIR
    python benchmarks/calibration_fit.py F.json DIR [--step default,mean,median,trim]

``simulate_fidelity.py`` keeps each configuration's short calibration run in ``DIR``; this
script fits the calibration again from those very runs, once per way of reading the run's
typical step (both the real run's step ends and the simulation's, when the end-of-step time is
fitted), simulates the 20-step plan with each, and prints sim / real against the real runs
recorded in ``F.json`` -- so the ways are compared side by side on the same real runs, with no
new run's noise between them. Ways:

- ``default``: the package's (:func:`asyncflow.simulate.calibrate.typical_step_s`: the mean of
  every gap);
- ``drop1``: the mean of the gaps after the first (a short run's first steady step carries its
  start-up);
- ``median``: the median gap;
- ``trim``: the mean without the longest gap.

``--floor on,off``: with and without :func:`asyncflow.simulate.calibrate.keeps_hints` (a
streamed trainer whose hints model its device keeps them instead of the line fitted to its
COMPUTE spans).

Figures in benchmarks/README.md ("simulate_fidelity").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gaps(ends):
    return [b - a for a, b in zip(ends, ends[1:])]


def _mean(ends):
    g = _gaps(ends)
    return sum(g) / len(g) if g else 0.0


def _drop1(ends):
    g = _gaps(ends)
    if len(g) >= 3:
        g = g[1:]
    return sum(g) / len(g) if g else 0.0


def _median(ends):
    g = _gaps(ends)
    return statistics.median(g) if g else 0.0


def _trim(ends):
    g = _gaps(ends)
    if len(g) >= 3:
        g.remove(max(g))
    return sum(g) / len(g) if g else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="simulate_fidelity.py --json")
    ap.add_argument("keep", help="simulate_fidelity.py --keep-calibration DIR")
    ap.add_argument("--step", default="default,drop1,median,trim")
    ap.add_argument("--floor", default="on",
                    help="on, off or on,off: a streamed trainer with hints keeps them "
                         "(calibrate.keeps_hints) or takes the line fitted to its spans")
    a = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    from asyncflow.compiler.pipeline import compile_file
    from asyncflow.simulate import calibrate as cal
    from asyncflow.simulate import simulate
    from simulate_fidelity import keep_dir  # beside this script: where it kept each run

    ways = {"default": cal.typical_step_s, "mean": _mean, "drop1": _drop1, "median": _median,
            "trim": _trim}
    floors = {"on": cal.keeps_hints, "off": lambda task, d: False}
    steps_chosen = [w for w in a.step.split(",") if w]
    floors_chosen = [f for f in a.floor.split(",") if f]
    unknown = [w for w in steps_chosen if w not in ways] + [
        f for f in floors_chosen if f not in floors]
    if unknown:
        ap.error(f"unknown --step/--floor {', '.join(unknown)} (known: {', '.join(ways)}; on, off)")
    # (label, way of reading the step, floor) for each fit compared
    fits = [(f"{w}/{f}" if len(floors_chosen) > 1 else w, w, f)
            for w in steps_chosen for f in floors_chosen]
    with open(a.results) as f:
        rows = json.load(f)
    ratios: dict[str, list[float]] = {label: [] for label, _, _ in fits}
    print(f"{'config':<28} {'real':>7}" + "".join(f" {label:>12}" for label in ratios))
    for r in rows:
        run_dir = keep_dir(a.keep, r["config"])
        steps = r["real"]["steps"]
        plan = compile_file(os.path.join(ROOT, r["file"]), sets=r["sets"] + [f"step.steps={steps}"])
        line = f"{r['config']:<28} {r['real']['steady']:>7.1f}"
        for label, w, fl in fits:
            saved = cal.typical_step_s, cal.keeps_hints
            cal.typical_step_s, cal.keeps_hints = ways[w], floors[fl]
            try:
                c = cal.calibrate(plan, run_dir)
                ratio = simulate(plan, calibration=c).samples_per_s / r["real"]["steady"]
            except cal.CalibrationError as e:  # not this invocation's kept runs
                raise SystemExit(f"calibration_fit.py: {e}") from None
            finally:
                cal.typical_step_s, cal.keeps_hints = saved
            ratios[label].append(ratio)
            line += f" {ratio:>12.3f}"
        print(line, flush=True)
    for label, v in ratios.items():
        print(f"{label:<14} within 5%: {sum(abs(x - 1) <= 0.05 for x in v)}/{len(v)}, within 2.5%: "
              f"{sum(abs(x - 1) <= 0.025 for x in v)}/{len(v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
