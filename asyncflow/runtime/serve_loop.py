"""The ``serve`` loop of :class:`asyncflow.runtime.worker.Worker` (a mixin of it): a rollout
engine with ``serve(pull, emit)`` does continuous batching across steps. ``pull`` runs the ops
up to the READ (at most ``chunk`` rows a lease), the engine computes, and a lease whose rows are
all done (or cancelled) runs the ops after COMPUTE (its WRITE), row by row as they finish."""
from __future__ import annotations

import time

from asyncflow.plan import Op
from asyncflow.runtime.signals import Stop


class ServeLoop:
    """``Worker._loop_serve`` and what it alone uses; the state is the Worker's."""

    def _flush_rows(self, v: dict, rows: list[int], post: list[Op]) -> None:
        """Run a serve loop's ops after COMPUTE (its WRITE) on finished ``rows`` of lease
        ``v`` (acked as some of the lease's rows: the lease ends with its last)."""
        cols = self._to_fields({r: [v["done"][x].get(r) for x in rows]
                                for _, r in self.roles_out}, rows)
        versions = [v["done"][r].get("_version", v["version"]) for r in rows]
        self._check()
        it = {"lease": v["lease"], "rows": rows, "out": cols, "versions": versions,
              "version": min(versions), "end": time.time(), "partial": True}
        for op in post:
            self._enter(op.kind)
            if not self.ops[op.kind](op, it):
                break
        self._enter("COMPUTE")

    def _loop_serve(self) -> None:
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
        leases: dict[int, dict] = {}  # lease id -> {"lease", "done": {row: outputs}, ...}
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
                rows = v["rows"]
                complete = len(v["done"]) + len(v["cancelled"]) == len(rows)
                new = v["new"]  # finished since this lease's last write, in finishing order
                if new:
                    v["new"] = []
                    self._flush_rows(v, new, post)
                if complete:
                    del leases[lid]
                    lanes[v["lane"]] = 0
                    if v["cancelled"]:  # dropped rows: consumed unwritten, the lease ends
                        self.store.ack_rows(v["lease"].id, sorted(v["cancelled"]))
                    self._unhold(v["lease"].id)
                    self.rec.span("COMPUTE", len(v["done"]), v["start"], time.time(),
                                  v["version"], self.gate.step_of(rows[0]) if self.gate else None,
                                  lane=v["lane"])

        def cancels() -> list[int]:
            """In-flight rows removed from the store since the last pull (and, with
            first_ready, rows started with a version no train step may take any more)."""
            if self.hopeless and self._newest - self.gate.alpha > 0:
                oldest = self._newest - self.gate.alpha
                late = [r for r, lid in row_lease.items()
                        if (leases[lid]["version"] or 0) < oldest]
                if late:
                    self._remove(late, "staleness")
                    self._cancel_q.extend(late)
            out = []
            for r in self._cancel_q:
                lid = row_lease.pop(int(r), None)
                if lid is not None:
                    v = leases[lid]
                    v["cancelled"].add(int(r))
                    out.append(int(r))
                    dirty[lid] = None
                    if len(v["done"]) + len(v["cancelled"]) == len(v["rows"]):
                        ended.append(lid)
            self._cancel_q = []
            if out:
                now = time.time()
                self.rec.span("CANCEL", len(out), now, now)
                self._in_flight -= len(out)
                self.rec.occupancy(min(1.0, self._in_flight / slots))
                flush_done()
            return out

        def pull(n: int):
            if self._sync():
                raise Stop()
            flush_done()
            gone = cancels()
            extra = {"_cancel": gone} if gone else {}
            if n <= 0 or time.time() - last_empty[0] < self.backoff:
                return extra
            batches: list[dict] = []
            while n > 0:  # leases of at most ``chunk`` rows until the free slots are filled
                it: dict = {"pull": min(n, read.chunk or read.rows)}
                ok = True
                for op in pre:
                    self._enter(op.kind)
                    if not self.ops[op.kind](op, it):
                        ok = False
                        break
                self._enter("COMPUTE")
                if not ok:
                    if not batches:
                        last_empty[0] = time.time()
                    break
                self._inject(self._step_of_rows(it["rows"]), it["rows"])
                lease = it["lease"]
                lane = lanes.index(0) if 0 in lanes else len(lanes)
                if lane == len(lanes):
                    lanes.append(1)
                lanes[lane] = 1
                leases[lease.id] = {"lease": lease, "rows": list(lease.rows), "done": {},
                                    "cancelled": set(), "new": [], "start": time.time(),
                                    "version": self._version(), "lane": lane}
                for r in lease.rows:
                    row_lease[r] = lease.id
                self._in_flight += len(lease.rows)
                n -= len(lease.rows)
                batches.append(self._to_roles(lease.columns))
            if not batches:
                return extra
            self.rec.occupancy(min(1.0, self._in_flight / slots))
            cols = batches[0] if len(batches) == 1 else {
                k: [x for b in batches for x in b[k]] for k in batches[0]}
            return {**cols, **extra}

        def emit(row: dict) -> None:
            self._check()
            r = int(row["_row"])
            lid = row_lease.pop(r, None)
            if lid is None:  # cancelled while the engine finished it: never written
                return
            row = self._nan(r // self.st.samples_per_step, row)
            self._progress += 1
            v = leases[lid]
            v["done"][r] = row
            v["new"].append(r)
            dirty[lid] = None
            self._in_flight -= 1
            self.rec.occupancy(min(1.0, self._in_flight / slots))
            if len(v["done"]) + len(v["cancelled"]) == len(v["rows"]):
                ended.append(lid)
                flush_done()

        try:
            eng.serve(pull, emit)
        except Stop:
            pass
