"""The in-process store's own lease bookkeeping (:class:`Leases`, a part of
:class:`~asyncflow.runtime.store.local.SampleStore`): how its numpy marks change when a lease's
rows are consumed or given back, and the trims and partial counts of a sharded store's lease
parts, and drops. The lifecycle itself (ack, release, renew, revoke, expiry: rule 4 of
:mod:`asyncflow.runtime.store.local`) is :class:`~asyncflow.runtime.store.base.StoreBase`'s,
shared with the simulator's store. The state it changes is the SampleStore's own (this class is
one of its bases, not a separate object).
"""
from __future__ import annotations

import numpy as np

from asyncflow.runtime.store.common import Lease, LeaseRecord, StoreError, TaskMarks


class Leases:
    """:class:`~asyncflow.runtime.store.local.SampleStore`'s lease methods."""

    def _consume(self, t: TaskMarks, pos: np.ndarray, rows: list[int]) -> None:
        """Held positions ``pos`` (rows ``rows``) become consumed by ``t``."""
        t.held[pos] = False
        t.n_held -= len(pos)
        t.consumed[pos] = True
        t.n_consumed += len(pos)
        t.order.append((self._clock(), rows))

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

    def trim(self, lease_id: int | Lease, keep: list[int]) -> bool:
        """Give back the rows of a live lease that are not in ``keep``; the lease keeps the
        others (a sharded store's handle asked every shard for more than it took)."""
        with self._cv:
            rec = self._record(lease_id)
            if rec is None:
                return False
            mask = np.isin(np.asarray(rec.rows, np.int64), np.asarray(keep, np.int64))
            self._unhold(rec.task, rec.pos[~mask])
            rec.pos = rec.pos[mask]
            rec.rows = np.asarray(rec.rows, np.int64)[mask].tolist()
            return True

    def uncount(self, lease_id: int | Lease) -> bool:
        """Count live lease ``lease_id`` as part of a lease counted elsewhere: a sharded store's
        lease is one part per shard, and every part but the first is marked, so that counts are
        of leases, not parts (``leases_live``, ``leases_reissued``, ``leases_revoked``,
        ``leases_restored``, and what :meth:`expire` and :meth:`revoke` return). False if the
        lease is not live."""
        with self._cv:
            rec = self._record(lease_id)
            if rec is None:
                return False
            rec.counted = False
            return True

    def _unhold(self, t: TaskMarks, pos: np.ndarray) -> None:
        """Held positions ``pos`` of ``t`` go back unconsumed (eligible again)."""
        t.held[pos] = False
        t.n_held -= len(pos)
        self._changes += 1
        self._cv.notify_all()

    def drop(self, rows: list[int], reason: str) -> int:
        """Rows no task should get (rule 5); returns how many were newly dropped."""
        with self._cv:
            pos = self._positions(rows)
            new = ~self._dropped[pos]
            k = int(np.unique(pos[new]).size)
            self._dropped[pos] = True
            self._drops[reason] += k
            return k

