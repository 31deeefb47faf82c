"""The in-process store's lease lifecycle (:class:`Leases`, a part of
:class:`~asyncflow.runtime.store.local.SampleStore`): ack, release, renew, revoke, expiry
(rule 4 of :mod:`asyncflow.runtime.store.local`) and the partial acks and trims of a sharded
store's lease parts. The state it changes is the SampleStore's own (this class is one of its
bases, not a separate object).
"""
from __future__ import annotations

import heapq

import numpy as np

from asyncflow.runtime.store.common import Lease, LeaseRecord, StoreError, TaskMarks


class Leases:
    """:class:`~asyncflow.runtime.store.local.SampleStore`'s lease methods."""

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

    def _acked(self, lease_id: int | Lease) -> LeaseRecord | None:
        """The live lease an ack names; None (counted as a stale ack) if it is not live."""
        rec = self._leases.get(getattr(lease_id, "id", lease_id))
        if rec is None:
            self._counters["stale_acks"] += 1
        return rec

    def _consume(self, t: TaskMarks, pos: np.ndarray, rows: list[int]) -> None:
        """Held positions ``pos`` (rows ``rows``) become consumed by ``t``."""
        t.held[pos] = False
        t.n_held -= len(pos)
        t.consumed[pos] = True
        t.n_consumed += len(pos)
        t.order.append((self._clock(), rows))

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

    def release_rows(self, lease_id: int | Lease, rows: list[int]) -> bool:
        """Give some of a live lease's rows back unconsumed; the rest stay leased."""
        lease_id = getattr(lease_id, "id", lease_id)
        with self._cv:
            rec = self._leases.get(lease_id)
            if rec is None:
                return False
            pos, keep = self._part(rec, rows)
            rec.task.held[pos] = False
            rec.task.n_held -= len(pos)
            self._changes += 1
            self._cv.notify_all()
            self._shrink(rec, keep)
            return True

    def _part(self, rec: LeaseRecord, rows) -> tuple[np.ndarray, np.ndarray]:
        """(positions of ``rows`` in ``rec``, in ``rows``' order; mask of the rows it keeps)."""
        at = {int(r): i for i, r in enumerate(rec.rows)}
        try:
            idx = np.asarray([at[int(r)] for r in rows], np.int64)
        except KeyError as e:
            raise StoreError(f"row {e.args[0]} is not in lease {rec.id}") from None
        keep = np.ones(len(rec.rows), bool)
        keep[idx] = False
        return rec.pos[idx], keep

    def _shrink(self, rec: LeaseRecord, keep: np.ndarray) -> None:
        if not keep.any():
            del self._leases[rec.id]
            return
        rec.pos = rec.pos[keep]
        rec.rows = [r for r, k in zip(rec.rows, keep.tolist()) if k]

    def live(self, lease_id: int | Lease) -> bool:
        """Whether lease ``lease_id`` is live (not acked, released, expired or revoked)."""
        with self._cv:
            return getattr(lease_id, "id", lease_id) in self._leases

    def lease_rows(self, lease_id: int | Lease) -> list[int] | None:
        """The rows lease ``lease_id`` still holds (None when it is not live)."""
        with self._cv:
            rec = self._leases.get(getattr(lease_id, "id", lease_id))
            return None if rec is None else list(rec.rows)

    def trim(self, lease_id: int | Lease, keep: list[int]) -> bool:
        """Give back the rows of a live lease that are not in ``keep``; the lease keeps the
        others (a sharded store's handle asked every shard for more than it took)."""
        with self._cv:
            rec = self._leases.get(getattr(lease_id, "id", lease_id))
            if rec is None:
                return False
            mask = np.isin(np.asarray(rec.rows, np.int64), np.asarray(keep, np.int64))
            back = rec.pos[~mask]
            rec.task.held[back] = False
            rec.task.n_held -= len(back)
            rec.pos = rec.pos[mask]
            rec.rows = np.asarray(rec.rows, np.int64)[mask].tolist()
            self._changes += 1
            self._cv.notify_all()
            return True

    def uncount(self, lease_id: int | Lease) -> bool:
        """Count live lease ``lease_id`` as part of a lease counted elsewhere: a sharded store's
        lease is one part per shard, and every part but the first is marked, so that counts are
        of leases, not parts (``leases_live``, ``leases_reissued``, ``leases_revoked``,
        ``leases_restored``, and what :meth:`expire` and :meth:`revoke` return). False if the
        lease is not live."""
        with self._cv:
            rec = self._leases.get(getattr(lease_id, "id", lease_id))
            if rec is None:
                return False
            rec.counted = False
            return True


    def release(self, lease_id: int | Lease) -> bool:
        """Give a lease's rows back unconsumed. False if the lease is not live."""
        lease_id = getattr(lease_id, "id", lease_id)
        with self._cv:
            rec = self._leases.pop(lease_id, None)
            if rec is None:
                return False
            self._unhold(rec)
            return True

    def renew(self, lease_id: int | Lease, lease_s: float | None = None) -> bool:
        """Push a live lease's deadline out (a heartbeat for long computations)."""
        lease_id = getattr(lease_id, "id", lease_id)
        with self._cv:
            rec = self._leases.get(lease_id)
            if rec is None:
                return False
            rec.deadline = self._clock() + (self.lease_s if lease_s is None else lease_s)
            heapq.heappush(self._heap, (rec.deadline, lease_id))
            return True

    def renew_many(self, lease_ids: list[int], lease_s: float | None = None) -> int:
        """:meth:`renew` of many leases in one call (a worker's heartbeat); returns how many
        were still live."""
        with self._cv:
            now, n = self._clock(), 0
            for lid in lease_ids:
                rec = self._leases.get(int(lid))
                if rec is None:
                    continue
                rec.deadline = now + (self.lease_s if lease_s is None else lease_s)
                heapq.heappush(self._heap, (rec.deadline, rec.id))
                n += 1
            return n

    def revoke(self, owner: str) -> int:
        """Give back, unconsumed, every live lease of worker ``owner`` (it died: its rows are
        eligible again at once, not when the leases expire). Counted as ``leases_revoked`` and,
        like an expiry (rule 4), as ``leases_reissued``. Returns how many were revoked."""
        with self._cv:
            gone = [rec for rec in self._leases.values() if rec.owner == owner]
            for rec in gone:
                del self._leases[rec.id]
                self._unhold(rec)
            n = sum(rec.counted for rec in gone)
            self._counters["leases_revoked"] += n
            self._counters["leases_reissued"] += n  # their rows go out again, as on expiry
            return n

    def _unhold(self, rec: LeaseRecord) -> None:
        rec.task.held[rec.pos] = False
        rec.task.n_held -= len(rec.pos)
        self._changes += 1
        self._cv.notify_all()

    def expire(self, now: float | None = None) -> int:
        """Re-issue the rows of every lease past its deadline; returns how many leases expired."""
        with self._cv:
            return self._expire_locked(self._clock() if now is None else now)

    def _expire_locked(self, now: float) -> int:
        count = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, lid = heapq.heappop(heap)
            rec = self._leases.get(lid)
            if rec is None or rec.deadline != deadline:  # acked, released or renewed
                continue
            del self._leases[lid]
            self._unhold(rec)
            self._counters["leases_reissued"] += rec.counted
            self._counters["rows_reissued"] += len(rec.pos)
            count += rec.counted
        return count

    def drop(self, rows: list[int], reason: str) -> int:
        """Rows no task should get (rule 5); returns how many were newly dropped."""
        with self._cv:
            pos = self._positions(rows)
            new = ~self._dropped[pos]
            k = int(np.unique(pos[new]).size)
            self._dropped[pos] = True
            self._drops[reason] += k
            return k

