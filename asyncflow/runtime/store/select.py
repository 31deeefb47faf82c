"""The in-process store's reads (:class:`Reads`, a part of
:class:`~asyncflow.runtime.store.local.SampleStore`): which rows are eligible for a task, which of
them a ``get`` leases (rules 2 and 3 of :mod:`asyncflow.runtime.store.local`), the long-polling
``peek`` of the sharded store. The state it reads is the SampleStore's own (this class is one of
its bases, not a separate object).
"""
from __future__ import annotations

import heapq
from typing import Any, Callable

import numpy as np

from asyncflow.runtime.store.common import UNSET, Lease, LeaseRecord, StoreError, TaskMarks, take


class Reads:
    """:class:`~asyncflow.runtime.store.local.SampleStore`'s reading methods."""

    def _eligible(self, t: TaskMarks, max_row: int | None, min_version: int | None,
                  limit: int | None = None) -> np.ndarray:
        """Positions eligible for ``t`` (inputs ready, not consumed/held/dropped), row order.
        ``limit``: only the first ``limit`` of them are wanted (rows in position order: the
        scan stops once it has them; a read of a few rows does not mask every row ahead)."""
        n = self._n
        lo = t.floor
        while lo < n and (t.consumed[lo] or self._dropped[lo]):  # the floor: done rows below
            end = min(n, lo + 4096)
            done = t.consumed[lo:end] | self._dropped[lo:end]
            if done.all():
                lo = end
                continue
            lo += int(np.argmin(done))
            break
        t.floor = lo
        hi = n
        if max_row is not None and self._sorted:
            hi = lo + int(np.searchsorted(self._row[lo:n], max_row, "left"))
        if limit is None or not self._sorted:
            return self._scan(t, lo, hi, max_row, min_version)
        parts, found, size = [], 0, max(1024, 8 * int(limit))
        while lo < hi and found < limit:
            end = min(hi, lo + size)
            part = self._scan(t, lo, end, max_row, min_version)
            parts.append(part)
            found += len(part)
            lo, size = end, size * 4
        return parts[0] if len(parts) == 1 else (np.concatenate(parts) if parts else
                                                 np.empty(0, np.int64))

    def _scan(self, t: TaskMarks, lo: int, hi: int, max_row: int | None,
              min_version: int | None) -> np.ndarray:
        """Eligible positions in ``[lo, hi)``, row order."""
        mask = ~(t.consumed[lo:hi] | t.held[lo:hi] | self._dropped[lo:hi])
        for f in t.inputs:
            r = self._ready.get(f)
            if r is None:
                return np.empty(0, np.int64)
            mask &= r[lo:hi]
        if max_row is not None and not self._sorted:
            mask &= self._row[lo:hi] < max_row
        if min_version is not None:
            mask &= self._version[lo:hi] >= min_version
        cand = np.flatnonzero(mask) + lo
        if not self._sorted and len(cand) > 1:
            cand = cand[np.argsort(self._row[cand], kind="stable")]
        return cand

    def _select(
        self,
        t: TaskMarks,
        n: int,
        whole_groups: bool,
        group_size: int,
        max_row: int | None,
        filter_fn,
        min_version: int | None,
    ) -> np.ndarray:
        plain = filter_fn is None and not whole_groups
        cand = self._eligible(t, max_row, min_version, limit=n if plain else None)
        if filter_fn is not None and len(cand):
            keep = [
                bool(filter_fn({"_row": int(r), "_group": int(g), "_version": None if v == UNSET else int(v)}))
                for r, g, v in zip(self._row[cand].tolist(), self._group[cand].tolist(), self._version[cand].tolist())
            ]
            cand = cand[np.asarray(keep, bool)]
        if not whole_groups:
            return cand[:n]
        if group_size < 1:
            raise StoreError("group_size must be >= 1")
        n_groups = n // group_size
        if n_groups == 0 or len(cand) < group_size:
            return cand[:0]
        g = self._group[cand]
        # rank of each candidate within its group (cand is in row order)
        order = np.argsort(g, kind="stable")
        gs = g[order]
        new = np.r_[True, gs[1:] != gs[:-1]]
        starts = np.flatnonzero(new)
        sizes = np.diff(np.r_[starts, len(gs)])
        rank = np.empty(len(gs), np.int64)
        rank[order] = np.arange(len(gs)) - np.repeat(starts, sizes)
        full = np.repeat(sizes >= group_size, sizes)
        complete = np.empty(len(gs), bool)
        complete[order] = full
        keep = complete & (rank < group_size)
        cand, g = cand[keep], g[keep]
        if len(cand) == 0:
            return cand
        # whole groups in the order of their lowest row
        uniq, first = np.unique(g, return_index=True)
        chosen = uniq[np.argsort(first, kind="stable")][:n_groups]
        return cand[np.isin(g, chosen)]

    def _columns(self, pos: np.ndarray, fields) -> dict[str, list]:
        cols: dict[str, list] = {}
        for f in fields:
            col = self._data.get(f)
            cols[f] = [None] * len(pos) if col is None else take(col, pos)
        cols["_row"] = self._row[pos].tolist()
        cols["_group"] = self._group[pos].tolist()
        cols["_version"] = [None if v == UNSET else v for v in self._version[pos].tolist()]
        return cols

    def get(
        self,
        task: str,
        n: int,
        *,
        min_rows: int = 1,
        whole_groups: bool = False,
        group_size: int = 1,
        max_row: int | None = None,
        timeout: float = 0.0,
        filter_fn: Callable[[dict], Any] | None = None,
        min_version: int | None = None,
        fields: list[str] | None = None,
        lease_s: float | None = None,
        owner: str | None = None,
    ) -> Lease | None:
        """Lease up to ``n`` eligible rows for ``task`` (rules 2, 3); wait up to ``timeout`` s for
        at least ``min_rows`` of them; None if there are not that many by then.

        ``filter_fn`` is called with ``{"_row", "_group", "_version"}`` of each eligible row and
        keeps the truthy ones; ``min_version`` keeps rows with ``_version >= min_version`` (the
        vectorised form of the staleness filter). ``fields`` defaults to the task's inputs.
        ``owner``: the worker the lease is for (:meth:`revoke` gives back all of a worker's).
        """
        deadline = self._clock() + timeout
        with self._cv:
            t = self._task(task)
            got = self._wait_select(deadline, max(int(min_rows), 1), lambda: self._select(
                t, n, whole_groups, group_size, max_row, filter_fn, min_version))
            return None if got is None else self._lease_locked(t, got[0], fields, got[1],
                                                               lease_s, owner)

    def _wait_select(self, deadline: float, need: int, select):
        """Under the lock: ``select()`` until it gives at least ``need`` positions or the
        deadline passes (woken by writes, and by the next lease expiry); ``(pos, now)`` or
        None. The wait of :meth:`get` and :meth:`get_split`."""
        while True:
            now = self._clock()
            self._expire_locked(now)
            pos = select()
            if len(pos) >= need:
                return pos, now
            left = deadline - now
            if left <= 0 or self._no_waits:
                return None
            if self._heap:  # wake for the next lease expiry too
                left = min(left, max(self._heap[0][0] - now, 0.0) + 1e-3)
            self._cv.wait(left)

    def get_split(
        self,
        task: str,
        n: int,
        split: int,
        *,
        min_rows: int = 1,
        max_row: int | None = None,
        timeout: float = 0.0,
        filter_fn: Callable[[dict], Any] | None = None,
        min_version: int | None = None,
        fields: list[str] | None = None,
        lease_s: float | None = None,
        owner: str | None = None,
    ) -> list[Lease]:
        """Several reads of :meth:`get` in one call: up to ``n`` eligible rows, lowest first,
        as consecutive leases of ``split`` rows (a trainer's micro-batches: one store round
        trip instead of one per micro-batch). All ``n`` when they are ready (the last lease
        may be shorter), else as many whole leases of ``split`` rows as are ready; waits up to
        ``timeout`` s for at least ``min_rows`` (at most ``split``) of them; ``[]`` if not."""
        split = max(1, int(split))
        need = max(1, min(int(min_rows), split))
        deadline = self._clock() + timeout

        def select():  # all n, else whole leases of split rows
            pos = self._select(t, n, False, 1, max_row, filter_fn, min_version)
            return pos if len(pos) >= n else pos[:len(pos) // split * split]

        with self._cv:
            t = self._task(task)
            got = self._wait_select(deadline, need, select)
            if got is None:
                return []
            pos, now = got
            # the columns of every lease at once, then cut (not gathered lease by lease)
            cols = self._columns(pos, t.inputs if fields is None else fields)
            return [self._lease_locked(t, pos[i:i + split], fields, now, lease_s, owner,
                                       {f: v[i:i + split] for f, v in cols.items()})
                    for i in range(0, len(pos), split)]

    def _lease_locked(self, t: TaskMarks, pos: np.ndarray, fields, now: float, lease_s,
                      owner: str | None = None, cols: dict | None = None) -> Lease:
        """A lease of positions ``pos`` (their columns ``cols`` when the caller has them)."""
        lid = self._next_lease
        self._next_lease += 1
        deadline = now + (self.lease_s if lease_s is None else lease_s)
        t.held[pos] = True
        t.n_held += len(pos)
        rows = self._row[pos].tolist()
        self._leases[lid] = LeaseRecord(lid, t, pos, rows, deadline, owner)
        heapq.heappush(self._heap, (deadline, lid))
        if cols is None:
            cols = self._columns(pos, t.inputs if fields is None else fields)
        return Lease(lid, t.name, rows, cols, deadline)

    def peek(
        self,
        task: str,
        n: int,
        *,
        whole_groups: bool = False,
        group_size: int = 1,
        max_row: int | None = None,
        min_version: int | None = None,
        filter_fn=None,
        since: int | None = None,
        timeout: float = 0.0,
        cancelled: Callable[[], bool] | None = None,
    ) -> tuple[int, list[int]]:
        """(change counter, the rows ``get`` would lease now), leasing nothing; with
        ``whole_groups`` only each group's lowest row.

        With ``since``: first wait up to ``timeout`` until the change counter differs from it (a
        long poll: the sharded store waits on all shards at once), or ``cancelled()`` is true.
        """
        deadline = self._clock() + timeout
        with self._cv:
            t = self._task(task)
            while since is not None and self._changes == since and not (cancelled and cancelled()):
                now = self._clock()
                self._expire_locked(now)
                left = deadline - now
                if left <= 0 or self._changes != since or self._no_waits:
                    break
                if self._heap:
                    left = min(left, max(self._heap[0][0] - now, 0.0) + 1e-3)
                self._cv.wait(left)
            self._expire_locked(self._clock())
            pos = self._select(t, n, whole_groups, group_size, max_row, filter_fn, min_version)
            if whole_groups and len(pos):  # one entry per group: its lowest row
                _, first = np.unique(self._group[pos], return_index=True)
                pos = pos[np.sort(first)]
            return self._changes, self._row[pos].tolist()

    def notify(self) -> None:
        """Wake every waiter (long polls re-check their cancel flag)."""
        with self._cv:
            self._cv.notify_all()

