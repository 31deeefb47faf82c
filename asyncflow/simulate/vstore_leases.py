"""The lease lifecycle of :class:`~asyncflow.simulate.vstore.VStore` (:class:`VLeases`, one of
its bases): ack, partial acks and releases, renewals, revokes and expiry, with the rules of the
in-process store (rule 4 of :mod:`asyncflow.runtime.store.local`); a row given back is checked
into its task's eligible set again. The state it changes is the VStore's own
(docs/architecture.md, "The simulator")."""
from __future__ import annotations

from heapq import heappop, heappush

from asyncflow.runtime.store.common import Lease, StoreError
from asyncflow.simulate.vstore_task import VLease, VTask


class VLeases:
    """:class:`~asyncflow.simulate.vstore.VStore`'s lease methods."""

    def _acked(self, lease_id) -> VLease | None:
        rec = self._leases.get(getattr(lease_id, "id", lease_id))
        if rec is None:
            self._counters["stale_acks"] += 1
        return rec

    def _consume(self, t: VTask, pos: list[int], rows: list[int]) -> None:
        held, consumed, done = t.held, t.consumed, self._done
        ntasks = len(self._tasks)
        for p in pos:
            held[p] = 0
            consumed[p] = 1
            done[p] += 1
            if done[p] >= ntasks:
                self._gc_cand.append(p)
        t.n_held -= len(pos)
        t.n_consumed += len(pos)
        t.order.append((self._clock(), rows))

    def ack(self, lease_id: int | Lease, columns: dict[str, list] | None = None) -> bool:
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
        return [self.ack(lid) for lid in lease_ids]

    def _part(self, rec: VLease, rows) -> tuple[list[int], list[int]]:
        """(positions of ``rows``, in their order; indices of ``rec``'s rows it keeps)."""
        if len(rows) == 1:  # a serve loop settles one sample at a time
            r = int(rows[0])
            try:
                i = rec.rows.index(r)
            except ValueError:
                raise StoreError(f"row {r} is not in lease {rec.id}") from None
            return [rec.pos[i]], [j for j in range(len(rec.rows)) if j != i]
        at = {r: i for i, r in enumerate(rec.rows)}
        try:
            idx = [at[int(r)] for r in rows]
        except KeyError as e:
            raise StoreError(f"row {e.args[0]} is not in lease {rec.id}") from None
        gone = set(idx)
        return [rec.pos[i] for i in idx], [i for i in range(len(rec.rows)) if i not in gone]

    def _shrink(self, rec: VLease, keep: list[int]) -> None:
        if not keep:
            del self._leases[rec.id]
            return
        rec.pos = [rec.pos[i] for i in keep]
        rec.rows = [rec.rows[i] for i in keep]

    def ack_rows(self, lease_id: int | Lease, rows: list[int],
                 columns: dict[str, list] | None = None) -> bool:
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

    def _unhold(self, t: VTask, pos: list[int]) -> None:
        held = t.held
        for p in pos:
            held[p] = 0
        t.n_held -= len(pos)
        self._recheck(t, pos)
        self._changed()

    def release(self, lease_id: int | Lease) -> bool:
        with self._cv:
            rec = self._leases.pop(getattr(lease_id, "id", lease_id), None)
            if rec is None:
                return False
            self._unhold(rec.task, rec.pos)
            return True

    def release_rows(self, lease_id: int | Lease, rows: list[int]) -> bool:
        with self._cv:
            rec = self._leases.get(getattr(lease_id, "id", lease_id))
            if rec is None:
                return False
            pos, keep = self._part(rec, rows)
            self._unhold(rec.task, pos)
            self._shrink(rec, keep)
            return True

    def live(self, lease_id: int | Lease) -> bool:
        with self._cv:
            return getattr(lease_id, "id", lease_id) in self._leases

    def lease_rows(self, lease_id: int | Lease) -> list[int] | None:
        with self._cv:
            rec = self._leases.get(getattr(lease_id, "id", lease_id))
            return None if rec is None else list(rec.rows)

    def renew(self, lease_id: int | Lease, lease_s: float | None = None) -> bool:
        with self._cv:
            return self._renew(self._clock(), getattr(lease_id, "id", lease_id), lease_s)

    def _renew(self, now: float, lid: int, lease_s) -> bool:
        rec = self._leases.get(int(lid))
        if rec is None:
            return False
        rec.deadline = now + (self.lease_s if lease_s is None else lease_s)
        heappush(self._heap, (rec.deadline, rec.id))
        return True

    def renew_many(self, lease_ids: list[int], lease_s: float | None = None) -> int:
        with self._cv:
            now = self._clock()
            return sum(self._renew(now, lid, lease_s) for lid in lease_ids)

    def revoke(self, owner: str) -> int:
        with self._cv:
            gone = [rec for rec in self._leases.values() if rec.owner == owner]
            for rec in gone:
                del self._leases[rec.id]
                self._unhold(rec.task, rec.pos)
            self._counters["leases_revoked"] += len(gone)
            self._counters["leases_reissued"] += len(gone)
            return len(gone)

    def expire(self, now: float | None = None) -> int:
        with self._cv:
            return self._expire_locked(self._clock() if now is None else now)

    def _expire_locked(self, now: float) -> int:
        count = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, lid = heappop(heap)
            rec = self._leases.get(lid)
            if rec is None or rec.deadline != deadline:
                continue
            del self._leases[lid]
            self._unhold(rec.task, rec.pos)
            self._counters["leases_reissued"] += 1
            self._counters["rows_reissued"] += len(rec.pos)
            count += 1
        return count


__all__ = ["VLeases"]
