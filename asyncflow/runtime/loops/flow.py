"""The loops' control flow, written once (a mixin of :class:`asyncflow.runtime.loops.state.Loop`).

A loop's order of operations is a generator (:meth:`Flows.flow_batches`,
:meth:`Flows.flow_train`) that ``yield``\\ s each
thing it waits for as a :class:`Request` and is sent back what came of it. A host drives it:

- the real host (:class:`asyncflow.runtime.worker.Worker`) with :meth:`Flows.drive`, performing
  each request at once and blocking as it does (:meth:`Flows.perform`);
- the simulator's workers (:mod:`asyncflow.simulate.workers`) from their event queue: a request
  becomes an event in virtual time, and the generator is resumed when it happens.

=============  ==================================================================================
request        what the loop waits for, and what it is sent back
=============  ==================================================================================
``WEIGHTS``    a gated worker whose last READ found nothing: newer weights (the weight board);
               nothing is sent back
``ADOPTED``    new weights were perhaps taken up (ADOPT): the engine's update time; sent
               :data:`AGAIN` when the turn must start over (newer weights may have come meanwhile)
``READ``       a store read that may find nothing (the op's handler); sent whether it found rows
``NOTHING``    a step READ's store read found nothing yet; nothing is sent back
``COMPUTE``    a device call on the turn's rows (the COMPUTE op); sent whether to go on
``STREAM``     a streaming trainer's step begins (``stream: true``): the real host hands the
               engine's ``train_stream`` the micro-batches, running the flow from inside it
               (:meth:`Flows.micro_batches`) up to ``STREAMED``
``MICRO``      one micro-batch of a streaming step (``it["micro"]``: lease, start, rows) is
               computed; nothing is sent back
``STREAMED``   every micro-batch of the step was handed over
``END``        a train step is done: ack, checkpoint, report (the real host); the simulator
               reports and resumes the next step at its next poke
=============  ==================================================================================

One yield per op of a turn, never one per row.
"""
from __future__ import annotations

import time

from asyncflow.engines.base import class_capabilities
from asyncflow.plan import Op
from asyncflow.runtime.loops.step_reads import micro_slices

#: a host's reply to ``ADOPTED``: start the turn over (from the top of the op list)
AGAIN = object()


class Request:
    """What a loop waits for: its ``kind`` (the table above), the op and the turn's state."""

    __slots__ = ("kind", "op", "it")

    def __init__(self, kind: str, op: Op | None = None, it: dict | None = None):
        self.kind, self.op, self.it = kind, op, it

    def __repr__(self) -> str:
        return f"Request({self.kind}, {self.op.kind if self.op else None})"


STEP_GRANULARITY = ("micro_batch", "step")


class Flows:
    """The loops as generators, and the real-time driver; the state is the
    :class:`~asyncflow.runtime.loops.state.Loop`'s."""

    def flow_batches(self):
        """The ``batches`` loop: the op list, over and over, until the run stops: WAIT (a gated
        worker whose last READ found nothing waits for newer weights), ADOPT, READ (a ``step``
        READ takes step r, r + R, ... of replica r of R, lease by lease), COMPUTE, WRITE; a turn
        whose op has nothing to do ends there."""
        while not self.sync():
            it: dict = {}
            for op in self.body:
                self.enter(op.kind)
                kind = op.kind
                if kind == "WAIT":
                    if self.wants_weights(it):
                        yield Request("WEIGHTS", op, it)
                    continue
                if kind == "ADOPT":
                    self.op_adopt(op, it)
                    if (yield Request("ADOPTED", op, it)) is AGAIN:
                        break
                    continue
                if kind == "READ" and op.granularity in STEP_GRANULARITY:
                    ok = yield from self.flow_step_read(op, it)
                elif kind in ("READ", "COMPUTE"):
                    ok = yield Request(kind, op, it)
                else:
                    ok = self.ops[kind](op, it)
                if not ok:
                    break

    def flow_step_read(self, op: Op, it: dict):
        """A ``step``/``micro_batch`` READ: lease the step's rows as they become ready
        (:meth:`~asyncflow.runtime.loops.step_reads.StepReads.step_reads`), waiting after a read
        that found nothing; then their columns joined in row order. Returns whether to go on."""
        if "step" not in it:
            self.claim_step(it)
        for lease in self.step_reads(op, it["step"], it.setdefault("leases", [])):
            if lease is None:
                yield Request("NOTHING", op, it)
        return self.join_leases(it)

    def streams(self) -> bool:
        """Whether a train step streams (``stream: true`` and an engine with ``train_stream``):
        its micro-batches are computed as their rows are read."""
        return bool(self.task.stream) and class_capabilities(type(self.engine)).train_stream

    def flow_train(self):
        """The ``train`` loop: once per step n, READ step n's rows until all of them (but the
        dropped) are leased; COMPUTE one ``train_step`` on them in row order -- or, streaming,
        each lease's micro-batches as it arrives --; PUBLISH version n + 1; END (ack,
        checkpoint, report)."""
        step = int(self.opt.get("start_step", 0))
        if step:  # resumed: rollouts start from the checkpoint's weights
            for op in self.body:
                if op.kind == "PUBLISH" and op.model:
                    self.publish_version(op.model, step)
        streams = self.streams()
        while step < self.st.steps:
            if self.sync():
                return
            it: dict = {"step": step}
            read = None
            for op in self.body:
                self.enter(op.kind)
                if op.kind == "READ" and op.granularity in STEP_GRANULARITY:
                    if streams:  # read while computing: under COMPUTE
                        read = op
                    else:
                        yield from self.flow_step_read(op, it)
                elif op.kind == "COMPUTE" and read is not None:
                    yield Request("STREAM", op, it)
                    leases = it.setdefault("leases", [])
                    for lease in self.step_reads(read, step, leases):
                        if lease is None:
                            yield Request("NOTHING", read, it)
                            continue
                        for i, k in micro_slices(len(lease.rows), op.rows):
                            it["micro"] = (lease, i, k)
                            yield Request("MICRO", op, it)
                    it.pop("micro", None)
                    self.read_ahead(read, step + 1)  # while the last micro-batch computes
                    self.join_leases(it)
                    yield Request("STREAMED", op, it)
                elif op.kind == "COMPUTE":
                    yield Request("COMPUTE", op, it)
                else:
                    self.ops[op.kind](op, it)
            yield Request("END", None, it)
            step += 1
        self.sync(force=True)

    # ------------------------------------------------------------------ the real-time driver
    def drive(self, flow) -> None:
        """Run ``flow`` to its end, performing each request as it comes (blocking)."""
        perform = self.perform
        self.flow = flow  # a streaming step runs it from inside the engine (micro_batches)
        reply = None
        while True:
            try:
                req = flow.send(reply)
            except StopIteration:
                return
            reply = perform(req)

    def perform(self, req: Request):
        """Do what ``req`` asks, now, and return what the loop is sent back."""
        kind = req.kind
        if kind == "READ":
            return self.op_read(req.op, req.it)
        if kind == "COMPUTE":
            return self.op_compute(req.op, req.it)
        if kind == "STREAM":
            self.compute_stream(req.op, req.it)
            return None
        if kind == "END":
            self.enter("ACK")
            self.end_step(req.it)
            self.progress += 1
            return None
        if kind == "WEIGHTS":
            self.sync(wait_s=self.timeout)
        elif kind == "NOTHING":
            # the store's get waited train_read_timeout_s already; a follower polls the
            # control for the primary's choice
            if self.follows:
                time.sleep(self.backoff * 4)
        return None

    def compute_stream(self, op: Op, it: dict) -> None:
        """A streaming step's COMPUTE (``STREAM``): the engine's ``train_stream`` takes the
        micro-batches as the flow reads them; the flow is left at its ``STREAMED``."""
        if self.faults:
            self.inject(it["step"], [])
        t = self.rec.compute_begin()
        self.rec.compute_end()
        batches = self.micro_batches(it, op.rows)
        it["metrics"] = self.engine.train_stream(batches)
        for _ in batches:  # an engine that stopped early: the step's rows are still read
            pass
        self.enter("COMPUTE")
        it["end"] = time.time()
        it["compute_s"] = it["end"] - t
        self.progress += 1
        self.check()

    def micro_batches(self, it: dict, size: int):
        """A streaming trainer's micro-batches (at most ``size`` rows: the COMPUTE op's),
        role-keyed, as the flow reads their leases: the engine's forward/backward of one runs
        while the next is read (a COMPUTE span per micro-batch). Runs the flow, performing what
        it waits for, until its ``STREAMED``."""
        self.enter("READ")
        flow, reply = self.flow, None
        while True:
            req = flow.send(reply)
            reply = None
            if req.kind == "STREAMED":
                return
            if req.kind != "MICRO":
                reply = self.perform(req)
                continue
            lease, i, k = it["micro"]
            cols = lease.columns
            part = cols if k == len(lease.rows) else {f: v[i:i + k] for f, v in cols.items()}
            self.enter("COMPUTE")
            t = self.rec.compute_begin()
            yield self.to_roles(part)
            end = self.rec.compute_end()
            self.enter("READ")  # waiting for the next micro-batch's rows
            self.progress += 1
            self.rec.span("COMPUTE", k, t, end, it["step"], it["step"])
