"""A simulation calibrated from a real run (``asyncflow simulate FILE --calibrate RUN_DIR``;
README, "Simulate").

From the run's ``trace.json`` (one span per op of every worker) and ``metrics.jsonl``:

- **device time per call**, per task: its COMPUTE spans fitted to ``per_call_s + rows *
  per_row_s`` (least squares, both >= 0; a task whose calls all had the same rows gets the
  mean as per-row time). That is what a call cost in that run, the engine's own overhead
  included; it replaces the task's cost hints, except for a rollout whose hints model each
  sample (a sim engine, a ``cost: latency``): a sample's draw is kept, and a rollout without
  hints gets a lognormal fitted to its calls' durations. A data-parallel kind's per-row time
  is scaled by the devices per replica of the run over the plan's (``--sweep split=auto``).
  A streamed trainer whose hints give it a time a row (a sim engine) keeps its hints too: its
  COMPUTE span ends once its micro-batch is queued on the device, not when the device is done.
- **the runtime's per-call costs**: a WRITE of a scorer or function (the median of its spans:
  the write to the store) is added to the task's per-call time (a READ span cannot tell the
  read's cost from its wait for rows: reads are left to the rest of a step, below); a PUBLISH (its
  median) blocks the trainer; an ADOPT beyond what the hints already charge
  (``sync_seconds``) blocks the replica; with ``sync_bytes`` in the metrics, the ADOPT's time
  per byte too.
  A run with ``delta: true`` edges also gives the share of the model's bytes an adoption
  received (``delta_fraction``): the simulator charges its delta edges that share.
- **the rest of a step** (acks, the report, the driver's polls, Ray's call latency): one number of
  seconds a trainer is blocked at the end of each step, fitted so that the simulation of the
  run's own plan (``RUN_DIR/plan.json``) takes the steady step time the run measured.

The run must be of the same pipeline (its name and tasks); it should be a short run separate
from the one the calibration is compared with (``benchmarks/simulate_fidelity.py``).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field, replace

from asyncflow.compiler.kinds import rules_of
from asyncflow.costmodel import Distribution
from asyncflow.errors import AsyncflowError
from asyncflow.plan import Plan, TaskPlan
from asyncflow.viz.metrics import is_eval


class CalibrationError(AsyncflowError):
    """A run directory that cannot calibrate this plan: ``code`` (AF643 / AF644), the file it
    concerns, and the message's fields (``asyncflow simulate`` reports it located)."""

    def __init__(self, code: str, path: str, **fmt):
        super().__init__(f"{path}: {code} --calibrate {fmt.get('run_dir')}: {fmt.get('what')}")
        self.code, self.path, self.fmt = code, path, fmt


@dataclass
class TaskFit:
    """What one task's calls cost in the run (module docstring)."""

    calls: int
    per_call_s: float
    per_row_s: float
    devices: int = 1  # devices per replica in the run
    write_s: float = 0.0
    latency: dict | None = None  # a rollout without hints: a lognormal spec of its calls


@dataclass
class Calibration:
    """The costs fitted to ``run_dir`` (module docstring); :meth:`apply` is what the
    simulator's :func:`asyncflow.simulate.costs.device` asks."""

    run_dir: str
    pipeline: str
    tasks: dict[str, TaskFit] = field(default_factory=dict)
    publish_s: float = 0.0
    adopt_s: float = 0.0
    adopt_s_per_byte: float = 0.0
    step_s: float = 0.0  # the rest of a step, at its end (fitted by simulation)
    # the share of the model's bytes a ``delta: true`` adoption received in the run (0: none
    # measured: a delta sync is charged as a full copy)
    delta_fraction: float = 0.0
    measured_step_s: float = 0.0
    steps: int = 0

    def apply(self, task: TaskPlan, d):
        """``d`` (a task's :class:`~asyncflow.simulate.costs.Device`) with the run's costs."""
        f = self.tasks.get(task.name)
        if f is None:
            return d
        extra = f.write_s
        if rules_of(task.kind).samples:
            if d.engine is not None or d.latency is not None or d.episode is not None:
                # the model's per-sample draws, plus the calls' overheads (in real seconds)
                return replace(d, seconds_per_call=d.seconds_per_call + extra / d.scale)
            lat = Distribution.from_spec(f.latency) if f.latency else None
            return replace(d, latency=lat, seconds_per_call=extra, scale=1.0,
                           seconds_per_sample=f.per_row_s)
        if keeps_hints(task, d):
            return d
        per_row = f.per_row_s
        if rules_of(task.kind).device_parallel:
            per_row *= f.devices / max(1, task.devices_per_replica)
        return replace(d, engine=None, latency=None, episode=None, scale=1.0,
                       seconds_per_sample=per_row, seconds_per_call=f.per_call_s + extra,
                       sync_seconds=d.sync_seconds * d.scale)

    def describe(self) -> str:
        fits = ", ".join(f"{n} {f.per_call_s * 1e3:.1f} ms + {f.per_row_s * 1e3:.2f} ms/row"
                         for n, f in self.tasks.items())
        return (f"{self.run_dir} ({self.steps} steps, {self.measured_step_s:.3f} s a step): "
                f"{fits}; publish {self.publish_s * 1e3:.1f} ms, adopt {self.adopt_s * 1e3:.1f} "
                f"ms, the rest of a step {self.step_s * 1e3:.1f} ms"
                + (f"; a delta sync moved {self.delta_fraction:.1%} of the model's bytes"
                   if self.delta_fraction else ""))


def keeps_hints(task: TaskPlan, d) -> bool:
    """A streamed trainer whose hints model its device (``d``: a sim engine's
    ``seconds_per_sample``) keeps them: its COMPUTE spans end once a micro-batch is queued on
    the device (the next is read meanwhile), not when the device is done, so a line fitted to
    them charges neither its time a row (3.3 ms for a 5 ms trainer in a 6-step Ray run of
    sim_longtail) nor its time a call; the rest of a step is fitted over the hints."""
    return bool(task.stream and rules_of(task.kind).trains and d.seconds_per_sample)


# -- reading the run ---------------------------------------------------------------------------

def _read_json(path: str, what: str, run_dir: str):
    if not os.path.isfile(path):
        raise CalibrationError("AF643", path, run_dir=run_dir, what=f"no {what}")
    try:
        with open(path) as f:
            if path.endswith(".jsonl"):
                return [json.loads(line) for line in f if line.strip()]
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CalibrationError("AF643", path, run_dir=run_dir,
                               what=f"{what} cannot be read ({e.__class__.__name__}: {e})")


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of y = a + b x, least squares with a, b >= 0 (one x: a = 0, b = mean y / x)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    vx = sum((x - mx) ** 2 for x in xs)
    if vx <= 1e-12 * max(1.0, mx * mx) or len(xs) < 3:
        return 0.0, (my / mx if mx > 0 else 0.0)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / vx
    a = my - b * mx
    if b < 0:
        return my, 0.0
    if a < 0:
        return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return a, b


def _lognormal(durs: list[float]) -> dict | None:
    logs = [math.log(d) for d in durs if d > 0]
    if not logs:
        return None
    sigma = statistics.pstdev(logs) if len(logs) > 1 else 0.0
    return {"dist": "lognormal", "median": math.exp(statistics.fmean(logs)), "sigma": sigma,
            "max": max(durs), "seed": 0}


def fit(plan: Plan, run_dir: str) -> Calibration:
    """The per-call costs of the run in ``run_dir`` (the end-of-step time not yet fitted)."""
    run_plan = _run_plan(run_dir)
    _same_pipeline(plan, run_plan, run_dir)
    trace = _read_json(os.path.join(run_dir, "trace.json"), "trace.json", run_dir)
    # the train steps' rows (a held-out evaluation writes rows of its own there: no step time)
    metrics = [m for m in _read_json(os.path.join(run_dir, "metrics.jsonl"), "metrics.jsonl",
                                     run_dir) if not is_eval(m)]
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"] \
        if isinstance(trace, dict) else []
    if not events or len(metrics) < 2:
        raise CalibrationError("AF643", os.path.join(run_dir, "trace.json"), run_dir=run_dir,
                               what=f"{len(events)} spans and {len(metrics)} steps (at least "
                                    "one span and two steps are needed)")
    spans: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for e in events:
        spans.setdefault((e.get("cat", ""), e.get("name", "")), []).append(
            (int((e.get("args") or {}).get("rows") or 0), float(e.get("dur") or 0.0) * 1e-6))
    c = Calibration(run_dir, run_plan.pipeline)
    for t in run_plan.tasks:
        comp = [(r, d) for r, d in spans.get((t.name, "COMPUTE"), []) if r > 0]
        if not comp:
            continue
        a, b = _fit_line([float(r) for r, _ in comp], [d for _, d in comp])
        writes = [d for _, d in spans.get((t.name, "WRITE"), [])]
        trains = rules_of(t.kind).trains
        f = TaskFit(len(comp), a, b, max(1, t.devices_per_replica),
                    write_s=statistics.median(writes) if writes and not trains else 0.0,
)
        if rules_of(t.kind).samples:
            f.write_s = 0.0  # a rollout's writes go on while it generates
            f.latency = _lognormal([d for _, d in comp])
        c.tasks[t.name] = f
    pub = [d for _, d in spans.get(_trainer_op(run_plan, "PUBLISH"), [])]
    c.publish_s = statistics.median(pub) if pub else 0.0
    adopts = [d for k, v in spans.items() if k[1] == "ADOPT" for _, d in v]
    hinted = _hinted_sync_s(run_plan)
    c.adopt_s = max(0.0, statistics.median(adopts) - hinted) if adopts else 0.0
    nbytes = sum(float(m.get("sync_bytes") or 0.0) for m in metrics)
    if nbytes > 0 and adopts:
        c.adopt_s_per_byte = max(0.0, sum(adopts) - hinted * len(adopts)) / nbytes
        c.adopt_s = 0.0
        c.delta_fraction = _delta_fraction(run_plan, nbytes / len(adopts))
    c.steps = len(metrics)
    c.measured_step_s = typical_step_s([float(m["time"]) for m in metrics])
    return c


def typical_step_s(ends: list[float]) -> float:
    """A run's typical step from its step end times: the mean gap between consecutive ends
    (steps 1..N-1), the measure the fidelity benchmark compares. Leaving out the first gap (a
    short run's first steady step carries its start-up) and the median were compared on the
    same runs (benchmarks/calibration_fit.py): neither did better over two sets of 19."""
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return sum(gaps) / len(gaps) if gaps else 0.0


def _delta_fraction(plan: Plan, per_adopt: float) -> float:
    """The share of its model's bytes an adoption received on the run's ``delta: true`` edges
    (the first, full copy included); 0 where the run has none or the model's size is unknown."""
    from asyncflow.simulate.transfer import model_bytes

    full = max((model_bytes(plan, s.model) for s in plan.sync if s.delta), default=0.0)
    return min(1.0, per_adopt / full) if full > 0 else 0.0


def _trainer_op(plan: Plan, op: str) -> tuple[str, str]:
    t = next((t for t in plan.tasks if rules_of(t.kind).trains), None)
    return (t.name if t else "", op)


def _hinted_sync_s(plan: Plan) -> float:
    """The seconds the hints already charge a weight update (a sim engine's sync_seconds)."""
    from asyncflow.simulate.costs import device

    return max((device(plan, t).sync_seconds * device(plan, t).scale for t in plan.tasks
                if any(s.dst == t.name for s in plan.sync)), default=0.0)


def _run_plan(run_dir: str) -> Plan:
    if not os.path.isdir(run_dir):
        raise CalibrationError("AF643", run_dir, run_dir=run_dir, what="no such directory")
    path = os.path.join(run_dir, "plan.json")
    if not os.path.isfile(path):
        raise CalibrationError("AF643", path, run_dir=run_dir, what="no plan.json")
    try:
        with open(path) as f:
            return Plan.from_json(f.read())
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CalibrationError("AF643", path, run_dir=run_dir,
                               what=f"plan.json cannot be read ({e.__class__.__name__}: {e})")


def _same_pipeline(plan: Plan, run_plan: Plan, run_dir: str) -> None:
    path = os.path.join(run_dir, "plan.json")
    if run_plan.pipeline != plan.pipeline:
        raise CalibrationError("AF644", path, run_dir=run_dir, pipeline=plan.pipeline,
                               other=f"pipeline '{run_plan.pipeline}'",
                               what="calibrate from a run of this pipeline")
    ours = {(t.name, t.kind) for t in plan.tasks}
    theirs = {(t.name, t.kind) for t in run_plan.tasks}
    if ours != theirs:
        diff = sorted(f"{n} ({k})" for n, k in ours ^ theirs)
        raise CalibrationError("AF644", path, run_dir=run_dir, pipeline=plan.pipeline,
                               other=f"a version of '{run_plan.pipeline}' with other tasks",
                               what="the tasks differ: " + ", ".join(diff))


def calibrate(plan: Plan, run_dir: str, *, iterations: int = 14) -> Calibration:
    """:func:`fit`, then the end-of-step seconds that make the simulation of the run's own plan
    take the typical step time it measured (:func:`typical_step_s` of both; bisection; 0 when
    the fitted calls alone take as long)."""
    from asyncflow.simulate.core import simulate

    c = fit(plan, run_dir)
    run_plan = _run_plan(run_dir)
    budget = 200 * max(1, c.steps) * max(1, run_plan.step.samples_per_step) + 1_000_000

    def step_time(x: float) -> float:
        c.step_s = x
        r = simulate(run_plan, max_events=budget, calibration=c)
        return typical_step_s(list(r.step_ends)) if not r.stalled else math.inf

    target = c.measured_step_s
    if step_time(0.0) >= target:
        c.step_s = 0.0
        return c
    lo, hi = 0.0, target
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if step_time(mid) < target:
            lo = mid
        else:
            hi = mid
    c.step_s = (lo + hi) / 2
    return c
