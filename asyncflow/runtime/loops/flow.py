"""The loops' control flow, written once (a mixin of :class:`asyncflow.runtime.loops.state.Loop`).

A loop's order of operations is a generator (:meth:`Flows.flow_batches`) that ``yield``\\ s each
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
=============  ==================================================================================

One yield per op of a turn, never one per row.
"""
from __future__ import annotations

import time

from asyncflow.plan import Op

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
                    if "step" not in it:
                        self.claim_step(it)
                    for lease in self.step_reads(op, it["step"], it.setdefault("leases", [])):
                        if lease is None:
                            yield Request("NOTHING", op, it)
                    ok = self.join_leases(it)
                elif kind in ("READ", "COMPUTE"):
                    ok = yield Request(kind, op, it)
                else:
                    ok = self.ops[kind](op, it)
                if not ok:
                    break

    # ------------------------------------------------------------------ the real-time driver
    def drive(self, flow) -> None:
        """Run ``flow`` to its end, performing each request as it comes (blocking)."""
        perform = self.perform
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
        if kind == "WEIGHTS":
            self.sync(wait_s=self.timeout)
        elif kind == "NOTHING":
            # the store's get waited train_read_timeout_s already; a follower polls the
            # control for the primary's choice
            if self.follows:
                time.sleep(self.backoff * 4)
        return None
