"""The ``serve`` loop (a mixin of :class:`asyncflow.runtime.loops.state.Loop`): a rollout
engine with ``serve(pull, emit)`` does continuous batching across steps, and the loop is its
two callbacks, written once for every host.

- :meth:`ServeLoop.serve_pull` (``pull(n)``, ``n`` the engine's free slots): the stop flag;
  the finished samples written (:meth:`ServeLoop.flush_served`); rows removed from the store
  while in flight cancelled (:meth:`ServeLoop.cancel_served`: handed to the engine as
  ``_cancel``; with first_ready, samples no train step may take any more too); newer weights
  taken up (the ADOPT op: ``on_update: finish`` defers them while samples are in flight); then
  the ops up to the READ, a lease of at most ``chunk`` rows at a time, until the free slots --
  and those the cancels freed -- are filled or a READ finds nothing.
- :meth:`ServeLoop.serve_emit` (``emit(row)``): a finished sample is noted; the finished
  samples of a lease are written (the ops after COMPUTE: its WRITE) by the first pull
  ``flush_s`` seconds after the last write (``flush_s`` 0: as each finishes), and a lease whose
  rows are all done or cancelled is written and ends at once (:meth:`ServeLoop.settle_lease`).

The host says what differs between real and virtual time through the hooks below (defaults:
the real host's): :meth:`~asyncflow.runtime.loops.state.Loop.clock`,
:meth:`ServeLoop.updating_weights` (a pull waits while the engine takes up new weights),
:meth:`ServeLoop.may_pull` (after a READ that found nothing, the real host backs off for
``backoff_s``; the simulator waits for the store to change) and :meth:`ServeLoop.pulled`.
The real host hands both callbacks to its engine (:meth:`ServeLoop.loop_serve`); the simulator
is a simulated engine that calls them from its event queue (:mod:`asyncflow.simulate.workers`,
``ServeWorker``).
"""
from __future__ import annotations

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


class Serving:
    """A serve loop's state while its engine serves: its ops split at the READ, the engine's
    ``slots``, the leases in flight and which lease each row in flight is of, the leases with
    rows finished or cancelled since a write (``dirty``) and those that ended, the trace lanes
    of concurrent leases, when it last wrote and when a READ last found nothing."""

    def __init__(self, body: list[Op], slots: int, flush_s: float):
        k = next(i for i, op in enumerate(body) if op.kind == "READ")
        self.pre, self.read = body[:k + 1], body[k]  # WAIT, ADOPT, READ
        self.post = [op for op in body[k + 1:] if op.kind != "COMPUTE"]  # WRITE
        self.slots = max(1, int(slots))
        self.flush_s = flush_s
        self.leases: dict[int, InFlight] = {}  # lease id -> the lease in flight
        self.row_lease: dict[int, int] = {}  # row in flight -> its lease id
        self.dirty: dict[int, None] = {}  # leases with rows finished or cancelled since a write
        self.ended: list[int] = []  # leases whose rows are all finished or cancelled
        self.lanes: list[int] = []  # lane -> 1 busy / 0 free
        self.last_flush = 0.0
        self.last_empty = 0.0

    def lane(self) -> int:
        """A free trace lane for a lease, now busy."""
        lanes = self.lanes
        i = lanes.index(0) if 0 in lanes else len(lanes)
        if i == len(lanes):
            lanes.append(1)
        lanes[i] = 1
        return i


class ServeLoop:
    """The serve loop's callbacks and rules; the state is the
    :class:`~asyncflow.runtime.loops.state.Loop`'s and its :class:`Serving`'s."""

    serving: Serving | None = None

    # ------------------------------------------------------------------ host hooks
    def updating_weights(self) -> bool:
        """Whether the engine is taking up new weights now (a pull then leases nothing). The
        real engine's update blocks the pull that adopts, so never."""
        return False

    def may_pull(self, n: int) -> bool:
        """Whether a pull for ``n`` free slots reads the store now: a real host backs off for
        ``backoff_s`` after a READ that found nothing."""
        return n > 0 and self.clock() - self.serving.last_empty >= self.backoff

    def pulled(self, asked: int, got: int, first: bool) -> None:
        """A pull's READ asked for ``asked`` rows and leased ``got`` (0: it found nothing;
        ``first``: nothing was leased before it in this pull)."""
        if not got and first:
            self.serving.last_empty = self.clock()

    # ------------------------------------------------------------------ the loop
    def start_serving(self, slots: int) -> Serving:
        """The serve loop's state for an engine of ``slots`` slots (before its first pull)."""
        self.serving = Serving(self.body, slots, float(self.opt.get("flush_s", 0.005)))
        return self.serving

    def loop_serve(self) -> None:
        """The real host: the engine's ``serve(pull, emit)`` calls :meth:`serve_pull` and
        :meth:`serve_emit` until the run stops."""
        eng = self.engine
        self.start_serving(int(getattr(eng, "slots", 64)))
        try:
            eng.serve(self.serve_pull, self.serve_emit)
        except Stop:
            pass

    def serve_pull(self, n: int) -> dict:
        """``pull(n)``: the module docstring. Returns the new rows' columns (by role) and, under
        ``_cancel``, the rows in flight the engine drops; raises Stop when the run stops."""
        s = self.serving
        if self.sync():
            raise Stop()
        self.flush_served()
        gone = self.cancel_served()
        extra = {"_cancel": gone} if gone else {}
        if self.newer:  # newer weights offered: the ADOPT op (on_update says whether now)
            self.enter("ADOPT")
            self.op_adopt(s.read, {"pull": n})
            self.enter("COMPUTE")
        if self.updating_weights():
            return extra
        n += len(gone)  # the slots this pull's cancels free
        if not self.may_pull(n):
            return extra
        batches: list[dict] = []
        for v in self.lease_slots(n, s.pre, s.read):
            if v is None:
                break
            if self.faults:
                self.inject(self.step_of_rows(v.rows), v.rows)
            v.start, v.lane = self.clock(), s.lane()
            s.leases[v.lease.id] = v
            for r in v.rows:
                s.row_lease[r] = v.lease.id
            self.in_flight += len(v.rows)
            batches.append(self.to_roles(v.lease.columns))
        if not batches:
            return extra
        self.rec.occupancy(min(1.0, self.in_flight / s.slots))
        cols = batches[0] if len(batches) == 1 else {
            k: [x for b in batches for x in b[k]] for k in batches[0]}
        cols.update(extra)  # (a new dict: to_roles makes one)
        return cols

    def lease_slots(self, n: int, pre: list[Op], read: Op):
        """A pull's leases for ``n`` free slots, at most ``read.chunk`` rows each: the ops up to
        the READ (WAIT, ADOPT, READ) run for each lease. Yields each lease in flight; then None
        if a READ found nothing before the slots were filled (:meth:`pulled` hears of each)."""
        first = True
        while n > 0:
            it: dict = {"pull": min(n, read.chunk or read.rows)}
            for op in pre:
                self.enter(op.kind)
                if not self.ops[op.kind](op, it):
                    self.enter("COMPUTE")
                    self.pulled(it["pull"], 0, first)
                    yield None
                    return
            self.enter("COMPUTE")
            v = InFlight(it["lease"], self.current_version())
            self.pulled(it["pull"], len(v.rows), first)
            first = False
            n -= len(v.rows)
            yield v

    def serve_emit(self, row: dict) -> None:
        """``emit(row)``: a finished sample (``_row``, ``_version``, its output roles). One
        cancelled while the engine finished it is never written."""
        self.check()
        s = self.serving
        r = int(row["_row"])
        lid = s.row_lease.pop(r, None)
        if lid is None:
            return
        if self.faults:
            row = self.nan(r // self.st.samples_per_step, row)
        self.progress += 1
        v = s.leases[lid]
        v.done[r] = row
        v.new.append(r)
        s.dirty[lid] = None
        self.in_flight -= 1
        self.rec.occupancy(min(1.0, self.in_flight / s.slots))
        if v.complete:
            s.ended.append(lid)
            self.flush_served()
        elif not s.flush_s:  # flush_s 0: each sample is written as it finishes
            self.flush_served()

    def cancel_served(self) -> list[int]:
        """In-flight rows removed from the store since the last pull (and, with first_ready,
        rows started with a version no train step may take any more): no longer in flight,
        their leases written or ended; returns them (the engine's ``_cancel``)."""
        if not self.cancel_queue and not self.hopeless:
            return []  # (most pulls)
        s = self.serving
        leases, row_lease = s.leases, s.row_lease
        if self.hopeless:
            self.cancel_hopeless((r, leases[lid].version) for r, lid in row_lease.items())
        out = []
        for r in self.cancel_queue:
            lid = row_lease.pop(int(r), None)
            if lid is not None:
                v = leases[lid]
                v.cancelled.add(int(r))
                out.append(int(r))
                s.dirty[lid] = None
                if v.complete:
                    s.ended.append(lid)
        self.cancel_queue = []
        if out:
            now = self.clock()
            self.rec.span("CANCEL", len(out), now, now)
            self.in_flight -= len(out)
            self.rec.occupancy(min(1.0, self.in_flight / s.slots))
            self.flush_served()
        return out

    def flush_served(self) -> None:
        """Write finished samples: a lease's new ones every ``flush_s`` (one ack of those rows;
        the rest stay leased), and end a lease whose rows are all done or cancelled, at once.
        Only the leases that changed are visited (thousands may be in flight); those that
        ended first, in the order they ended."""
        s = self.serving
        now = self.clock()
        due = now - s.last_flush >= s.flush_s
        if due:
            s.last_flush = now
        if not s.dirty and not s.ended:  # nothing finished since the last write (most pulls)
            return
        if due:
            todo = list(dict.fromkeys(s.ended + list(s.dirty))) if s.ended else list(s.dirty)
            s.dirty.clear()
        else:
            todo = list(s.ended)
            for lid in todo:
                s.dirty.pop(lid, None)
        s.ended.clear()
        for lid in todo:
            v = s.leases[lid]
            complete = v.complete
            new = v.new  # finished since this lease's last write, in finishing order
            if new:
                v.new = []
                self.write_served(v, new, s.post)
            if complete:
                del s.leases[lid]
                s.lanes[v.lane] = 0
                self.settle_lease(v)
                self.rec.span("COMPUTE", len(v.done), v.start, self.clock(), v.version,
                              self.gate.step_of(v.rows[0]) if self.gate else None,
                              lane=v.lane)

    def write_served(self, v: InFlight, rows: list[int], post: list[Op]) -> None:
        """Run the ops after COMPUTE (its WRITE) on finished ``rows`` of lease ``v`` (acked as
        some of the lease's rows: the lease ends with its last)."""
        cols = self.served_fields(v, rows)
        versions = [v.done[r].get("_version", v.version) for r in rows]
        self.check()
        # the lease's every row, in its order (one-row leases: a freed slot's): one plain ack
        it = {"lease": v.lease, "rows": rows, "out": cols, "versions": versions,
              "version": min(versions), "end": self.clock(), "partial": rows != v.rows}
        for op in post:
            self.enter(op.kind)
            if not self.ops[op.kind](op, it):
                break
        self.enter("COMPUTE")

    def served_fields(self, v: InFlight, rows: list[int]) -> dict:
        """The task's output fields of finished ``rows`` of lease ``v``, from the engine's
        emitted rows (keyed by role), checked."""
        return self.to_fields({r: [v.done[x].get(r) for x in rows] for _, r in self.roles_out},
                              rows)

    # ------------------------------------------------------------------ its rules
    def cancel_hopeless(self, flight) -> None:
        """first_ready: samples in flight (``flight``: (row, version started with) pairs) that
        no train step may take any more are removed and queued for cancelling."""
        if self.hopeless and self.newest - self.gate.alpha > 0:
            oldest = self.newest - self.gate.alpha
            late = [r for r, version in flight if (version or 0) < oldest]
            if late:
                self.remove_rows(late, "staleness")
                self.cancel_queue.extend(late)

    def settle_lease(self, v: InFlight) -> None:
        """A lease whose rows are all done or cancelled ends: its cancelled rows are consumed
        unwritten (acked without outputs)."""
        if v.cancelled:
            self.store.ack_rows(v.lease.id, sorted(v.cancelled))
        self.unhold(v.lease.id)
