"""The simulator's workers: hosts of the runtime's loop state in virtual time.

Each is a :class:`~asyncflow.runtime.loops.state.Loop` built from its WorkerPlan, so the gate,
the windows, the staleness acceptance, the op handlers (``op_read``, ``op_write`` with gate rule
3, ``op_adopt``), :meth:`~asyncflow.runtime.loops.step_reads.StepReads.step_reads`, the
micro-batch split and the publish rule are the runtime's own, and so is the control flow of
every loop: the ``batches`` and ``train`` flows (:mod:`asyncflow.runtime.loops.flow`, resumed
from events) and the ``serve`` loop's ``pull``/``emit`` callbacks
(:class:`~asyncflow.runtime.loops.serve.ServeLoop`, called by :class:`ServeWorker`, a simulated
engine). What a worker here does instead of blocking: a read that finds nothing waits for the
store (or the weights) to change, and device time is an event in the future
(:mod:`asyncflow.simulate.core`).
"""
from __future__ import annotations

from asyncflow.compiler.kinds import rules_of
from asyncflow.runtime.loops import Loop
from asyncflow.runtime.loops.flow import AGAIN
from asyncflow.runtime.signals import Stop

#: a request the simulator answers later, from its event queue
_SUSPEND = object()


class _NoRecorder:
    """Spans are not recorded (the simulator keeps its own timeline)."""

    def span(self, *a, **k) -> None:
        pass

    def occupancy(self, *a, **k) -> None:
        pass


class _Versions:
    """A worker's adopter: the versions of the models it receives (no weights move)."""

    def __init__(self, worker: "SimWorker", models: list[str]):
        self.w = worker
        self.known = {m: 0 for m in models}
        self.exposed_s = 0.0
        self.version = 0  # min(known): read on every op, changed only by adopt

    def adopt(self, newer: dict) -> bool:
        took = False
        for model, (version, _) in sorted(newer.items()):
            if version > self.known.get(model, -1):
                self.known[model] = version
                took = True
        if took:
            self.version = min(self.known.values())
            self.w.adopted()
        return took


class SimControl:
    """The control plane, in process and instant: drops reach every worker at once."""

    def __init__(self, sim):
        self.sim = sim
        self._chosen: dict[int, list[int]] = {}

    def note_drops(self, rows: list[int], reason: str) -> None:
        self.sim.dropped(list(rows), reason)

    def choose(self, step: int, rows: list[int]) -> None:
        self._chosen[step] = list(rows)
        self.sim.wake_trainers()

    def chosen(self, step: int):
        return self._chosen.get(step)


# -- workers -------------------------------------------------------------------------------------

class SimWorker(Loop):
    """A host of the runtime's loop state (:class:`~asyncflow.runtime.loops.state.Loop`) whose
    loop is driven by events (subclasses per loop kind)."""

    def __init__(self, sim, wp, options: dict):
        super().__init__(sim.plan, wp.id, sim.store, sim.control, options)
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

    def _missed(self, min_rows: int, max_row: int | None = None) -> None:
        """A read of at least ``min_rows`` rows (below ``max_row``) found too few: wait for that
        many more (a reader of whole groups: for one more group written whole). Rows at or past
        ``max_row`` (a trainer's next step) do not count as ready for it."""
        self.waiting = True
        self.fresh = 0
        if min_rows <= 1 or self.unit:
            self.need = 1
            return
        below = getattr(self.store, "pending_below", None)
        ready = (below(self.task.name, max_row, int(min_rows)) if max_row is not None
                 and below is not None else self.store.pending(self.task.name))
        self.need = max(1, int(min_rows) - ready)

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
    def sync(self, force: bool = False, wait_s: float = 0.0) -> bool:
        return False

    def offer(self, model: str, version: int) -> None:
        """The trainer published ``version`` of ``model`` (the ADOPT op takes it up)."""
        self.heard_newer({**self.newer, model: (version, None)})

    def adopted(self) -> None:
        """New weights taken up: the engine's weight update takes ``sync_seconds`` (and the
        gate lets this worker start more rows)."""
        self.fresh = max(self.fresh, self.need)
        # the engine's update, then the weights' transfer (asyncflow.simulate.transfer; 0 s
        # when the model's size is unknown)
        dt = self.dev.sync_seconds * self.dev.scale + self.sim.transfer.adopt_s(
            self.task.name, self.sim.now)
        if dt > 0:
            self._blocked_until = self.sim.now + dt
            self.sim.after(dt, self.poke)

    def poke(self) -> None:
        """Something this worker may be waiting for changed: try to make progress."""
        raise NotImplementedError

    # the batches and train loops: the runtime's flow (asyncflow.runtime.loops.flow), each of
    # its requests performed in virtual time (perform), at once or by suspending it
    def resume(self, reply) -> None:
        """Run the flow, sent ``reply``, until it waits for an event (``_SUSPEND``; ``_reply``
        is then what a poke, or the end of a device call, sends it)."""
        while True:
            try:
                req = self._flow.send(reply)
            except (StopIteration, Stop):  # past the last step
                self.stopped = True
                return
            reply = self.nothing_yet() if req.kind == "NOTHING" else self.perform(req)
            if reply is _SUSPEND:
                return

    def nothing_yet(self):
        """NOTHING: a step READ found nothing yet (its ``need`` is set): wait for a poke, which
        resumes the flow with nothing sent back."""
        self.waiting = True
        self._reply = None
        return _SUSPEND

    def _device_call(self, dt: float, *args) -> object:
        """A device call of ``dt`` seconds; the flow resumes when it ends."""
        self.computing = True
        self.busy_s += dt
        self.sim.after(dt, self._computed, *args)
        return _SUSPEND


class _StepReader:
    """A step READ's failed reads set the worker's ``need`` (mixed into batch and train
    workers: :meth:`Loop.lease_step` is the one place a step read leases)."""

    def lease_step(self, want: int, *, step: int, min_rows: int, **kw) -> list:
        leases = super().lease_step(want, step=step, min_rows=min_rows, **kw)
        if not leases:
            self._missed(min_rows, kw.get("max_row"))
        return leases


class _Writes:
    """A WRITE tells the simulation (mixed into batch and serve workers): the rows written wake
    their readers, rows given back (gate rule 3) wake this task's."""

    def op_write(self, op, it: dict) -> bool:
        """WRITE, then tell the simulation (a step READ's several leases: ack each)."""
        rows = it.get("rows") or []
        if not rows:
            return True
        if it.get("lease") is None:
            for lease in it.get("leases") or []:
                cols = {f: [0] * len(lease.rows) for f in self.task.outputs}
                self.ack(lease.id, cols)
            self.sim.wrote(self.task.name, rows)
            return True
        if super().op_write(op, it):
            self.sim.wrote(self.task.name, rows)
            return True
        self.sim.released(self.task.name)
        return False


class BatchWorker(_Writes, _StepReader, SimWorker):
    """The ``batches`` loop (:meth:`Loop.flow_batches`, the runtime's own control flow) driven
    by events: a READ that finds nothing, new weights being taken up and a device call suspend
    it until a poke (or the call's end) resumes it."""

    def __init__(self, sim, wp, options):
        super().__init__(sim, wp, options)
        self.read_op = next((o for o in self.body if o.kind == "READ"), None)
        self.computing = False
        self.rollout = rules_of(self.task.kind).samples
        self._flow = self.flow_batches() if self.read_op is not None else None
        self._reply = None  # what the flow is sent when a poke resumes it

    def sync(self, force: bool = False, wait_s: float = 0.0) -> bool:
        return self.stopped

    def poke(self) -> None:
        if self.computing or self.stopped or self.sim.now < self._blocked_until:
            return
        if self._flow is not None:
            self.resume(self._reply)

    def perform(self, req):
        """A request in virtual time: at once, or ``_SUSPEND`` (``_reply`` is what a poke, or
        the device call's end, sends back)."""
        kind, op, it = req.kind, req.op, req.it
        if kind == "ADOPTED":
            if self.sim.now < self._blocked_until:  # taking up the weights: start over after
                self._reply = AGAIN
                return _SUSPEND
            return None
        if kind == "READ":
            self._reply = False  # a poke starts the turn over
            if self._dry():
                return _SUSPEND
            it["pull"] = op.rows  # a read that never waits (no real-time backoff)
            if not self.op_read(op, it):
                self._missed(min(op.min_rows, op.rows))
                return _SUSPEND
            self._drained(op.rows, len(it["rows"]))
            return True
        if kind == "COMPUTE":
            self.waiting = False
            rows = it.get("rows") or []
            dt = self.dev.makespan(rows) if self.rollout else self.dev.call(len(rows))
            if dt <= 0:  # a free call (a reward with no cost) ends now: no event to wait for
                self._outputs(it)
                return True
            return self._device_call(dt, it)
        return None  # WEIGHTS: the weight board is instant here (a poke follows a publish)

    def _computed(self, it: dict) -> None:
        self.computing = False
        self._outputs(it)
        self.resume(True)

    def _outputs(self, it: dict) -> None:
        """The call's outputs (placeholders) and when it ended."""
        rows = it.get("rows") or []
        if rows:
            it["out"] = {f: [0] * len(rows) for f in self.task.outputs}
            it["end"] = self.sim.now
            if it.get("step") is None and self.gate is not None:
                it["step"] = self.gate.step_of(rows[0])


class ServeWorker(_Writes, SimWorker):
    """The ``serve`` loop (``schedule: queue``) in virtual time: a simulated engine around the
    runtime's own loop (:class:`~asyncflow.runtime.loops.serve.ServeLoop`). The engine keeps
    ``slots`` samples in flight, each finishing ``latency_of(row)`` seconds after it starts (an
    event); it calls the loop's ``pull`` with its free slots whenever something it may be
    waiting for changed (a poke) and ``emit`` as each sample finishes. Everything else -- the
    writes, the cancels, ``on_update``, leasing the free slots -- is the loop's. Its busy time
    is slot-seconds over slots."""

    def __init__(self, sim, wp, options):
        # each sample is written as it finishes (no real-time batching of the writes)
        super().__init__(sim, wp, {**options, "flush_s": 0.0})
        self.slots = max(1, self.dev.slots)
        self.flight: dict[int, list] = {}  # row -> [finish, version, seq]: the engine's slots
        self._seq = 0
        self._last = 0.0  # occupancy integration
        self._restart = False  # on_update: abort -- restart the samples in flight after the pull
        self.start_serving(self.slots)

    # the loop's hooks (asyncflow.runtime.loops.serve)
    def clock(self) -> float:
        return self.sim.now

    def updating_weights(self) -> bool:
        return self.sim.now < self._blocked_until

    def may_pull(self, n: int) -> bool:
        if n > 0 and self._dry():
            return False
        self.waiting = False
        return True

    def pulled(self, asked: int, got: int, first: bool) -> None:
        if got:
            self._drained(asked, got)
        else:  # nothing it may start (a dry store, or the gate): none until something changes
            self._missed(1)
            self.dry = True

    def served_fields(self, v, rows: list[int]) -> dict:
        """The engine's outputs: placeholders (nothing is generated here)."""
        return {f: [0] * len(rows) for f in self.task.outputs}

    # the simulated engine
    def occupy(self) -> None:
        """Slot-seconds up to now (before the number of samples in flight changes)."""
        now = self.sim.now
        self.busy_s += (now - self._last) * len(self.flight) / self.slots
        self._last = now

    def adopted(self) -> None:
        super().adopted()
        if self.on_update == "abort":
            self._restart = True

    def poke(self) -> None:
        """A pull (the engine takes up no rows while it takes up new weights): the rows it
        cancels leave the engine, ``on_update: abort`` restarts the rest, the new rows start."""
        if self.stopped or self.sim.now < self._blocked_until:
            return
        if self.cancel_queue:  # the slot-seconds so far, before this pull's cancels
            self.occupy()
        got = self.serve_pull(self.slots - len(self.flight))
        gone = got.get("_cancel")
        if gone:
            self.occupy()
            for r in gone:
                if self.flight.pop(r, None) is not None:
                    self.stats["cancelled"] = self.stats.get("cancelled", 0) + 1
        if self._restart:
            self._restart = False
            self._abort()
        rows = got.get("_row")
        if rows:
            self.occupy()
            version = self.current_version()
            for r in rows:
                self._start(int(r), self.sim.now + self.dev.latency_of(r), version)

    def _start(self, r: int, finish: float, version) -> None:
        self._seq += 1
        self.flight[r] = [finish, version, self._seq]
        self.sim.at(finish, self._finish, r, self._seq)

    def _abort(self) -> None:
        """``on_update: abort``: the samples in flight (once the pull's cancels have left)
        start again with the new version, after the weight update."""
        if not self.flight:
            return
        self.occupy()
        self.stats["aborted"] = self.stats.get("aborted", 0) + len(self.flight)
        dt = max(0.0, self._blocked_until - self.sim.now)
        version = self.current_version()
        for r in list(self.flight):
            self._start(r, self.sim.now + dt + self.dev.latency_of(r), version)

    def _finish(self, r: int, seq: int) -> None:
        f = self.flight.get(r)
        if f is None or f[2] != seq:
            return  # cancelled or restarted
        if self.sim.now < self._blocked_until:  # emitted once the weight update is done
            self.sim.at(self._blocked_until, self._finish, r, seq)
            return
        self.occupy()
        del self.flight[r]
        self.serve_emit({"_row": r, "_version": f[1] if f[1] is not None else 0})
        self.poke()  # the freed slot takes its next row now

    def offer(self, model: str, version: int) -> None:
        super().offer(model, version)
        self.sim.soon(self.poke)


class TrainWorker(_StepReader, SimWorker):
    """The ``train`` loop (:meth:`Loop.flow_train`, the runtime's own control flow) driven by
    events: the step's rows by :meth:`Loop.step_reads`, forward/backward per micro-batch as
    they arrive (``stream``) or once over all of them, PUBLISH, then the step's report; the
    next step starts at the next poke."""

    def __init__(self, sim, wp, options):
        super().__init__(sim, wp, options)
        self.step = int(self.opt.get("start_step", 0))
        self.computing = False
        self._publish: list = []  # (model, version) published by this step, told at its end
        self._publish_s = 0.0  # seconds this step's publishes block the trainer (transfer)
        self._flow = self.flow_train()
        self._reply = None

    def streams(self) -> bool:
        return bool(self.task.stream)  # no engine here: the plan's key alone

    def poke(self) -> None:
        if self.computing or self.stopped or self.step >= self.st.steps:
            return
        self.resume(self._reply)

    def perform(self, req):
        """A request in virtual time: at once, or ``_SUSPEND``."""
        kind, it = req.kind, req.it
        if kind == "MICRO":
            self.waiting = False
            return self._device_call(self.dev.call(it["micro"][2]))
        if kind == "COMPUTE":
            self.waiting = False
            return self._device_call(self.dev.call(len(it["rows"])))
        if kind == "STREAMED":
            self.waiting = False
        elif kind == "END":
            self._reply = None
            dt, self._publish_s = self._publish_s + self.sim.transfer.step_s(self.task.name), 0.0
            if dt > 0:  # exporting (and putting) the weights: the step ends after
                self.computing = True
                self.sim.after(dt, self._published, it)
                return _SUSPEND
            self._end_step(it)
            return _SUSPEND
        return None  # STREAM

    def _computed(self) -> None:
        self.computing = False
        self.resume(None)

    def _published(self, it: dict) -> None:
        self.computing = False
        self._end_step(it)

    def publish_version(self, model: str, version: int) -> float:
        """PUBLISH: the rollouts hear of ``version`` once the step has reported (END), after
        the seconds the publish blocks the trainer (asyncflow.simulate.transfer)."""
        if not model:
            return 0.0
        self._publish.append((model, version))
        dt = self.sim.transfer.publish_s(self.task.name, model)
        self._publish_s += dt
        return dt

    def _end_step(self, it: dict) -> None:
        step, leases = it["step"], it.get("leases") or []
        rows = sorted(r for lease in leases for r in lease.rows)
        versions = []
        for lease in leases:
            versions.extend(lease.columns.get("_version") or [None] * len(lease.rows))
        self.ack_step(leases)
        self.next_row(step, rows)
        self.sim.step_done(self, step, rows, self.staleness_of(step, versions))
        publish, self._publish = self._publish, []
        for model, version in publish:
            self.sim.publish(model, version)
        self.step += 1
        self.sim.soon(self.poke)
