"""The simulator's event loop: a compiled plan executed in virtual time (README, "Simulate").

What runs is the runtime's own scheduling code, on the runtime's own objects:

- the sample store has the rules of :class:`asyncflow.runtime.store.SampleStore` on a virtual
  clock (leases, acks, partial acks, drops, versions, whole-group reads): it is
  :class:`asyncflow.simulate.vstore.VStore`, which keeps per-task indexes of the eligible rows
  updated on each write, lease, ack and drop instead of scanning the store's arrays (the store
  contract suite and a property test hold it equal to SampleStore);
- every worker is a host of the runtime's loop state, :class:`asyncflow.runtime.loops.Loop`
  (:mod:`asyncflow.simulate.workers`: its gate, windows, staleness acceptance, op handlers
  ``op_read``, ``op_write`` with gate rule 3, ``op_adopt``, ``remove_rows``, the trainer's
  :meth:`~asyncflow.runtime.loops.step_reads.StepReads.step_reads`: in_order windows,
  first_ready, redundancy, followers; the serve loop's cancelling and lease settling, the
  micro-batch split, the publish rule), built from the plan's :class:`~asyncflow.plan.WorkerPlan`
  and ops;
- prompts are fed by :func:`asyncflow.runtime.driver.feed_target`, the driver's rule.

What is replaced: the threads, the waits and the engines. A worker never blocks; when a read
finds nothing it waits for the store (or the weights) to change, and device time is an event in
the future instead of a sleep. Device times come from the cost hints
(:mod:`asyncflow.simulate.costs`): a ``sim`` task's engine
(:class:`asyncflow.engines.sim.SimEngine`, built from the same spec, so a row costs the very
latency it costs in ``asyncflow run``), or a task's ``cost:`` mapping (:mod:`asyncflow.compiler.
passes.cost`). User functions (rewards, filters) are not called: they cost their ``cost:`` hints
(0 without) and a filter keeps every group.

The weight sync costs its bytes over a link where the model's size is known
(:mod:`asyncflow.simulate.transfer`); with a calibration (:mod:`asyncflow.simulate.calibrate`)
the device times and the runtime's own costs are the ones a real run measured.

Not modelled (without a calibration): Python and Ray overheads of the real runtime (heartbeats,
5 ms flushes, control calls); and in any case faults and restarts, checkpoints, device contention
between colocated tasks (each keeps its own time, as the sim engine's sleeps do), and multi-turn
episodes beyond one turn's latency times the environment's ``turns``.
"""
from __future__ import annotations

import gc
import heapq
import time
from dataclasses import dataclass, field

from asyncflow.compiler.kinds import rules_of
from asyncflow.plan import Plan
from asyncflow.runtime.driver import feed_ahead, feed_target
from asyncflow.simulate.costs import Device, device, has_costs
from asyncflow.simulate.transfer import SyncCosts
from asyncflow.simulate.vstore import VStore
from asyncflow.simulate.workers import (BatchWorker, ServeWorker, SimControl, SimWorker,
                                        TrainWorker)

FOREVER = 1e18
GC_EVENTS = 1 << 20  # events between the run's full collections of cyclic garbage (run)


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

    def __init__(self, plan: Plan, *, max_events: int = 0, exhaustive: bool = False,
                 store=None, link=None, calibration=None):
        self.plan = plan
        # the weights' transfer over ``link`` (asyncflow.simulate.transfer) and the costs fitted
        # to a real run (asyncflow.simulate.calibrate): None, none
        self.transfer = SyncCosts(plan, link, calibration)
        # exhaustive: after every event, every waiting worker reads again (no wake-up skipped;
        # the tests check that the targeted wake-ups give the very same run)
        self.exhaustive = exhaustive
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self.events = 0
        self.max_events = max_events
        st = plan.step
        # the virtual-time store (asyncflow/simulate/vstore.py: the in-process store's rules,
        # event-indexed); ``store``: another Store class to run on (the tests compare them)
        # (one thread: the VStore takes no lock)
        self.store = (VStore(lease_s=FOREVER, clock=self._clock, threads=False) if store is None
                      else store(lease_s=FOREVER, clock=self._clock))
        for t in plan.tasks:
            self.store.register_task(t.name, list(t.inputs))
        self.control = SimControl(self)
        self.devices = {t.name: device(plan, t, calibration) for t in plan.tasks}
        opts = {"read_timeout_s": 0.0, "train_read_timeout_s": 0.0, "backoff_s": 0.0,
                "lease_s": FOREVER}
        self.workers: list[SimWorker] = []
        for wp in plan.workers:
            cls = {"serve": ServeWorker, "train": TrainWorker}.get(wp.loop, BatchWorker)
            self.workers.append(cls(self, wp, opts))
        self.by_task: dict[str, list[SimWorker]] = {}
        for w in self.workers:
            self.by_task.setdefault(w.task.name, []).append(w)
        # task -> the workers its writes may wake (those of the tasks _last_writers names)
        self.woken = {t: [w for r in rs for w in self.by_task.get(r, ())]
                      for t, rs in _last_writers(plan).items()}
        for name in _group_fed(plan, self.by_task, self.devices):
            for w in self.by_task[name]:
                w.unit = st.samples_per_prompt
        sources = {f for d in plan.data for f in d.fields}
        self.source_readers = [t.name for t in plan.tasks if set(t.inputs) & sources]
        self.source_fields = sorted(sources) or ["prompt"]
        self.trainers = [t.name for t in plan.tasks if rules_of(t.kind).trains]
        self.done = {t: 0 for t in self.trainers}
        self.finished = False  # every trainer did its last step (set by step_done)
        self.ahead = feed_ahead(plan)
        self.fed = 0
        self._soon: list = []
        self._soon_keys: set = set()
        self.result = SimResult(plan.pipeline, st.steps, st.samples_per_step,
                                sum(p.devices for p in plan.pools) or len(plan.workers))
        self._reports: dict[int, dict] = {}

    def _clock(self) -> float:
        return self.now

    # -- events --------------------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def after(self, dt: float, fn, *args) -> None:
        self.at(self.now + max(0.0, dt), fn, *args)

    def soon(self, fn, *args) -> None:
        """Run ``fn`` at the current time, after the event being handled (once per instant)."""
        key = (fn, args)  # a bound method equals another of the same object and function
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

    def wake_trainers(self) -> None:
        for name in self.trainers:
            self.wake(name)

    def wrote(self, task: str, rows: list[int]) -> None:
        """``rows`` of ``task``'s outputs were written: wake a reader once as many rows as its
        last read lacked have been written -- for a reader of whole groups, once a group has
        had a write to each of its rows (an over-count only costs a read; the group of row r
        is r // samples_per_prompt, as the feed numbers them)."""
        for w in self.woken.get(task, ()):
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
            w.heard_dropped(rows, reason)  # a serve loop cancels those in flight
            if isinstance(w, ServeWorker):  # replaced rows may start
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
        self.finished = all(d >= self.plan.step.steps for d in self.done.values())
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
        # the run allocates a few objects per event and frees nearly all of them (no cycles
        # to speak of): Python's cyclic GC, at its default thresholds, walked every live row
        # again and again (a fifth of the CPU at 512 devices; at raised thresholds still 6% at
        # 1,024 devices x 16 samples, and none of it found garbage): no automatic collections
        # while it runs, a full one every GC_EVENTS events (what cycles there are stay bounded)
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if enabled:
                gc.enable()

    def _run(self) -> SimResult:
        t0 = time.perf_counter()
        self.feed()
        for w in self.workers:
            self.soon(w.poke)
        heap, pop = self._heap, heapq.heappop
        exhaustive, max_events = self.exhaustive, self.max_events
        events = 0  # self.events, kept in a local while the loop runs
        while True:
            while self._soon:
                batch, self._soon = self._soon, []
                self._soon_keys = set()
                for fn, args in batch:
                    fn(*args)
                events += len(batch)
            if self.finished:
                break
            if not heap:
                self.result.stalled = "nothing left to happen (no rows the gate lets start)"
                break
            if max_events and events > max_events:
                self.result.stalled = f"more than {max_events} events"
                break
            t, _, fn, args = pop(heap)
            self.now = t
            fn(*args)
            events += 1
            if exhaustive:
                for w in self.workers:
                    w.fresh, w.dry = max(w.fresh, w.need), False
                    if w.waiting:
                        self.soon(w.poke)
            if events % 4096 == 0:
                self.store.gc()
                if events % GC_EVENTS == 0:  # a multiple of 4,096
                    gc.collect()
        self.events = events
        self._finish(t0)
        return self.result

    def _finish(self, t0: float) -> None:
        r = self.result
        end = self.now or 1e-12
        for w in self.workers:
            if isinstance(w, ServeWorker):
                w.occupy()
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
        r.cancelled = sum(int(w.stats.get("cancelled", 0)) for w in self.workers)
        r.aborted = sum(int(w.stats.get("aborted", 0)) for w in self.workers)
        r.events = self.events
        r.wall_s = time.perf_counter() - t0


def _group_fed(plan: Plan, by_task: dict, devices: dict) -> list[str]:
    """The tasks woken once a whole group of their input rows is written rather than per row:
    those that cost nothing (no device time, no weights) and whose outputs only readers of
    whole groups read (a GRPO reward before its advantage). Their writes before a group's last
    row can be read by nobody until that row is written, and a call costs no time, so reading
    the group's rows then -- in the same instant as that last row's write -- gives the very run
    that per-row reads give (the exhaustive wake-ups and the per-row runs are compared in the
    tests) with a wake-up, a read and a write a group instead of a row."""
    spp = plan.step.samples_per_prompt
    if spp <= 1:
        return []
    out = []
    for t in plan.tasks:
        ws = by_task.get(t.name, ())
        if not ws or any(not isinstance(w, BatchWorker) or w.rollout or w.read_op is None
                         or w.unit or w.models_in for w in ws) or devices[t.name].costs:
            continue
        readers = [by_task.get(u.name, ()) for u in plan.tasks
                   if u.name != t.name and set(u.inputs) & set(t.outputs)]
        if readers and all(rs and all(w.unit == spp for w in rs) for rs in readers):
            out.append(t.name)
    return out


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
             exhaustive: bool = False, store=None, link=None, calibration=None) -> SimResult:
    """Execute ``plan`` in virtual time and return what it did (module docstring). ``steps``
    overrides the plan's; ``max_events`` stops a runaway simulation (``stalled`` says so);
    ``store``: the Store class to run on (default :class:`~asyncflow.simulate.vstore.VStore`);
    ``link`` is what weight syncs cross (:mod:`asyncflow.simulate.links`, default ethernet);
    ``calibration`` the costs fitted to a real run (:mod:`asyncflow.simulate.calibrate`)."""
    if steps is not None:
        plan = plan.with_steps(steps)
    return Simulation(plan, max_events=max_events, exhaustive=exhaustive, store=store,
                      link=link, calibration=calibration).run()


__all__ = ["Device", "SimResult", "Simulation", "device", "has_costs", "simulate"]

