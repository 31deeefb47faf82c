"""cost: predict the steady-state step time of the plan, of its synchronous form, and the ideal.

Cost hints, per task. A task's ``cost:`` mapping wins over the ``sim`` engine's ``args`` (read only
for ``engine: sim``); both take the same keys:

=====================  ============================================================
key                    meaning
=====================  ============================================================
``latency``            device time of one sample: a number or a distribution spec
                       (:mod:`asyncflow.costmodel`); ``slots`` of them run at once
``slots``              samples one replica works on at once (default 1)
``seconds_per_sample`` a call on n rows takes n * this (a train, logprob or value
                       replica on d devices: n * this / d, data parallel)
``seconds_per_call``   each call takes this on top (a call = one READ's rows)
=====================  ============================================================

A task without hints costs 0 (and the estimate says so in ``notes``). For one replica's share of
a step, n = ceil(samples_per_step / replicas) rows:

1. ``async(t)`` (throughput): ``n * mean(latency) / slots + n * seconds_per_sample +
   calls * seconds_per_call`` with calls = ceil(n / read_rows) (a per-sample fn: one per row; a
   train task: its COMPUTEs, one per step, or one per micro-batch when it streams). A rollout with
   ``schedule: batch`` waits for the slowest sample of every call: its latency term is
   ``expected_makespan`` of each call's rows (a call: the COMPUTE's rows) instead of the mean.
2. ``sync(t)`` (the step waits for its slowest sample): latency waves --
   ``sum over waves of E[max of the wave's draws]`` (``costmodel.expected_makespan``; a wave is
   ``slots`` samples) -- plus the same per-sample and per-call terms with one call per replica per
   step (one per row for a per-sample fn; a streaming trainer: one per micro-batch).
3. A pool's work is the sum over its tasks of their per-replica time (colocated tasks
   time-share its devices); a pool-less task's work is its own.
4. ``ideal`` = the busiest pool's work per step using (1) (the busiest task when there are no
   pools).
5. ``step_time_sync`` = the longest path through the data DAG with (2) as durations, but at least
   the busiest pool's total of (2).
6. this plan's ``step_time``: when some producer may run ahead (run_ahead a > 0) it is the largest
   of the busiest pool's or task's work under (1) and, for each rollout with a latency, its
   slowest concurrent sample ``E[max of min(n, slots)]`` spread over the ``a + 1`` steps it may
   take; otherwise (staleness 0) it equals ``step_time_sync``.
7. ``samples_per_s = samples_per_step / step_time``; ``speedup = step_time_sync / step_time``
   (0 and 1 when nothing has a cost).

Not modelled yet (each says so in ``notes``): a rollout's ``redundancy`` (the estimate counts
``prompts_per_step`` groups a step, not ``launch_groups``), and the prompts that replace filtered
or too stale groups.
"""
from __future__ import annotations

import dataclasses
import math

from asyncflow.compiler.kinds import rules_of
from asyncflow.compiler.runner import Context
from asyncflow.costmodel import Distribution, SpecError, expected_makespan
from asyncflow.engines.base import capabilities
from asyncflow.plan import Estimate, Plan, TaskPlan

HINT_KEYS = ("latency", "slots", "seconds_per_sample", "seconds_per_call")


@dataclasses.dataclass
class TaskCost:
    latency: Distribution | None = None
    slots: int = 1
    seconds_per_sample: float = 0.0
    seconds_per_call: float = 0.0

    @property
    def empty(self) -> bool:
        return self.latency is None and not self.seconds_per_sample and not self.seconds_per_call


class HintError(ValueError):
    def __init__(self, code: str, path: str, **fmt):
        super().__init__(code)
        self.code, self.path, self.fmt = code, path, fmt


def hints(task: TaskPlan) -> tuple[dict, str]:
    """The hint mapping a task's cost comes from, and its key path prefix (``cost``/``args``)."""
    if task.cost:
        return task.cost, "cost"
    if capabilities(task.engine, load=False).cost_args:
        return {k: v for k, v in task.args.items() if k in HINT_KEYS}, "args"
    return {}, "cost"


def read_hints(task: TaskPlan) -> TaskCost:
    """Parse a task's hints; raise HintError (code AF403 / AF404, key path) when one is bad.
    A data-parallel kind's ``seconds_per_sample`` comes back divided by its
    ``devices_per_replica``."""
    h, where = hints(task)
    c = TaskCost()
    for k, v in h.items():
        if k not in HINT_KEYS:
            from asyncflow.diagnostics import did_you_mean

            raise HintError("AF404", f"{where}.{k}", key=k, task=task.name,
                            hint=did_you_mean(k, HINT_KEYS))
        if k == "latency":
            try:
                c.latency = Distribution.from_spec(v)
            except SpecError as e:
                raise HintError("AF403", f"{where}.latency", task=task.name, reason=str(e))
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or not math.isfinite(v):
            raise HintError("AF404", f"{where}.{k}", key=k, task=task.name, hint=None,
                            bad=v)
        if k == "slots":
            if not isinstance(v, int) or v < 1:
                raise HintError("AF404", f"{where}.{k}", key=k, task=task.name, hint=None, bad=v)
            c.slots = v
        else:
            setattr(c, k, float(v))
    if rules_of(task.kind).device_parallel and task.devices_per_replica > 1:
        c.seconds_per_sample /= task.devices_per_replica
    return c


def _rows(plan: Plan, t: TaskPlan) -> int:
    return math.ceil(plan.step.samples_per_step / max(1, t.replicas))


def _compute_rows(plan: Plan, t: TaskPlan) -> int:
    """Rows of one COMPUTE of ``t`` (its first worker's op list; 0 when it has none)."""
    for w in plan.workers:
        if w.task == t.name:
            return next((o.rows for o in w.ops if o.kind == "COMPUTE"), 0)
    return 0


def _train_calls(plan: Plan, t: TaskPlan, n: int) -> int:
    """A train task's calls per replica and step: its COMPUTEs (one per micro-batch when it
    streams, else one)."""
    rows = _compute_rows(plan, t) if t.stream else 0
    return math.ceil(n / rows) if rows else 1


def async_time(plan: Plan, t: TaskPlan, c: TaskCost) -> float:
    """Rule 1."""
    n = _rows(plan, t)
    per_row_fn = t.fn is not None and not t.batched and t.engine is None
    if rules_of(t.kind).trains:
        calls = _train_calls(plan, t, n)
    else:
        calls = math.ceil(n / (t.read_rows or (1 if per_row_fn else n)))
    time = n * c.seconds_per_sample + calls * c.seconds_per_call
    if c.latency is not None:
        batch = min(n, _compute_rows(plan, t) or n)
        if t.schedule == "batch":  # every call waits for its slowest sample
            full, rest = divmod(n, batch)
            time += full * expected_makespan(c.latency, batch, c.slots) + \
                expected_makespan(c.latency, rest, c.slots)
        else:
            time += n * c.latency.mean() / c.slots
    return time


def sync_time(plan: Plan, t: TaskPlan, c: TaskCost) -> float:
    """Rule 2."""
    n = _rows(plan, t)
    per_row_fn = t.fn is not None and not t.batched and t.engine is None
    calls = _train_calls(plan, t, n) if rules_of(t.kind).trains else (n if per_row_fn else 1)
    time = n * c.seconds_per_sample + calls * c.seconds_per_call
    if c.latency is not None:
        time += expected_makespan(c.latency, n, c.slots)
    return time


def estimate(plan: Plan, costs: dict[str, TaskCost]) -> Estimate:
    sps = plan.step.samples_per_step
    a_t = {t.name: async_time(plan, t, costs[t.name]) for t in plan.tasks}
    s_t = {t.name: sync_time(plan, t, costs[t.name]) for t in plan.tasks}
    notes = [f"no cost hint for task '{t.name}': counted as 0 s" for t in plan.tasks
             if costs[t.name].empty]
    notes += [f"redundancy {t.redundancy:g} of '{t.name}' is not modelled: the estimate counts "
              f"{plan.step.prompts_per_step} groups a step, not the {plan.step.launch_groups} "
              "launched" for t in plan.tasks if t.redundancy > 1]
    per_pool_a = {p.name: sum(a_t.get(n, 0.0) for n in p.tasks) for p in plan.pools}
    per_pool_s = {p.name: sum(s_t.get(n, 0.0) for n in p.tasks) for p in plan.pools}
    free = {t.name: a_t[t.name] for t in plan.tasks if t.pool is None}
    # rule 4
    ideal = max(per_pool_a.values(), default=0.0) if any(per_pool_a.values()) else \
        max(a_t.values(), default=0.0)
    # rule 5: longest path with sync durations
    finish: dict[str, float] = {}
    preds: dict[str, list[str]] = {}
    for ch in plan.channels:
        preds.setdefault(ch.dst, []).append(ch.src)
    for t in plan.tasks:  # plan.tasks are in topological order
        start = max([finish.get(s, 0.0) for s in preds.get(t.name, [])], default=0.0)
        finish[t.name] = start + s_t[t.name]
    sync = max([max(finish.values(), default=0.0)] + list(per_pool_s.values()))
    # rule 6
    ahead = any(t.run_ahead > 0 for t in plan.tasks)
    bottleneck = ""
    if ahead:
        cands = {f"pool {k}": v for k, v in per_pool_a.items()}
        cands.update({f"task {k}": v for k, v in free.items()})
        for t in plan.tasks:
            c = costs[t.name]
            if c.latency is not None and rules_of(t.kind).samples:
                tail = c.latency.expected_max(min(_rows(plan, t), c.slots)) / (t.run_ahead + 1)
                cands[f"task {t.name} (slowest sample over {t.run_ahead + 1} steps)"] = tail
        bottleneck, step = max(cands.items(), key=lambda kv: kv[1], default=("", 0.0))
    else:
        step = sync
        bottleneck = "synchronous step (staleness 0)"
    if step <= 0:
        bottleneck = ""
    r = lambda x: round(x, 6)  # noqa: E731 -- stable goldens
    return Estimate(
        step_time=r(step), step_time_sync=r(sync), ideal_step_time=r(ideal),
        samples_per_s=r(sps / step) if step > 0 else 0.0,
        samples_per_s_sync=r(sps / sync) if sync > 0 else 0.0,
        speedup=r(sync / step) if step > 0 else 1.0,
        per_task={k: r(v) for k, v in a_t.items()}, notes=notes, bottleneck=bottleneck,
        per_pool={k: r(v) for k, v in per_pool_a.items()})


def cost(plan: Plan, ctx: Context) -> Plan:
    costs: dict[str, TaskCost] = {}
    for t in plan.tasks:
        try:
            costs[t.name] = read_hints(t)
        except HintError as e:
            loc = None
            p = ctx.pipeline
            if p is not None and t.name in p.tasks:
                d = p.tasks[t.name]
                loc = d.locs.get(e.path) or d.locs.get(e.path.split(".")[0]) or d.loc
            if e.code == "AF403":
                ctx.diags.add("AF403", loc, task=e.fmt["task"], reason=e.fmt["reason"])
            else:
                ctx.diags.add("AF404", loc, hint=e.fmt.get("hint"), task=e.fmt["task"],
                              key=e.fmt["key"], keys=", ".join(HINT_KEYS))
            costs[t.name] = TaskCost()
    return dataclasses.replace(plan, estimate=estimate(plan, costs))
