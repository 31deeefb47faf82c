"""The ``serve`` loop (a mixin of :class:`asyncflow.runtime.loops.state.Loop`): a rollout
engine with ``serve(pull, emit)`` does continuous batching across steps. ``pull`` runs the ops
up to the READ (at most ``chunk`` rows a lease), the engine computes, and a lease whose rows are
all done (or cancelled) runs the ops after COMPUTE (its WRITE), row by row as they finish.
The cancelling of hopeless samples and the settling of a lease whose rows are all done are
:meth:`ServeLoop.cancel_hopeless` and :meth:`ServeLoop.settle_lease`, which the simulator's
serve loop calls too."""
from __future__ import annotations

import time

from asyncflow.plan import Op
from asyncflow.runtime.signals import Stop


class InFlight:
    """A lease a serve loop has in its engine: its rows, those done (row -> outputs), those
    cancelled, those finished since its last write (in finishing order)."""

    __slots__ = ("lease", "rows", "done", "cancelled", "new", "start", "version", "lane")

    def __init__(self, lease, version, start: float = 0.0, lane: int = 0):
        self.lease, self.rows, self.version = lease, list(lease.rows), version
        self.done: dict = {}
        self.cancelled: set[int] = set()
        self.new: list[int] = []
        self.start, self.lane = start, lane

    @property
    def complete(self) -> bool:
        """Every row is done or cancelled: the lease ends."""
        return len(self.done) + len(self.cancelled) == len(self.rows)


class ServeLoop:
    """:meth:`loop_serve` and what a serve loop shares with the simulator's; the state is the
    :class:`~asyncflow.runtime.loops.state.Loop`'s."""

    def cancel_hopeless(self, flight) -> None:
        """first_ready: samples in flight (``flight``: (row, version started with) pairs) that
        no train step may take any more are removed and queued for cancelling."""
        if self.hopeless and self.newest - self.gate.alpha > 0:
            oldest = self.newest - self.gate.alpha
            late = [r for r, version in flight if (version or 0) < oldest]
            if late:
                self.remove_rows(late, "staleness")
                self.cancel_queue.extend(late)

    def lease_slots(self, n: int, pre: list[Op], read: Op):
        """A pull's leases for ``n`` free slots, at most ``read.chunk`` rows each: the ops up to
        the READ (WAIT, ADOPT, READ) run for each lease. Yields (the lease in flight, the rows
        its READ asked for); then None if a READ found nothing before the slots were filled."""
        while n > 0:
            it: dict = {"pull": min(n, read.chunk or read.rows)}
            for op in pre:
                self.enter(op.kind)
                if not self.ops[op.kind](op, it):
                    self.enter("COMPUTE")
                    yield None
                    return
            self.enter("COMPUTE")
            v = InFlight(it["lease"], self.current_version())
            n -= len(v.rows)
            yield v, it["pull"]

    def settle_lease(self, v: InFlight) -> None:
        """A lease whose rows are all done or cancelled ends: its cancelled rows are consumed
        unwritten (acked without outputs)."""
        if v.cancelled:
            self.store.ack_rows(v.lease.id, sorted(v.cancelled))
        self.unhold(v.lease.id)

    def _flush_rows(self, v: InFlight, rows: list[int], post: list[Op]) -> None:
        """Run a serve loop's ops after COMPUTE (its WRITE) on finished ``rows`` of lease
        ``v`` (acked as some of the lease's rows: the lease ends with its last)."""
        cols = self.to_fields({r: [v.done[x].get(r) for x in rows]
                               for _, r in self.roles_out}, rows)
        versions = [v.done[r].get("_version", v.version) for r in rows]
        self.check()
        it = {"lease": v.lease, "rows": rows, "out": cols, "versions": versions,
              "version": min(versions), "end": time.time(), "partial": True}
        for op in post:
            self.enter(op.kind)
            if not self.ops[op.kind](op, it):
                break
        self.enter("COMPUTE")

    def loop_serve(self) -> None:
        """``pull`` runs the ops up to the READ (at most ``chunk`` rows a lease); the engine
        computes; a lease whose rows are all done (or cancelled) runs the ops after COMPUTE (its
        WRITE). Rows removed from the store while in flight (a redundant group, a stale sample)
        go to the engine as ``_cancel`` with the next pull; ``on_update: finish`` defers new
        weights until nothing is in flight (the ADOPT op)."""
        eng = self.engine
        k = next(i for i, op in enumerate(self.body) if op.kind == "READ")
        pre, read = self.body[:k + 1], self.body[k]
        post = [op for op in self.body[k + 1:] if op.kind != "COMPUTE"]
        slots = max(1, int(getattr(eng, "slots", 64)))
        leases: dict[int, InFlight] = {}  # lease id -> the lease in flight
        row_lease: dict[int, int] = {}
        last_empty = [0.0]
        lanes: list[int] = []  # lane -> 1 busy / 0 free (trace lanes of concurrent leases)

        flush_s = float(self.opt.get("flush_s", 0.005))
        last_flush = [0.0]

        dirty: dict[int, None] = {}  # leases with rows finished or cancelled since a write
        ended: list[int] = []  # leases whose rows are all finished or cancelled

        def flush_done(force: bool = False) -> None:
            """Write finished samples: a lease's new ones every ``flush_s`` (one ack of those
            rows; the rest stay leased), and a lease whose rows are all done or cancelled.
            Only the leases that changed are visited (thousands may be in flight)."""
            now = time.time()
            due = force or now - last_flush[0] >= flush_s
            if due:
                last_flush[0] = now
                todo = list(dirty)
                dirty.clear()
            else:
                todo = [lid for lid in ended if lid in dirty]
                for lid in todo:
                    del dirty[lid]
            ended.clear()
            for lid in todo:
                v = leases[lid]
                complete = v.complete
                new = v.new  # finished since this lease's last write, in finishing order
                if new:
                    v.new = []
                    self._flush_rows(v, new, post)
                if complete:
                    del leases[lid]
                    lanes[v.lane] = 0
                    self.settle_lease(v)
                    self.rec.span("COMPUTE", len(v.done), v.start, time.time(), v.version,
                                  self.gate.step_of(v.rows[0]) if self.gate else None,
                                  lane=v.lane)

        def cancels() -> list[int]:
            """In-flight rows removed from the store since the last pull (and, with
            first_ready, rows started with a version no train step may take any more)."""
            self.cancel_hopeless((r, leases[lid].version) for r, lid in row_lease.items())
            out = []
            for r in self.cancel_queue:
                lid = row_lease.pop(int(r), None)
                if lid is not None:
                    v = leases[lid]
                    v.cancelled.add(int(r))
                    out.append(int(r))
                    dirty[lid] = None
                    if v.complete:
                        ended.append(lid)
            self.cancel_queue = []
            if out:
                now = time.time()
                self.rec.span("CANCEL", len(out), now, now)
                self.in_flight -= len(out)
                self.rec.occupancy(min(1.0, self.in_flight / slots))
                flush_done()
            return out

        def pull(n: int):
            if self.sync():
                raise Stop()
            flush_done()
            gone = cancels()
            extra = {"_cancel": gone} if gone else {}
            if n <= 0 or time.time() - last_empty[0] < self.backoff:
                return extra
            batches: list[dict] = []
            for got in self.lease_slots(n, pre, read):
                if got is None:  # a READ found nothing
                    if not batches:
                        last_empty[0] = time.time()
                    break
                v = got[0]
                self.inject(self.step_of_rows(v.rows), v.rows)
                lane = lanes.index(0) if 0 in lanes else len(lanes)
                if lane == len(lanes):
                    lanes.append(1)
                lanes[lane] = 1
                v.start, v.lane = time.time(), lane
                leases[v.lease.id] = v
                for r in v.rows:
                    row_lease[r] = v.lease.id
                self.in_flight += len(v.rows)
                batches.append(self.to_roles(v.lease.columns))
            if not batches:
                return extra
            self.rec.occupancy(min(1.0, self.in_flight / slots))
            cols = batches[0] if len(batches) == 1 else {
                k: [x for b in batches for x in b[k]] for k in batches[0]}
            return {**cols, **extra}

        def emit(row: dict) -> None:
            self.check()
            r = int(row["_row"])
            lid = row_lease.pop(r, None)
            if lid is None:  # cancelled while the engine finished it: never written
                return
            row = self.nan(r // self.st.samples_per_step, row)
            self.progress += 1
            v = leases[lid]
            v.done[r] = row
            v.new.append(r)
            dirty[lid] = None
            self.in_flight -= 1
            self.rec.occupancy(min(1.0, self.in_flight / slots))
            if v.complete:
                ended.append(lid)
                flush_done()

        try:
            eng.serve(pull, emit)
        except Stop:
            pass
