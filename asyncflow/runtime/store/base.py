"""What the two in-process stores share, written once: :class:`StoreBase`, a base of
:class:`~asyncflow.runtime.store.local.SampleStore` (numpy marks scanned on a read) and of the
simulator's :class:`~asyncflow.simulate.vstore.VStore` (per-task indexes of the eligible rows,
docs/architecture.md, "The simulator").

It holds the methods whose logic does not depend on how a store keeps its marks: the lease
lookups and the lease lifecycle (ack, release, renew, revoke, expiry: rule 4 of
:mod:`asyncflow.runtime.store.local`), ``write``, task registration, the inspection methods and
the plain-data frame of a snapshot. Each store supplies the parts that differ, on ``self``:

- state: ``_cv`` (the store's condition), ``_clock``, ``lease_s``, ``_leases`` (lease id ->
  record with ``id, task, pos, rows, deadline, owner, counted``), ``_heap`` ((deadline, lease
  id)), ``_tasks`` (name -> task marks with ``inputs``, ``order``, ``n_consumed``, ``n_held``),
  ``_counters``, ``_drops``, ``_next_row``, ``_next_lease``, ``lease_s``;
- methods: ``_positions(rows)``, ``_write_pos(pos, columns)``, ``_consume(task, pos, rows)``,
  ``_part(rec, rows)`` and ``_shrink(rec, keep)`` (a lease's partial ack or release),
  ``_unhold(task, pos)`` (held rows go back unconsumed), ``_new_task(name, inputs)``, and the
  counts ``_n_rows()``, ``_n_freed()``, ``_n_ready(task)``, ``_n_ready_below(task, max_row, cap)``.
"""
from __future__ import annotations

import threading
from collections import Counter
from heapq import heappop, heappush
from typing import Callable

from asyncflow.runtime.store.common import SNAPSHOT_FORMAT, Lease, StoreError

STAT_COUNTERS = ("leases_reissued", "rows_reissued", "stale_acks", "stale_writes",
                 "leases_restored", "leases_revoked")


class StoreBase:
    """The methods both in-process stores share (module docstring)."""

    def _init_state(self, lease_s: float, clock: Callable[[], float]) -> None:
        """The state every in-process store keeps the same way (its rows and marks are its own)."""
        self.lease_s = float(lease_s)
        self._clock = clock
        self._cv = threading.Condition()
        self._next_row = 0
        self._data: dict[str, list] = {}  # field -> values by position
        self._tasks: dict = {}  # task name -> its marks
        self._leases: dict = {}  # lease id -> live lease record
        self._heap: list[tuple[float, int]] = []  # (deadline, lease id)
        self._next_lease = 1
        self._drops: Counter = Counter()
        self._counters: Counter = Counter()  # leases_reissued, rows_reissued, stale_acks, ...
        self._changes = 0  # bumped whenever rows may have become eligible (long polls watch it)
        self._no_waits = False  # the run is stopping: reads and long polls no longer wait

    def stop_waits(self) -> None:
        """The run is stopping: every read or long poll waiting now returns at once, and later
        ones do not wait (a worker blocked in a long read hears of the stop at once)."""
        with self._cv:
            self._no_waits = True
            self._cv.notify_all()

    @property
    def waits_stopped(self) -> bool:
        """:meth:`stop_waits` was called."""
        return self._no_waits

    def _record(self, lease_id: int | Lease):
        """The live lease record ``lease_id`` names (a :class:`Lease` or its id), else None."""
        return self._leases.get(getattr(lease_id, "id", lease_id))

    # ------------------------------------------------------------------ tasks, writing
    def _task(self, task: str):
        try:
            return self._tasks[task]
        except KeyError:
            raise StoreError(f"unknown task {task!r}; register_task it first") from None

    def register_task(self, task: str, inputs: list[str]) -> None:
        """Declare a consuming task and the fields a row needs before the task may get it."""
        inputs = tuple(inputs)
        with self._cv:
            t = self._tasks.get(task)
            if t is not None:
                if t.inputs != inputs:
                    raise StoreError(f"task {task!r} already registered with inputs {list(t.inputs)}")
                return
            self._new_task(task, inputs)

    def write(self, rows: list[int], columns: dict[str, list], *, lease_id: int | None = None) -> bool:
        """Set fields on existing rows (their ready bits). Each field once per row (rule 1).

        With ``lease_id``: only while that lease is live; a stale holder's write is ignored,
        counted (``stale_writes``) and answered False.
        """
        with self._cv:
            if lease_id is not None and lease_id not in self._leases:
                self._counters["stale_writes"] += 1
                return False
            self._write_pos(self._positions(rows), columns)
            return True

    def start_rows_at(self, first_row: int) -> None:
        """Number the next rows from ``first_row`` on (at least): a resumed run's rows before
        the trainer's next window were trained before its checkpoint."""
        with self._cv:
            self._next_row = max(self._next_row, int(first_row))

    # ------------------------------------------------------------------ lease lifecycle
    def ack(self, lease_id: int | Lease, columns: dict[str, list] | None = None) -> bool:
        """Consume a lease's rows for its task (rule 4); ``columns``: the task's outputs for those
        rows (lease order), written in the same step. False (and counted) if the lease is stale."""
        with self._cv:
            rec = self._acked(lease_id)
            if rec is None:
                return False
            if columns:
                self._write_pos(rec.pos, columns)
            del self._leases[rec.id]
            self._consume(rec.task, rec.pos, rec.rows)
            return True

    def ack_many(self, lease_ids: list) -> list[bool]:
        """:meth:`ack` (no columns) of each lease in turn: a trainer's micro-batch leases at the
        end of its step, one call."""
        return [self.ack(lid) for lid in lease_ids]

    def _acked(self, lease_id: int | Lease):
        """The live lease an ack names; None (counted as a stale ack) if it is not live."""
        rec = self._record(lease_id)
        if rec is None:
            self._counters["stale_acks"] += 1
        return rec

    def ack_rows(self, lease_id: int | Lease, rows: list[int],
                 columns: dict[str, list] | None = None) -> bool:
        """:meth:`ack` of some of a live lease's rows (``columns`` for those rows, in ``rows``'
        order): they are written and consumed now, the rest stay leased (a continuous-batching
        rollout writes each sample as it finishes). The lease ends with its last row. False
        (and counted, as a stale ack) if the lease is not live; rows it does not hold are a
        StoreError."""
        with self._cv:
            rec = self._acked(lease_id)
            if rec is None:
                return False
            pos, keep = self._part(rec, rows)
            if columns:
                self._write_pos(pos, columns)
            self._consume(rec.task, pos, [int(r) for r in rows])
            self._shrink(rec, keep)
            return True

    def release(self, lease_id: int | Lease) -> bool:
        """Give a lease's rows back unconsumed. False if the lease is not live."""
        with self._cv:
            rec = self._leases.pop(getattr(lease_id, "id", lease_id), None)
            if rec is None:
                return False
            self._unhold(rec.task, rec.pos)
            return True

    def release_rows(self, lease_id: int | Lease, rows: list[int]) -> bool:
        """Give some of a live lease's rows back unconsumed; the rest stay leased."""
        with self._cv:
            rec = self._record(lease_id)
            if rec is None:
                return False
            pos, keep = self._part(rec, rows)
            self._unhold(rec.task, pos)
            self._shrink(rec, keep)
            return True

    def live(self, lease_id: int | Lease) -> bool:
        """Whether lease ``lease_id`` is live (not acked, released, expired or revoked)."""
        with self._cv:
            return getattr(lease_id, "id", lease_id) in self._leases

    def lease_rows(self, lease_id: int | Lease) -> list[int] | None:
        """The rows lease ``lease_id`` still holds (None when it is not live)."""
        with self._cv:
            rec = self._record(lease_id)
            return None if rec is None else list(rec.rows)

    def renew(self, lease_id: int | Lease, lease_s: float | None = None) -> bool:
        """Push a live lease's deadline out (a heartbeat for long computations)."""
        with self._cv:
            return self._renew(self._clock(), getattr(lease_id, "id", lease_id), lease_s)

    def _renew(self, now: float, lid: int, lease_s: float | None) -> bool:
        rec = self._leases.get(int(lid))
        if rec is None:
            return False
        rec.deadline = now + (self.lease_s if lease_s is None else lease_s)
        heappush(self._heap, (rec.deadline, rec.id))
        return True

    def renew_many(self, lease_ids: list[int], lease_s: float | None = None) -> int:
        """:meth:`renew` of many leases in one call (a worker's heartbeat); returns how many
        were still live."""
        with self._cv:
            now = self._clock()
            return sum(self._renew(now, lid, lease_s) for lid in lease_ids)

    def revoke(self, owner: str) -> int:
        """Give back, unconsumed, every live lease of worker ``owner`` (it died: its rows are
        eligible again at once, not when the leases expire). Counted as ``leases_revoked`` and,
        like an expiry (rule 4), as ``leases_reissued``. Returns how many were revoked."""
        with self._cv:
            gone = [rec for rec in self._leases.values() if rec.owner == owner]
            for rec in gone:
                del self._leases[rec.id]
                self._unhold(rec.task, rec.pos)
            n = sum(rec.counted for rec in gone)
            self._counters["leases_revoked"] += n
            self._counters["leases_reissued"] += n  # their rows go out again, as on expiry
            return n

    def expire(self, now: float | None = None) -> int:
        """Re-issue the rows of every lease past its deadline; returns how many leases expired."""
        with self._cv:
            return self._expire_locked(self._clock() if now is None else now)

    def _expire_locked(self, now: float) -> int:
        count = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, lid = heappop(heap)
            rec = self._leases.get(lid)
            if rec is None or rec.deadline != deadline:  # acked, released or renewed
                continue
            del self._leases[lid]
            self._unhold(rec.task, rec.pos)
            self._counters["leases_reissued"] += rec.counted
            self._counters["rows_reissued"] += len(rec.pos)
            count += rec.counted
        return count

    # ------------------------------------------------------------------ inspection
    def consumed(self, task: str) -> list[int]:
        """Rows consumed by ``task``, in consumption (ack) order."""
        with self._cv:
            return [r for _, rows in self._task(task).order for r in rows]

    def consumed_log(self, task: str) -> list[tuple[float, list[int]]]:
        """(ack time, rows) per ack of ``task`` (the sharded store merges these by time)."""
        with self._cv:
            return [(ts, list(rows)) for ts, rows in self._task(task).order]

    def drop_counts(self) -> dict[str, int]:
        """Rows dropped so far, by reason (cheaper than :meth:`stats`)."""
        with self._cv:
            return {k: int(v) for k, v in self._drops.items() if v}

    def pending(self, task: str) -> int:
        """Rows eligible for ``task`` right now (ready, not consumed, leased or dropped)."""
        with self._cv:
            return self._n_ready(self._task(task))

    def pending_below(self, task: str, max_row: int, cap: int) -> int:
        """:meth:`pending`'s rows below ``max_row``, at most ``cap`` (the simulator's
        trainer waits for its step's rows: the next step's, eligible too, do not count)."""
        with self._cv:
            return self._n_ready_below(self._task(task), int(max_row), int(cap))

    def stats(self) -> dict:
        with self._cv:
            c = self._counters
            return {
                "rows": self._n_rows(),
                "freed": self._n_freed(),
                "tasks": {name: {"consumed": t.n_consumed, "leased": t.n_held,
                                 "ready": self._n_ready(t)} for name, t in self._tasks.items()},
                "drops": dict(self._drops),
                "leases_live": sum(rec.counted for rec in self._leases.values()),
                **{k: c[k] for k in STAT_COUNTERS},
            }

    # ------------------------------------------------------------------ checkpoint
    def _snapshot_frame(self, rows: list, groups: list, versions: list, fields: dict,
                        dropped: list, freed: list) -> dict:
        """:meth:`snapshot`'s plain data around the store's rows (which it gives as lists)."""
        return {
            "format": SNAPSHOT_FORMAT,
            "lease_s": self.lease_s,
            "next_row": self._next_row,
            "next_lease": self._next_lease,
            "rows": rows,
            "groups": groups,
            "versions": versions,
            "fields": fields,
            "dropped": dropped,
            "freed": freed,
            "drops": dict(self._drops),
            "tasks": {
                name: {"inputs": list(t.inputs), "consumed": [[ts, list(r)] for ts, r in t.order]}
                for name, t in self._tasks.items()
            },
            "leases": [
                {"id": rec.id, "task": rec.task.name, "rows": list(rec.rows), "counted": rec.counted}
                for rec in self._leases.values()
            ],
            "counters": dict(self._counters),
        }

    @staticmethod
    def check_snapshot(d: dict) -> None:
        """A snapshot of another format is a StoreError."""
        if d.get("format") != SNAPSHOT_FORMAT:
            raise StoreError(f"snapshot format {d.get('format')!r} is not {SNAPSHOT_FORMAT}")

    def _restore_counts(self, d: dict) -> None:
        """Drops, counters and numbering from snapshot ``d`` (rule 6: its leases in flight
        come back unleased, counted as ``leases_restored``)."""
        self._drops.update(d["drops"])
        self._counters.update(d.get("counters", {}))
        self._counters["leases_restored"] += sum(bool(x.get("counted", True)) for x in d["leases"])
        self._next_row = max(self._next_row, d["next_row"])
        self._next_lease = d["next_lease"]


__all__ = ["StoreBase", "STAT_COUNTERS"]
