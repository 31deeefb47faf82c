"""Device times of the simulator (:mod:`asyncflow.simulate.core`): what one call of a task
costs, from its cost hints -- a ``sim`` task's engine (:class:`asyncflow.engines.sim.SimEngine`,
built from the same spec, so a row costs the very latency it costs in ``asyncflow run``), or a
task's ``cost:`` mapping (:mod:`asyncflow.compiler.passes.cost`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncflow.compiler.kinds import rules_of
from asyncflow.compiler.passes.cost import read_hints
from asyncflow.engines import sim_turns
from asyncflow.engines.sim import SimEngine, row_latency, slot_schedule
from asyncflow.plan import Plan, TaskPlan
from asyncflow.runtime.worker import engine_spec


@dataclass
class Device:
    """What one call of a task costs, from its cost hints (module docstring)."""

    slots: int = 1
    seconds_per_sample: float = 0.0
    seconds_per_call: float = 0.0
    sync_seconds: float = 0.0
    scale: float = 1.0  # a sim engine's ``time_scale``
    engine: Any = None  # a SimEngine: latency_of(row) is the run's own draw
    latency: Any = None  # else a costmodel.Distribution (cost: latency)
    episode: Any = None  # a multi-turn rollout: row -> modelled seconds of its whole episode

    def latency_of(self, row: int) -> float:
        if self.episode is not None:
            lat = self.episode(row)
        elif self.engine is not None:
            lat = self.engine.latency_of(row)
        elif self.latency is not None:
            lat = row_latency(self.latency, row)
        else:
            lat = self.seconds_per_sample
        return lat * self.scale

    @property
    def costs(self) -> bool:
        """Whether these hints give the task any device time at all."""
        return (self.engine is not None or self.latency is not None
                or bool(self.seconds_per_sample or self.seconds_per_call))

    def call(self, n: int) -> float:
        """Seconds of one call on ``n`` rows (a scorer, a trainer, a function)."""
        return (n * self.seconds_per_sample + (self.seconds_per_call if n else 0.0)) * self.scale

    def makespan(self, rows: list[int]) -> float:
        """A whole-batch rollout call: its rows through ``slots`` slots, in order."""
        if not rows:
            return 0.0
        done = slot_schedule([self.latency_of(r) for r in rows], self.slots)
        return done[-1][0] + self.seconds_per_call * self.scale


def device(plan: Plan, task: TaskPlan, calibration=None) -> Device:
    """The cost hints of ``task`` (a ``cost:`` mapping wins over a sim engine's ``args``);
    with a ``calibration`` (:class:`asyncflow.simulate.calibrate.Calibration`), what it fitted
    to a real run for the task (its device times, the runtime's per-call and per-row costs)."""
    d = _hinted(plan, task)
    return calibration.apply(task, d) if calibration is not None else d


def _hinted(plan: Plan, task: TaskPlan) -> Device:
    if task.engine == "sim" and not task.cost:
        eng = SimEngine(engine_spec(plan, task, 0))
        d = Device(slots=eng.slots, seconds_per_sample=eng.seconds_per_sample / eng.devices,
                   sync_seconds=eng.sync_seconds, scale=eng.time_scale, engine=eng)
        if rules_of(task.kind).samples and task.env:
            _episodes(d, eng, task)
        return d
    c = read_hints(task)
    return Device(slots=c.slots, seconds_per_sample=c.seconds_per_sample,
                  seconds_per_call=c.seconds_per_call, latency=c.latency)


def _episodes(d: Device, eng, task: TaskPlan) -> None:
    """A multi-turn sim rollout: an episode of row r takes its agent turns' latencies (the
    engine's draws) plus its environment steps' (a :func:`asyncflow.envs.sim_env` reports
    them; another environment's steps cost nothing here), up to ``max_turns``; episodes in
    flight are bounded by ``env_threads`` (agent turns competing for ``slots`` are not
    modelled)."""
    factory, kwargs = sim_turns.environment(eng)
    kwargs = {k: v for k, v in kwargs.items() if k != "time_scale"}
    env = factory(**kwargs)
    cap = sim_turns.max_turns(eng)
    turns = min(int(getattr(env, "turns", 1)), cap)
    steps = getattr(env, "step_seconds", None)

    def episode(row: int) -> float:
        t = sum(sim_turns.turn_latency(eng, row, k) for k in range(1, turns + 1))
        if steps is not None:
            env.episode = row
            t += sum(steps(k) for k in range(1, turns + 1))
        return t

    d.episode = episode
    d.slots = int(task.args.get("env_threads") or 2 * eng.slots)


def has_costs(plan: Plan) -> bool:
    """Whether any task of ``plan`` takes device time (else every step would take 0 s)."""
    return any(device(plan, t).costs for t in plan.tasks)
