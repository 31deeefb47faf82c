"""``asyncflow simulate --calibrate RUN_DIR`` (asyncflow.simulate.calibrate): the costs fitted to a
real run's trace.json and metrics.jsonl make the simulation of that run take the step time it
measured; a run of another pipeline, or without a trace, is a coded error."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from asyncflow.compiler import compile_file
from asyncflow.errors import AsyncflowError, UserError
from asyncflow.plan import Plan
from asyncflow.simulate import simulate
from asyncflow.simulate.calibrate import Calibration, TaskFit, calibrate, fit, typical_step_s
from asyncflow.simulate.costs import device

from shared_runs import SHRINK, cli, shipped_run

ROOT = Path(__file__).resolve().parents[1]
LONGTAIL = str(ROOT / "pipelines" / "sim_longtail.yaml")
SETS = [v for v in SHRINK["sim_longtail"] if v != "--set"]  # the shared run's settings


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return shipped_run(tmp_path_factory, "sim_longtail.yaml", "local").ok()


def test_calibrated_simulation_takes_the_measured_step_time(run):
    """The shared run's latencies are shrunk to milliseconds: the runtime's own costs dominate
    its steps, which the uncalibrated simulation leaves out (far too fast); calibrated, the
    simulation of the run's plan takes its steady step time."""
    plan = compile_file(LONGTAIL, sets=SETS)
    c = calibrate(plan, run.out)
    assert set(c.tasks) == {t.name for t in plan.tasks}
    assert c.measured_step_s > 0 and c.step_s >= 0
    with open(os.path.join(run.out, "plan.json")) as f:
        run_plan = Plan.from_json(f.read())
    raw = typical_step_s(list(simulate(run_plan).step_ends))
    fitted = typical_step_s(list(simulate(run_plan, calibration=c).step_ends))
    assert abs(fitted - c.measured_step_s) <= 0.05 * c.measured_step_s
    assert abs(fitted - c.measured_step_s) < abs(raw - c.measured_step_s)


def test_a_fit_replaces_a_call_cost_and_scales_data_parallel_rows():
    # unstreamed: a streamed sim trainer keeps its hints (the test below)
    plan = compile_file(LONGTAIL, sets=["tasks.update.devices_per_replica=2",
                                        "pools.train.devices=2", "tasks.update.stream=false"])
    update = plan.task("update")
    c = Calibration("run", plan.pipeline,
                    tasks={"update": TaskFit(10, 0.01, 0.004, devices=1, write_s=0.0)})
    d = device(plan, update, c)
    assert d.engine is None and d.scale == 1.0
    assert d.call(10) == pytest.approx(0.01 + 10 * 0.002)  # half a row's time on 2 devices
    gen = plan.task("generate")  # a sim rollout keeps its per-sample draws
    assert device(plan, gen, c).latency_of(3) == device(plan, gen).latency_of(3)


def test_cli_calibrate_and_its_errors(run, capsys, tmp_path):
    rc, out = cli(capsys, "simulate", LONGTAIL, *[a for s in SETS for a in ("--set", s)],
                  "--steps", "3", "--calibrate", run.out)
    assert rc == 0 and f"calibrated from {run.out}" in out
    rc, out = cli(capsys, "simulate", LONGTAIL, "--calibrate", run.out, "--sweep",
                  "split=auto", "--steps", "3")
    assert rc == 0 and "best split" in out
    no_trace = tmp_path / "no_trace"
    no_trace.mkdir()
    shutil.copy(os.path.join(run.out, "plan.json"), no_trace)
    rc, out = cli(capsys, "simulate", LONGTAIL, "--calibrate", str(no_trace))
    assert rc != 0 and "AF643" in out and "no trace.json" in out
    rc, out = cli(capsys, "simulate", str(ROOT / "benchmarks" / "papers" / "roll_flash.yaml"),
                  "--calibrate", run.out)
    assert rc != 0 and "AF644" in out and "plan.json:1:1" in out
    with pytest.raises(AsyncflowError) as e:  # through the API: coded, in the hierarchy
        fit(compile_file(LONGTAIL), str(tmp_path / "missing"))
    assert getattr(e.value, "code", None) == "AF643"
    assert not isinstance(e.value, UserError)  # the command locates it (AF643 above)


def test_a_run_with_held_out_evaluations_calibrates_as_without(run, tmp_path):
    """An eval's rows in metrics.jsonl (``eval/...``, no step time) are not train steps: the
    fit of a run that has them is the fit of its steps (it was an internal KeyError)."""
    plan = compile_file(LONGTAIL, sets=SETS)
    copy = tmp_path / "with_eval"
    shutil.copytree(run.out, copy)
    rows = (copy / "metrics.jsonl").read_text().splitlines()
    ev = '{"step": %d, "eval/points": 0.5, "eval/n": 8, "eval/version": %d, "eval/seconds": 0.01}'
    (copy / "metrics.jsonl").write_text("\n".join(
        x for i, r in enumerate(rows) for x in (ev % (i, i), r)) + "\n")
    a, b = fit(plan, run.out), fit(plan, str(copy))
    assert (b.steps, b.measured_step_s, b.tasks) == (a.steps, a.measured_step_s, a.tasks)


def test_a_streamed_trainer_whose_hints_model_its_device_keeps_them(run):
    """A streamed train call's COMPUTE span ends once its micro-batch is queued on the device,
    so a line fitted to those spans undercharges it (3.3 ms a row for a 5 ms sim trainer on
    Ray): a streamed trainer with a modelled time a row keeps its hints; unstreamed, the fit
    replaces them as for any task."""
    from dataclasses import replace

    plan = compile_file(LONGTAIL, sets=SETS)
    task = next(t for t in plan.tasks if t.name == "update")
    assert task.stream
    c = fit(plan, run.out)
    d = device(plan, task)
    assert d.seconds_per_sample > 0
    assert c.apply(task, d) == d
    fitted = c.apply(replace(task, stream=False), d)
    assert fitted.seconds_per_sample == pytest.approx(c.tasks["update"].per_row_s)
    assert fitted.seconds_per_call == pytest.approx(c.tasks["update"].per_call_s)
    assert typical_step_s([0.0, 0.8, 1.47, 2.14, 2.81, 3.48]) == pytest.approx(0.696)
    assert typical_step_s([5.0]) == 0.0
