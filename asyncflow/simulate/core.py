"""The simulator's event loop: a compiled plan executed in virtual time (README, "Simulate").

What runs is the runtime's own scheduling code, on the runtime's own objects:

- the sample store is :class:`asyncflow.runtime.store.SampleStore` on a virtual clock (leases,
  acks, partial acks, drops, versions, whole-group reads);
- every worker is a :class:`asyncflow.runtime.worker.Worker` (its gate, windows, staleness
  acceptance, ``_read``, ``_write`` with gate rule 3, ``_adopt``, ``_remove``, and the trainer's
  :meth:`~asyncflow.runtime.worker.Worker.step_reads`: in_order windows, first_ready,
  redundancy, followers), built from the plan's :class:`~asyncflow.plan.WorkerPlan` and ops;
- prompts are fed by :func:`asyncflow.runtime.driver.feed_target`, the driver's rule.

What is replaced: the threads, the waits and the engines. A worker never blocks; when a read
finds nothing it waits for the store (or the weights) to change, and device time is an event in
the future instead of a sleep. Device times come from the cost hints: a ``sim`` task's engine
(:class:`asyncflow.engines.sim.SimEngine`, built from the same spec, so a row costs the very
latency it costs in ``asyncflow run``), or a task's ``cost:`` mapping (:mod:`asyncflow.compiler.
passes.cost`). User functions (rewards, filters) are not called: they cost their ``cost:`` hints
(0 without) and a filter keeps every group.

Not modelled: Python and Ray overheads of the real runtime (heartbeats, 5 ms flushes, control
calls), faults and restarts, checkpoints, device contention between colocated tasks (each keeps
its own time, as the sim engine's sleeps do), and multi-turn episodes beyond one turn's latency
times the environment's ``turns``.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Any

from asyncflow.plan import Plan, TaskPlan
from asyncflow.runtime.driver import feed_ahead, feed_target
from asyncflow.runtime.store import SampleStore
from asyncflow.runtime.worker import Stop, Worker, engine_spec

FOREVER = 1e18


# -- device times -------------------------------------------------------------------------------

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
            from asyncflow.engines.sim import row_latency

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
        from asyncflow.engines.sim import slot_schedule

        if not rows:
            return 0.0
        done = slot_schedule([self.latency_of(r) for r in rows], self.slots)
        return done[-1][0] + self.seconds_per_call * self.scale


def device(plan: Plan, task: TaskPlan) -> Device:
    """The cost hints of ``task`` (a ``cost:`` mapping wins over a sim engine's ``args``)."""
    from asyncflow.compiler.passes.cost import read_hints

    if task.engine == "sim" and not task.cost:
        from asyncflow.engines.sim import SimEngine

        eng = SimEngine(engine_spec(plan, task, 0))
        d = Device(slots=eng.slots, seconds_per_sample=eng.seconds_per_sample / eng.devices,
                   sync_seconds=eng.sync_seconds, scale=eng.time_scale, engine=eng)
        if task.kind == "rollout" and task.env:
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
    from asyncflow.engines import sim_turns

    factory, kwargs = sim_turns._environment(eng)
    kwargs = {k: v for k, v in kwargs.items() if k != "time_scale"}
    env = factory(**kwargs)
    cap = sim_turns._max_turns(eng)
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


# -- the pieces a worker talks to ---------------------------------------------------------------

class _NoRecorder:
    """Spans are not recorded (the simulator keeps its own timeline)."""

    def span(self, *a, **k) -> None:
        pass



class _Versions:
    """A worker's adopter: the versions of the models it receives (no weights move)."""

    def __init__(self, worker: "SimWorker", models: list[str]):
        self.w = worker
        self.known = {m: 0 for m in models}
        self.exposed_s = 0.0

    @property
    def version(self) -> int:
        return min(self.known.values()) if self.known else 0

    def adopt(self, newer: dict) -> bool:
        took = False
        for model, (version, _) in sorted(newer.items()):
            if version > self.known.get(model, -1):
                self.known[model] = version
                took = True
        if took:
            self.w.adopted()
        return took


class SimControl:
    """The control plane, in process and instant: drops reach every worker at once."""

    def __init__(self, sim: "Simulation"):
        self.sim = sim
        self._chosen: dict[int, list[int]] = {}

    def note_drops(self, rows: list[int], reason: str) -> None:
        self.sim.dropped(list(rows), reason)

    def choose(self, step: int, rows: list[int]) -> None:
        self._chosen[step] = list(rows)
        self.sim.wake_kind("train")

    def chosen(self, step: int):
        return self._chosen.get(step)


# -- workers -------------------------------------------------------------------------------------

class SimWorker(Worker):
    """A :class:`Worker` whose loop is driven by events (subclasses per loop kind)."""

    def __init__(self, sim: "Simulation", wp, options: dict):
        super().__init__(sim.plan, wp.id, sim.store, sim.control, 0.0, options)
        self.sim = sim
        self.rec = _NoRecorder()
        self.adopter = _Versions(self, self.models_in) if self.models_in else None
        self.dev = sim.devices[self.task.name]
        self.busy_s = 0.0  # device seconds used (rollouts: slot-seconds / slots)
        self.waiting = False
        self._blocked_until = 0.0  # taking up new weights (sync_seconds)
        # a read that found nothing: how many newly written input rows it takes before a
        # read may succeed (at least 1; fewer pokes, never a missed one: see Simulation.wrote)
        self.need = 1
        self.fresh = 0
        self.dry = False  # the last read drained the store
        read = next((o for o in self.body if o.kind == "READ"), None)
        # a reader of whole groups counts writes per group (Simulation.wrote)
        self.unit = read.unit if read is not None and read.granularity == "group" \
            and read.unit > 1 and self.st.samples_per_prompt == read.unit else 0
        self.fill: dict[int, int] = {}

    def _missed(self, min_rows: int) -> None:
        """A read of at least ``min_rows`` rows found too few: wait for that many more (a
        reader of whole groups: for one more group written whole)."""
        self.waiting = True
        self.fresh = 0
        self.need = 1 if min_rows <= 1 or self.unit else max(
            1, int(min_rows) - self.store.pending(self.task.name))

    def _drained(self, asked: int, got: int) -> None:
        """A read took every row there was (fewer than it asked for): the next read can find
        rows only after a write, a feed, a release or new weights (``fresh``)."""
        self.fresh = 0
        self.dry = got < asked

    def _dry(self) -> bool:
        """Nothing can have become readable since a read that drained the store: wait."""
        if self.dry and self.fresh <= 0:
            self.waiting, self.need = True, 1
            return True
        return False

    # the control plane is instant here: no heartbeats, no flushes, no lease renewals
    def _sync(self, force: bool = False, wait_s: float = 0.0) -> bool:
        return False

    def _hold(self, lease, lease_s) -> None:
        pass

    def _unhold(self, lease_id) -> None:
        pass

    def offer(self, model: str, version: int) -> None:
        """The trainer published ``version`` of ``model`` (the ADOPT op takes it up)."""
        self._newer[model] = (version, None)
        self._newest = max(self._newest, version)

    def adopted(self) -> None:
        """New weights taken up: the engine's weight update takes ``sync_seconds`` (and the
        gate lets this worker start more rows)."""
        self.fresh = max(self.fresh, self.need)
        dt = self.dev.sync_seconds * self.dev.scale
        if dt > 0:
            self._blocked_until = self.sim.now + dt
            self.sim.after(dt, self.poke)

    def poke(self) -> None:
        """Something this worker may be waiting for changed: try to make progress."""
        raise NotImplementedError


class _StepReader:
    """A step READ's failed reads set the worker's ``need`` (mixed into batch and train
    workers: :meth:`Worker._lease_step` is the one place a step read leases)."""

    def _lease_step(self, want: int, *, step: int, min_rows: int, **kw) -> list:
        leases = super()._lease_step(want, step=step, min_rows=min_rows, **kw)
        if not leases:
            self._missed(min_rows)
        return leases


class BatchWorker(_StepReader, SimWorker):
    """The ``batches`` loop: WAIT, ADOPT, READ, COMPUTE (device time), WRITE; a step-granularity
    READ leases the step's rows with :meth:`Worker.step_reads`."""

    def __init__(self, sim, wp, options):
        super().__init__(sim, wp, options)
        self.read_op = next((o for o in self.body if o.kind == "READ"), None)
        self.write_op = next((o for o in self.body if o.kind == "WRITE"), None)
        self.computing = False
        self._reads = None  # a step READ in progress: (generator, it)
        self.rollout = self.task.kind == "rollout"

    def poke(self) -> None:
        if self.computing or self._stopped or self.sim.now < self._blocked_until:
            return
        while not self.computing:
            it: dict = {}
            if self._reads is not None:
                gen, it = self._reads
                if not self._drain(gen):
                    return
                self._reads = None
                if not self._join(it):
                    continue
            else:
                self._adopt(None, it)
                if self.sim.now < self._blocked_until:
                    return
                op = self.read_op
                if op is None:
                    return
                if op.granularity in ("micro_batch", "step"):
                    if self._cursor >= self.st.steps:
                        self._stopped = True
                        return
                    it["step"] = self._cursor
                    self._cursor += self.task.replicas
                    gen = self.step_reads(op, it["step"], it.setdefault("leases", []))
                    self._reads = (gen, it)
                    continue
                if self._dry():
                    return
                it["pull"] = op.rows  # a read that never waits (no real-time backoff)
                if not self._read(op, it):
                    self._missed(min(op.min_rows, op.rows))
                    return
                self._drained(op.rows, len(it["rows"]))
            self.waiting = False
            rows = it.get("rows") or []
            dt = self.dev.makespan(rows) if self.rollout else self.dev.call(len(rows))
            self.computing = True
            self.busy_s += dt
            self.sim.after(dt, self._computed, it)

    def _drain(self, gen) -> bool:
        """Advance a step READ; False while it waits for rows."""
        while True:
            try:
                lease = next(gen)
            except StopIteration:
                return True
            except Stop:
                self._stopped = True
                return False
            if lease is None:
                self.waiting = True
                return False

    def _computed(self, it: dict) -> None:
        self.computing = False
        rows = it.get("rows") or []
        if rows and self.write_op is not None:
            it["out"] = {f: [0] * len(rows) for f in self.task.outputs}
            it["end"] = self.sim.now
            if it.get("step") is None and self.gate is not None:
                it["step"] = self.gate.step_of(rows[0])
            if it.get("lease") is None:  # a step READ's several leases: ack each
                for lease in it.get("leases") or []:
                    cols = {f: [0] * len(lease.rows) for f in self.task.outputs}
                    self._ack(lease.id, cols)
                self.sim.wrote(self.task.name, rows)
            elif self._write(self.write_op, it):
                self.sim.wrote(self.task.name, rows)
            else:
                self.sim.released(self.task.name)
        self.poke()


class ServeWorker(SimWorker):
    """The ``serve`` loop (``schedule: queue``): ``slots`` samples in flight, a freed slot takes
    the next row at once, each sample written as it finishes; removed rows are cancelled in
    flight; new weights are adopted between requests by the ADOPT op (``on_update``)."""

    def __init__(self, sim, wp, options):
        super().__init__(sim, wp, options)
        k = next(i for i, op in enumerate(self.body) if op.kind == "READ")
        self.pre, self.read = self.body[:k + 1], self.body[k]
        self.post = [op for op in self.body[k + 1:] if op.kind == "WRITE"]
        self.slots = max(1, self.dev.slots)
        self.flight: dict[int, list] = {}  # row -> [finish, lease id, version, seq]
        self.leases: dict[int, dict] = {}
        self._seq = 0
        self._last = 0.0  # occupancy integration

    def _occupy(self) -> None:
        now = self.sim.now
        self.busy_s += (now - self._last) * len(self.flight) / self.slots
        self._last = now

    def adopted(self) -> None:
        super().adopted()
        dt = max(0.0, self._blocked_until - self.sim.now)
        if self.on_update == "abort" and self.flight:
            self._occupy()
            self._stats["aborted"] = self._stats.get("aborted", 0) + len(self.flight)
            for r, f in self.flight.items():  # restart with the new version
                self._seq += 1
                f[0] = self.sim.now + dt + self.dev.latency_of(r)
                f[2] = self._version()
                f[3] = self._seq
                self.sim.at(f[0], self._finish, r, self._seq)

    def poke(self) -> None:
        """A pull: cancel removed rows, the ADOPT op (``on_update: finish`` defers new weights
        while samples are in flight), then READs until the free slots are filled."""
        if self._stopped or self.sim.now < self._blocked_until:
            return
        self._cancels()
        self._adopt(self.read, {"pull": 0})
        if self.sim.now < self._blocked_until:
            return
        n = self.slots - len(self.flight)
        if n > 0 and self._dry():
            return
        self.waiting = False
        while n > 0:
            it: dict = {"pull": min(n, self.read.chunk or self.read.rows)}
            if not self._read(self.read, it):
                self._missed(1)
                return
            self._drained(it["pull"], len(it["rows"]))
            self._occupy()
            lease = it["lease"]
            v = self._version()
            self.leases[lease.id] = {"lease": lease, "rows": list(lease.rows), "done": {},
                                     "cancelled": set(), "version": v}
            for r in lease.rows:
                self._seq += 1
                f = [self.sim.now + self.dev.latency_of(r), lease.id, v, self._seq]
                self.flight[r] = f
                self.sim.at(f[0], self._finish, r, self._seq)
            self._in_flight = len(self.flight)
            n -= len(lease.rows)

    def _cancels(self) -> None:
        """Rows removed while in flight (and, with first_ready, samples no step may take)."""
        if self.hopeless and self._newest - self.gate.alpha > 0:
            oldest = self._newest - self.gate.alpha
            late = [r for r, f in self.flight.items() if (f[2] or 0) < oldest]
            if late:
                self._remove(late, "staleness")
                self._cancel_q.extend(late)
        if not self._cancel_q:
            return
        self._occupy()
        for r in self._cancel_q:
            f = self.flight.pop(int(r), None)
            if f is not None:
                self._stats["cancelled"] = self._stats.get("cancelled", 0) + 1
                v = self.leases[f[1]]
                v["cancelled"].add(int(r))
                self._settle(f[1])
        self._cancel_q = []
        self._in_flight = len(self.flight)

    def _finish(self, r: int, seq: int) -> None:
        f = self.flight.get(r)
        if f is None or f[3] != seq:
            return  # cancelled or restarted
        if self.sim.now < self._blocked_until:  # emitted once the weight update is done
            self.sim.at(self._blocked_until, self._finish, r, seq)
            return
        self._occupy()
        del self.flight[r]
        self._in_flight = len(self.flight)
        v = self.leases[f[1]]
        v["done"][r] = f[2]
        rows = [r]
        it = {"lease": v["lease"], "rows": rows, "out": {f_: [0] for f_ in self.task.outputs},
              "versions": [f[2] if f[2] is not None else 0], "version": f[2], "end": self.sim.now,
              "partial": True}
        wrote = True
        for op in self.post:
            wrote = self._write(op, it)
        if wrote:
            self.sim.wrote(self.task.name, rows)
        else:
            self.sim.released(self.task.name)
        self._settle(f[1])
        self.sim.soon(self.poke)

    def _settle(self, lid: int) -> None:
        v = self.leases.get(lid)
        if v is not None and len(v["done"]) + len(v["cancelled"]) == len(v["rows"]):
            del self.leases[lid]
            if v["cancelled"]:
                self.store.ack_rows(v["lease"].id, sorted(v["cancelled"]))

    def offer(self, model: str, version: int) -> None:
        super().offer(model, version)
        self.sim.soon(self.poke)


class TrainWorker(_StepReader, SimWorker):
    """The ``train`` loop: the step's rows by :meth:`Worker.step_reads`, forward/backward per
    micro-batch as they arrive (``stream``) or once over all of them, then PUBLISH."""

    def __init__(self, sim, wp, options):
        super().__init__(sim, wp, options)
        self.read_op = next(o for o in self.body if o.kind == "READ")
        self.compute_op = next((o for o in self.body if o.kind == "COMPUTE"), None)
        self.publishes = [o for o in self.body if o.kind == "PUBLISH" and o.model]
        self.stream = bool(self.task.stream)
        self.step = int(self.opt.get("start_step", 0))
        self._gen = None
        self._leases: list = []
        self._queue: list[int] = []  # streamed micro-batches (their rows) not yet computed
        self.size = self.compute_op.rows if self.compute_op and self.compute_op.rows else 0
        self._free_at = 0.0  # the device is busy until then
        self.computing = False

    def poke(self) -> None:
        if self.computing or self._stopped or self.step >= self.st.steps:
            return
        if self._gen is None:
            self._leases = []
            self._gen = self.step_reads(self.read_op, self.step, self._leases)
        while True:
            try:
                lease = next(self._gen)
            except StopIteration:
                break
            except Stop:
                self._stopped = True
                return
            if lease is None:
                self.waiting = True
                return
            self.waiting = False
            if self.stream:  # the lease's micro-batches (Worker._micro_batches)
                n, size = len(lease.rows), self.size
                k = size if 0 < size < n else n
                self._queue.extend(min(k, n - i) for i in range(0, n, k))
                self._micro()
                if self.computing:
                    return
        self.waiting = False
        self._gen = False  # read complete
        if self.stream:
            self._micro(final=True)
            return
        self._compute(sum(len(l.rows) for l in self._leases), done=True)

    def _micro(self, final: bool = False) -> None:
        """Compute the next micro-batch; at the step's end (``final``) the last one ends it."""
        if self.computing:
            return
        if self._queue:
            k = self._queue.pop(0)
            self._compute(k, done=final and not self._queue)
        elif final:
            self._end_step()

    def _compute(self, n: int, done: bool) -> None:
        dt = self.dev.call(n)
        self.busy_s += dt
        self.computing = True
        self.sim.after(dt, self._computed, done)

    def _computed(self, done: bool) -> None:
        self.computing = False
        if self._gen is False:  # every row read: compute what is left, then end the step
            if self.stream and self._queue:
                self._micro(final=True)
                return
            self._end_step()
            return
        if done:
            self._end_step()
            return
        self._micro()
        if not self.computing:
            self.poke()

    def _end_step(self) -> None:
        step = self.step
        rows = sorted(r for l in self._leases for r in l.rows)
        versions = []
        for lease in self._leases:
            versions.extend(lease.columns.get("_version") or [None] * len(lease.rows))
            self._ack(lease.id)
        self._next_row(step, rows)
        self.sim.step_done(self, step, rows, [self.accept.staleness(step, v) for v in versions])
        if (step + 1) % self.publish_every == 0 or step + 1 == self.st.steps:
            for op in self.publishes:
                self.sim.publish(op.model, step + 1)
        self.step += 1
        self._gen = None
        self.sim.soon(self.poke)


# -- the simulation ------------------------------------------------------------------------------

@dataclass
class SimResult:
    """One simulated run (README, "Simulate")."""

    pipeline: str
    steps: int
    samples_per_step: int
    devices: int
    step_ends: list[float] = field(default_factory=list)  # virtual seconds
    samples: list[int] = field(default_factory=list)  # rows trained per step
    staleness_max: list[int] = field(default_factory=list)
    staleness_mean: list[float] = field(default_factory=list)
    pools: dict = field(default_factory=dict)  # pool -> {devices, busy_s, utilization}
    tasks: dict = field(default_factory=dict)  # task -> {replicas, busy_s, utilization}
    drops: dict = field(default_factory=dict)
    cancelled: int = 0
    aborted: int = 0
    events: int = 0
    wall_s: float = 0.0  # real seconds the simulation took
    stalled: str = ""  # why the simulation ended before its last step ("" when it did not)

    @property
    def virtual_s(self) -> float:
        return self.step_ends[-1] if self.step_ends else 0.0

    @property
    def samples_per_s(self) -> float:
        """Steady state: the steps after the first, from the end of step 0 (as
        ``benchmarks/overlap.py`` measures a run)."""
        if len(self.step_ends) < 2:
            return self.samples_per_s_whole
        t = self.step_ends[-1] - self.step_ends[0]
        return sum(self.samples[1:]) / t if t > 0 else 0.0

    @property
    def samples_per_s_whole(self) -> float:
        t = self.virtual_s
        return sum(self.samples) / t if t > 0 else 0.0

    @property
    def step_time_s(self) -> float:
        if len(self.step_ends) < 2:
            return self.virtual_s
        return (self.step_ends[-1] - self.step_ends[0]) / (len(self.step_ends) - 1)

    def to_dict(self) -> dict:
        return {"pipeline": self.pipeline, "samples_per_s": self.samples_per_s,
                "samples_per_s_whole": self.samples_per_s_whole,
                "step_time_s": self.step_time_s, "devices": self.devices,
                "wall_s": self.wall_s, "virtual_s": self.virtual_s, "steps": len(self.step_ends),
                "samples_per_step": self.samples_per_step, "step_ends_s": self.step_ends,
                "staleness_max": max(self.staleness_max, default=0),
                "staleness_mean": (sum(self.staleness_mean) / len(self.staleness_mean)
                                   if self.staleness_mean else 0.0),
                "pools": self.pools, "tasks": self.tasks, "drops": self.drops,
                "cancelled": self.cancelled, "aborted": self.aborted, "events": self.events,
                "events_per_s": self.events / self.wall_s if self.wall_s > 0 else 0.0,
                "stalled": self.stalled}


class Simulation:
    """Execute ``plan`` in virtual time (module docstring)."""

    def __init__(self, plan: Plan, *, max_events: int = 0, exhaustive: bool = False):
        self.plan = plan
        # exhaustive: after every event, every waiting worker reads again (no wake-up skipped;
        # the tests check that the targeted wake-ups give the very same run)
        self.exhaustive = exhaustive
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self.events = 0
        self.max_events = max_events
        st = plan.step
        self.store = SampleStore(lease_s=FOREVER, clock=lambda: self.now)
        for t in plan.tasks:
            self.store.register_task(t.name, list(t.inputs))
        self.control = SimControl(self)
        self.devices = {t.name: device(plan, t) for t in plan.tasks}
        opts = {"read_timeout_s": 0.0, "train_read_timeout_s": 0.0, "backoff_s": 0.0,
                "lease_s": FOREVER}
        self.workers: list[SimWorker] = []
        for wp in plan.workers:
            cls = {"serve": ServeWorker, "train": TrainWorker}.get(wp.loop, BatchWorker)
            self.workers.append(cls(self, wp, opts))
        self.by_task: dict[str, list[SimWorker]] = {}
        for w in self.workers:
            self.by_task.setdefault(w.task.name, []).append(w)
        self.readers = _last_writers(plan)
        sources = {f for d in plan.data for f in d.fields}
        self.source_readers = [t.name for t in plan.tasks if set(t.inputs) & sources]
        self.source_fields = sorted(sources) or ["prompt"]
        self.trainers = [t.name for t in plan.tasks if t.kind == "train"]
        self.done = {t: 0 for t in self.trainers}
        self.ahead = feed_ahead(plan)
        self.fed = 0
        self._soon: list = []
        self._soon_keys: set = set()
        self.result = SimResult(plan.pipeline, st.steps, st.samples_per_step,
                                sum(p.devices for p in plan.pools) or len(plan.workers))
        self._reports: dict[int, dict] = {}

    # -- events --------------------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def after(self, dt: float, fn, *args) -> None:
        self.at(self.now + max(0.0, dt), fn, *args)

    def soon(self, fn, *args) -> None:
        """Run ``fn`` at the current time, after the event being handled (once per instant)."""
        key = (getattr(fn, "__self__", None), getattr(fn, "__name__", fn), args)
        if key in self._soon_keys:
            return
        self._soon_keys.add(key)
        self._soon.append((fn, args))

    # -- what changed ----------------------------------------------------------------------------
    def wake(self, task: str) -> None:
        """Rows of ``task`` may have become readable (a feed, a release, a drop, weights)."""
        for w in self.by_task.get(task, ()):
            w.fresh = max(w.fresh, w.need)
            if w.waiting:
                self.soon(w.poke)

    def wake_kind(self, kind: str) -> None:
        for t in self.plan.tasks:
            if t.kind == kind:
                self.wake(t.name)

    def wrote(self, task: str, rows: list[int]) -> None:
        """``rows`` of ``task``'s outputs were written: wake a reader once as many rows as its
        last read lacked have been written -- for a reader of whole groups, once a group has
        had a write to each of its rows (an over-count only costs a read; the group of row r
        is r // samples_per_prompt, as the feed numbers them)."""
        for r in self.readers.get(task, ()):
            for w in self.by_task.get(r, ()):
                if w.unit:
                    for row in rows:
                        g = row // w.unit
                        k = w.fill.get(g, 0) + 1
                        if k >= w.unit:
                            w.fill.pop(g, None)
                            w.fresh += w.unit
                        else:
                            w.fill[g] = k
                else:
                    w.fresh += len(rows)
                if w.waiting and w.fresh >= w.need:
                    self.soon(w.poke)

    def released(self, task: str) -> None:
        self.wake(task)

    def dropped(self, rows: list[int], reason: str) -> None:
        for w in self.workers:
            w.windows.note(rows, reason)
            if isinstance(w, ServeWorker):  # cancelled in flight; replaced rows may start
                w._cancel_q.extend(r for r in rows if r in w.flight)
                w.fresh = max(w.fresh, w.need)
                self.soon(w.poke)
        self.soon(self.feed)
        for t in self.trainers:
            self.wake(t)

    def publish(self, model: str, version: int) -> None:
        for w in self.workers:
            if model in w.models_in:
                w.offer(model, version)
                if isinstance(w, BatchWorker):
                    self.soon(w.poke)
        self.soon(self.feed)

    def step_done(self, w: TrainWorker, step: int, rows: list[int], stale: list[int]) -> None:
        self.done[w.task.name] = step + 1
        rep = self._reports.setdefault(step, {})
        rep[w.task.name] = (rows, stale)
        if all(t in rep for t in self.trainers):
            r = self.result
            r.step_ends.append(self.now)
            rows0, stale0 = rep[w.primary] if w.primary in rep else rep[w.task.name]
            r.samples.append(len(rows0))
            r.staleness_max.append(max(stale0, default=0))
            r.staleness_mean.append(sum(stale0) / len(stale0) if stale0 else 0.0)
            del self._reports[step]
        self.soon(self.feed)

    def feed(self) -> None:
        st = self.plan.step
        version = min(self.done.values()) if self.done else st.steps
        upto = feed_target(st, version, self.ahead, self.store.drop_counts())
        if upto <= self.fed:
            return
        spp = st.samples_per_prompt
        groups = [g for g in range(self.fed, upto) for _ in range(spp)]
        self.store.add_rows({f: [0] * len(groups) for f in self.source_fields}, groups)
        self.fed = upto
        for t in self.source_readers:
            self.wake(t)

    # -- run -------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        t0 = time.perf_counter()
        st = self.plan.step
        self.feed()
        for w in self.workers:
            self.soon(w.poke)
        heap = self._heap
        while True:
            while self._soon:
                batch, self._soon = self._soon, []
                self._soon_keys = set()
                for fn, args in batch:
                    fn(*args)
                    self.events += 1
            if self.trainers and all(d >= st.steps for d in self.done.values()):
                break
            if not heap:
                self.result.stalled = "nothing left to happen (no rows the gate lets start)"
                break
            if self.max_events and self.events > self.max_events:
                self.result.stalled = f"more than {self.max_events} events"
                break
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            fn(*args)
            self.events += 1
            if self.exhaustive:
                for w in self.workers:
                    w.fresh, w.dry = max(w.fresh, w.need), False
                    if w.waiting:
                        self.soon(w.poke)
            if self.events % 4096 == 0:
                self.store.gc()
        self._finish(t0)
        return self.result

    def _finish(self, t0: float) -> None:
        r = self.result
        end = self.now or 1e-12
        for w in self.workers:
            if isinstance(w, ServeWorker):
                w._occupy()
        by_task: dict[str, float] = {}
        for w in self.workers:
            by_task[w.task.name] = by_task.get(w.task.name, 0.0) + w.busy_s
        for t in self.plan.tasks:
            reps = len(self.by_task.get(t.name, ()))
            devs = max(1, reps * max(1, t.devices_per_replica)) if t.pool else reps
            r.tasks[t.name] = {"replicas": reps, "pool": t.pool, "busy_s": by_task.get(t.name, 0.0),
                               "utilization": min(1.0, by_task.get(t.name, 0.0) * max(
                                   1, t.devices_per_replica) / (devs * end)) if devs else 0.0}
        for p in self.plan.pools:
            busy = sum(by_task.get(t, 0.0) * max(1, self.plan.task(t).devices_per_replica)
                       for t in p.tasks)
            util = min(1.0, busy / (p.devices * end)) if p.devices else 0.0
            r.pools[p.name] = {"devices": p.devices, "busy_s": busy, "utilization": util,
                               "bubble": 1.0 - util}
        r.drops = self.store.drop_counts()
        r.cancelled = sum(int(w._stats.get("cancelled", 0)) for w in self.workers)
        r.aborted = sum(int(w._stats.get("aborted", 0)) for w in self.workers)
        r.events = self.events
        r.wall_s = time.perf_counter() - t0


def _last_writers(plan: Plan) -> dict[str, list[str]]:
    """task -> the tasks whose reads its writes may complete. A row becomes readable for a
    task when the last of its input fields is written, and a producer that feeds another
    producer of those fields writes a row before that one does; so only the producers
    downstream of every other (and data sources, through the feed) wake a reader."""
    ups = {t.name: {u.name for u in plan.tasks if set(t.inputs) & set(u.outputs)}
           for t in plan.tasks}

    def ancestors(name: str) -> set[str]:
        seen, todo = set(), list(ups.get(name, ()))
        while todo:
            u = todo.pop()
            if u not in seen:
                seen.add(u)
                todo.extend(ups.get(u, ()))
        return seen

    anc = {t.name: ancestors(t.name) for t in plan.tasks}
    readers: dict[str, list[str]] = {t.name: [] for t in plan.tasks}
    for t in plan.tasks:
        producers = ups[t.name]
        for p in producers:
            if not any(p in anc[q] for q in producers if q != p):
                readers[p].append(t.name)
    return readers


def simulate(plan: Plan, *, steps: int | None = None, max_events: int = 0,
             exhaustive: bool = False) -> SimResult:
    """Execute ``plan`` in virtual time and return what it did (module docstring). ``steps``
    overrides the plan's; ``max_events`` stops a runaway simulation (``stalled`` says so)."""
    if steps is not None:
        plan = plan.with_steps(steps)
    return Simulation(plan, max_events=max_events, exhaustive=exhaustive).run()


__all__ = ["Device", "SimResult", "Simulation", "device", "simulate"]
