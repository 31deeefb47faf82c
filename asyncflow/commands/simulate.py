"""``asyncflow simulate FILE``: the compiled plan executed in virtual time (README, "Simulate").

Prints throughput, step time, per-pool utilization and bubbles; ``--json`` one object (at least
``samples_per_s``, ``step_time_s``, ``devices``, ``wall_s``); ``--sweep KEY=v1,v2,...`` one
simulation per value (``split=R:T,...`` or ``split=auto``: the rollout:train device split, the
resource planner) and ``-o F.png`` its plot (without ``--sweep``: throughput per step);
``--link`` what weight syncs cross (:mod:`asyncflow.simulate.links`), ``--calibrate RUN_DIR`` the
costs fitted to a real run (:mod:`asyncflow.simulate.calibrate`; AF643, AF644).
"""
from __future__ import annotations

import json
import time
from typing import List, Optional

import typer

from asyncflow.compiler.kinds import rules_of
from asyncflow.console import SetOpt, err, out, usage_error


def _fmt_s(x: float) -> str:
    if x < 1:
        return f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s"


def _located(plan, code: str, at=None, **fmt):
    from asyncflow.diagnostics import error
    from asyncflow.loc import SourceLoc, Sources

    loc = SourceLoc.parse(at.loc) if at is not None and at.loc else None
    if loc is None and plan.source_file:
        loc = SourceLoc(plan.source_file, 1, 1)
    sources = Sources()
    if loc is not None and loc.file and not loc.file.startswith("<"):
        try:
            sources.add_file(loc.file)
        except OSError:
            pass
    return error(code, loc, sources=sources, **fmt)


def _check_costs(plan) -> None:
    """AF640: no task costs anything (every step would take 0 s)."""
    from asyncflow.simulate.core import has_costs

    if has_costs(plan):
        return
    roll = next((t for t in plan.tasks if rules_of(t.kind).samples), plan.tasks[0] if plan.tasks
                else None)
    raise _located(plan, "AF640", roll, pipeline=plan.pipeline,
                   task=roll.name if roll else "?")


def run_one(plan, steps: Optional[int], link=None, calibration=None):
    """Simulate ``plan`` (weight syncs over ``link``; with the costs of ``calibration``);
    AF641 when it stops before its last step."""
    return run_all([plan], steps, link, calibration, jobs=1)[0]


def run_all(plans: list, steps: Optional[int], link=None, calibration=None, jobs: int = 1):
    """:func:`run_one` of each plan, ``jobs`` simulations at once (each in a process of its
    own: :mod:`asyncflow.simulate.parallel`); AF640 for any plan before the first starts."""
    from asyncflow.simulate.parallel import simulate_all

    if calibration is None:
        for plan in plans:
            _check_costs(plan)
    ns = [steps if steps is not None else plan.step.steps for plan in plans]
    results = simulate_all([(plan, {"steps": steps, "link": link, "calibration": calibration,
                                    "max_events": 200 * max(1, n) * max(
                                        1, plan.step.samples_per_step) + 1_000_000})
                            for plan, n in zip(plans, ns)], jobs)
    for plan, n, r in zip(plans, ns, results):
        if r.stalled:
            raise _located(plan, "AF641", None, done=len(r.step_ends), steps=n, why=r.stalled)
    return results


def _summary(r, plan, file: str, link=None, calibration=None) -> None:
    from rich.table import Table

    d = r.to_dict()
    out.print(f"{plan.pipeline} ({file}): simulated {d['steps']} steps of "
              f"{plan.step.samples_per_step} samples in {d['wall_s']:.2f} s "
              f"({d['events']:,} events, {d['events_per_s']:,.0f}/s); virtual time "
              f"{_fmt_s(d['virtual_s'])}", markup=False)
    t = Table(title="throughput (virtual time)", title_justify="left")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_row("samples/s, steady state (after step 0)", f"{d['samples_per_s']:.1f}")
    t.add_row("samples/s, whole run", f"{d['samples_per_s_whole']:.1f}")
    t.add_row("step time", _fmt_s(d["step_time_s"]))
    t.add_row("devices", str(d["devices"]))
    t.add_row("staleness max / mean", f"{d['staleness_max']} / {d['staleness_mean']:.2f}")
    if d["drops"]:
        t.add_row("dropped", ", ".join(f"{k} {v}" for k, v in sorted(d["drops"].items())))
    if d["cancelled"]:
        t.add_row("cancelled in flight", str(d["cancelled"]))
    if d["aborted"]:
        t.add_row("restarted by new weights (abort)", str(d["aborted"]))
    out.print(t)
    if d["pools"]:
        p = Table(title="pools", title_justify="left")
        for col in ("pool", "devices", "utilization", "bubble"):
            p.add_column(col, justify="right" if col != "pool" else "left")
        for name, v in d["pools"].items():
            p.add_row(name, str(v["devices"]), f"{v['utilization']:.0%}", f"{v['bubble']:.0%}")
        out.print(p)
    tk = Table(title="tasks", title_justify="left")
    for col in ("task", "replicas", "device busy per step", "utilization"):
        tk.add_column(col, justify="right" if col != "task" else "left")
    n = max(1, d["steps"])
    for name, v in d["tasks"].items():
        tk.add_row(name, str(v["replicas"]), _fmt_s(v["busy_s"] / n / max(1, v["replicas"])),
                   f"{v['utilization']:.0%}")
    out.print(tk)
    _sync_lines(plan, link)
    if calibration is not None:
        out.print(f"calibrated from {calibration.describe()}", markup=False)
    out.print("note: virtual time from the cost hints; user functions are not run (a filter keeps "
              "every group)" + ("" if calibration is not None else
                                 "; the runtime's own overheads are not modelled "
                                 "(--calibrate RUN_DIR fits them)"),
              style="dim", markup=False)


def _sync_lines(plan, link) -> None:
    """What each weight sync moves and costs (asyncflow.simulate.transfer)."""
    from asyncflow.simulate.transfer import SyncCosts

    sc = SyncCosts(plan, link)
    for s in plan.sync:
        b = sc.edges[(s.src, s.dst)][1]
        if not b:
            out.print(f"weight sync {s.src} -> {s.dst} ({s.via}): the size of model "
                      f"'{s.model}' is unknown, no transfer charged (models.{s.model}.params)",
                      style="dim", markup=False)
            continue
        pub = SyncCosts(plan, link).publish_s(s.src, s.model)
        adopt = SyncCosts(plan, link).adopt_s(s.dst, 0.0)
        out.print(f"weight sync {s.src} -> {s.dst} ({s.via}): {b / 1e9:.2f} GB a sync over "
                  f"{sc.link.describe()}: the trainer blocked {_fmt_s(pub)} a publish, a "
                  f"replica {_fmt_s(adopt)} an adoption (the first; "
                  + ("later ones queue at the trainer)" if s.via == "collective"
                     else "copies spread by doubling)"), markup=False)


def _plot_steps(r, path: str, plan) -> None:
    from asyncflow.viz.chart import line_chart

    ends = r.step_ends
    xs = list(range(len(ends)))
    ys = [s / (e - b) if e > b else None
          for s, b, e in zip(r.samples, [0.0] + ends[:-1], ends)]
    c = line_chart([{"label": "simulated", "xs": xs, "ys": ys}],
                   title=f"{plan.pipeline}: simulated throughput per step",
                   subtitle=f"steady state {r.samples_per_s:.1f} samples/s; step time "
                            f"{_fmt_s(r.step_time_s)}",
                   xlabel="train step", ylabel="samples / s")
    c.save(path)


def register(app: typer.Typer) -> None:
    @app.command("simulate")
    def simulate_(file: str = typer.Argument(..., help="pipeline file (.yaml, .yml, .af)"),
                  set_: Optional[List[str]] = SetOpt,
                  steps: Optional[int] = typer.Option(None, "--steps", help="train steps to "
                                                      "simulate (default: the file's)"),
                  json_: bool = typer.Option(False, "--json", help="print one JSON object"),
                  sweep: Optional[str] = typer.Option(
                      None, "--sweep", metavar="KEY=v1,v2,...",
                      help="one simulation per value of a --set key; split=R:T,... or "
                           "split=auto: the rollout:train device split (resource planner)"),
                  output: Optional[str] = typer.Option(
                      None, "-o", "--output", help="plot to this .png/.svg/.html: the sweep's "
                      "series, or throughput per step"),
                  link: Optional[str] = typer.Option(
                      None, "--link", metavar="NAME|GBPS[:LATENCY_US]",
                      help="what weight syncs cross: pcie, nvlink, infiniband, ethernet (the "
                           "default) or a bandwidth in GB/s (docs/weight-sync.md)"),
                  calibrate: Optional[str] = typer.Option(
                      None, "--calibrate", metavar="RUN_DIR",
                      help="fit the device times and the runtime's per-call and per-row costs "
                           "to a real run of this pipeline (its trace.json), then simulate"),
                  jobs: Optional[int] = typer.Option(
                      None, "--jobs", "-j", metavar="N",
                      help="--sweep: simulations run at once, each in a process of its own "
                           "(default: one per CPU, at most one per value; 1: one after the "
                           "other in this process). The results are the same either way")
                  ) -> None:
        """Execute the compiled plan in virtual time (device times from the cost hints): the
        runtime's own scheduling code, 1,024 devices in seconds."""
        from asyncflow.compiler import compile_file

        if steps is not None and steps < 1:
            usage_error("--steps must be >= 1")
        if output and not output.lower().endswith((".png", ".svg", ".html", ".htm")):
            usage_error("-o must name a .png, .svg or .html file")
        if jobs is not None and jobs < 1:
            usage_error("--jobs must be >= 1")
        if jobs is not None and sweep is None:
            usage_error("--jobs runs the simulations of a --sweep at once: give --sweep too")
        from asyncflow.simulate.links import LinkError, link as link_of

        try:
            link_ = link_of(link)
        except LinkError as e:
            usage_error(str(e))
        sets = list(set_ or ())
        calib = None
        if calibrate is not None:
            calib = calibration_of(file, sets, calibrate)
        if sweep is None:
            plan = compile_file(file, sets)
            r = run_one(plan, steps, link_, calib)
            if output:
                _plot_steps(r, output, plan)
            if json_:
                out.print(json.dumps(r.to_dict()), markup=False, soft_wrap=True)
            else:
                _summary(r, plan, file, link_, calib)
            if output:
                (err if json_ else out).print(f"wrote {output}", markup=False)
            return
        _sweep(file, sets, sweep, steps, json_, output, link_, calib, jobs)


def calibration_of(file: str, sets: list[str], run_dir: str):
    """The costs fitted to the run in ``run_dir`` (AF643/AF644 when it has none to give)."""
    import os

    from asyncflow.compiler import compile_file
    from asyncflow.diagnostics import error
    from asyncflow.loc import SourceLoc
    from asyncflow.simulate.calibrate import CalibrationError, calibrate

    plan = compile_file(file, sets)
    try:
        return calibrate(plan, run_dir)
    except CalibrationError as e:  # located at the run's file it concerns, else the pipeline
        loc = SourceLoc(e.path, 1, 1) if os.path.isfile(e.path) else (
            SourceLoc(plan.source_file, 1, 1) if plan.source_file else None)
        raise error(e.code, loc, **e.fmt) from None


def _sweep(file: str, sets: list[str], spec: str, steps, json_: bool, output, link=None,
           calib=None, jobs: Optional[int] = None) -> None:
    from asyncflow.compiler import compile_file
    from asyncflow.diagnostics import error
    from asyncflow.simulate import sweep as sw

    try:
        key, values = sw.parse(spec)
        base = compile_file(file, sets)
        split = None
        if key == sw.SPLIT:
            split = sw.split_of(base, spec)
            if values == ["auto"]:
                values = split.auto()
            runs_sets = [split.sets(v, spec) for v in values]
        else:
            runs_sets = [[f"{key}={v}"] for v in values]
    except sw.SweepError as e:
        raise error("AF642", None, what=str(e)) from None
    t0 = time.perf_counter()
    plans = [compile_file(file, sets + extra) for extra in runs_sets]
    if jobs is None:
        from asyncflow.simulate.parallel import default_jobs

        jobs = default_jobs(len(plans))
    jobs = max(1, min(jobs, len(plans)))
    runs = list(zip(values, plans, run_all(plans, steps, link, calib, jobs)))
    wall = time.perf_counter() - t0
    best_i = max(range(len(runs)), key=lambda i: runs[i][2].samples_per_s)
    own = None
    if split is not None:
        own = f"{split.rollout_devices}:{split.train_devices}"
    ref = next((r for v, _, r in runs if v == own), runs[0][2])
    if json_:
        best = runs[best_i][2].to_dict()
        obj = {"sweep": key, "values": values, "best": values[best_i],
               **{k: best[k] for k in ("samples_per_s", "step_time_s", "devices")},
               "wall_s": wall, "jobs": jobs,
               "runs": [{"value": v, **{k: x for k, x in r.to_dict().items()
                                      if k != "step_ends_s"}} for v, _, r in runs]}
        if split is not None:
            obj["budget"] = split.budget
            obj["file_split"] = own
        out.print(json.dumps(obj), markup=False, soft_wrap=True)
    else:
        from rich.table import Table

        what = (f"rollout:train split of {split.budget} devices ({split.rollout} on pool "
                f"'{split.rollout_pool}', {split.train} on '{split.train_pool}')"
                if split is not None else key)
        out.print(f"{base.pipeline} ({file}): sweep over {what}: {len(runs)} simulations in "
                  f"{wall:.2f} s" + (f", {jobs} at once" if jobs > 1 else ""), markup=False)
        t = Table(title="sweep (virtual time)", title_justify="left")
        pools = [p.name for p in base.pools]
        cols = [key, "samples/s", "step time", "vs " + ("the file's split" if own and any(
            v == own for v, _, _ in runs) else "first"), "staleness max"]
        cols += [f"{p} util" for p in pools]
        for c in cols:
            t.add_column(c, justify="left" if c == key else "right")
        for i, (v, plan, r) in enumerate(runs):
            d = r.to_dict()
            row = [v + ("  <- best" if i == best_i else ""), f"{r.samples_per_s:.1f}",
                   _fmt_s(r.step_time_s),
                   f"{r.samples_per_s / ref.samples_per_s:.2f}x" if ref.samples_per_s else "-",
                   str(d["staleness_max"])]
            row += [f"{d['pools'][p]['utilization']:.0%}" if p in d["pools"] else "-"
                    for p in pools]
            t.add_row(*row)
        out.print(t)
        bv, _, br = runs[best_i]
        if split is not None:
            r_, t_ = bv.split(":")
            out.print(f"best split: {r_} rollout devices, {t_} train devices: "
                      f"{br.samples_per_s:.1f} samples/s"
                      + (f", {br.samples_per_s / ref.samples_per_s:.2f}x the file's {own}"
                         if own and ref.samples_per_s else ""), markup=False)
            out.print("note: a train call's rows are split over the trainer's devices (data "
                      "parallel, no communication cost modelled)", style="dim", markup=False)
        else:
            out.print(f"best: {key}={bv}: {br.samples_per_s:.1f} samples/s", markup=False)
    if output:
        from asyncflow.viz.chart import line_chart

        numeric = all(_is_num(v) for v, _, _ in runs)
        xs = [float(v) for v, _, _ in runs] if numeric else list(range(len(runs)))
        c = line_chart([{"label": "steady state", "xs": xs,
                         "ys": [r.samples_per_s for _, _, r in runs]},
                        {"label": "whole run", "xs": xs, "dash": True,
                         "ys": [r.samples_per_s_whole for _, _, r in runs]}],
                       title=f"{base.pipeline}: simulated throughput over {key}",
                       subtitle=f"best {key}={runs[best_i][0]}: "
                                f"{runs[best_i][2].samples_per_s:.1f} samples/s",
                       xlabel=key + (" (rollout:train devices)" if split else ""),
                       ylabel="samples / s",
                       x_labels=None if numeric else [v for v, _, _ in runs])
        c.save(output)
        (err if json_ else out).print(f"wrote {output}", markup=False)


def _is_num(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False
