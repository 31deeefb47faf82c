"""The streaming sample store (DESIGN.md, The runtime), in-process backend.

After AsyncFlow's TransferQueue: one *row* per sample with a global index, one *column* per field,
a *ready bit* per (row, field) and a *consumption mark* per (row, task). A task asks for "n rows
that have all my input fields and that I have neither consumed nor hold leased"; the rows come
back as a :class:`Lease` (a column batch, see ``asyncflow/engines/base.py``) which the task later
``ack``\\ s (consumed: never again to this task) or ``release``\\ s (back, unconsumed). Pulling is
the load balancing: replicas of one task share its marks, so they never get the same row.

Rules (the tests cite them by number):

1. Rows are stored column-wise without padding: a variable-length value (token ids) stays the
   Python object that was written. A field may be written once per row; ``_version`` may be
   rewritten (multi-turn: the oldest version), ``_row`` and ``_group`` never.
2. ``get`` returns the lowest-indexed eligible rows first, ascending in the lease.
   ``whole_groups``: only groups with ``group_size`` eligible rows, whole groups only, taken in the
   order of each group's lowest row. ``max_row``: only rows with index < max_row.
3. Leases are exclusive per task: a row is held by at most one live lease of a task.
4. A lease past its deadline expires: its rows become eligible again (re-issued), exactly once per
   expiry, counted in ``stats()["leases_reissued"]``. An ``ack`` of an expired, released or
   already-acked lease is ignored and counted (``stale_acks``): the later holder's ack wins, so a
   row is consumed at most once. ``ack(lease, columns)`` writes the task's outputs and consumes in
   one step, so a stale holder can never write either.
5. ``drop`` removes rows from every task (too stale, bad data), counted per reason.
6. ``snapshot`` is plain data (dicts, lists, ints, the written values); ``restore`` rebuilds the
   store with its marks; leases in flight at snapshot time come back unleased (their holders are
   gone), counted as ``leases_restored``.

Bookkeeping is vectorised (numpy bool arrays per field and per task), so a get/write/ack of k rows
costs O(k) Python work plus O(rows above the task's low-water mark) numpy work.

Thread-safe: every public method runs under one ``threading.Condition``; ``get(timeout=...)``
waits on it. No Ray here: :mod:`asyncflow.runtime.store.ray` shards this class across actors.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from asyncflow.runtime.store.base import StoreBase
from asyncflow.runtime.store.common import (UNSET, LeaseRecord, StoreError,
                                            TaskMarks, check_new_rows, put, take)
from asyncflow.runtime.store.leases import Leases
from asyncflow.runtime.store.select import Reads


class SampleStore(Reads, Leases, StoreBase):
    """In-process sample store; see the module docstring for the rules. Its reads are
    :class:`~asyncflow.runtime.store.select.Reads`, its marks' lease bookkeeping
    :class:`~asyncflow.runtime.store.leases.Leases`, and what it shares with the simulator's
    store (the lease lifecycle, ``write``, inspection)
    :class:`~asyncflow.runtime.store.base.StoreBase`."""

    def __init__(self, lease_s: float = 60.0, *, clock: Callable[[], float] = time.monotonic):
        self._init_state(lease_s, clock)
        self._n = 0  # local rows (positions 0.._n-1)
        self._cap = 0
        self._row = np.empty(0, np.int64)  # position -> global row index
        self._group = np.empty(0, np.int64)
        self._version = np.empty(0, np.int64)
        self._dropped = np.empty(0, bool)
        self._freed = np.empty(0, bool)
        self._identity = True  # position == row for every row so far (no sharding)
        self._sorted = True  # rows were added in ascending order
        self._pos: dict[int, int] = {}  # row -> position, only when not _identity
        self._ready: dict[str, np.ndarray] = {}
        self._tasks: dict[str, TaskMarks]
        self._leases: dict[int, LeaseRecord]
        self._gc_floor = 0

    # ------------------------------------------------------------------ capacity, positions
    def _grow(self, need: int) -> None:
        if need <= self._cap:
            return
        cap = max(need, 2 * self._cap, 1024)

        def g(a: np.ndarray, fill=0) -> np.ndarray:
            b = np.full(cap, fill, a.dtype)
            b[: self._n] = a[: self._n]
            return b

        self._row, self._group = g(self._row), g(self._group)
        self._version = g(self._version, UNSET)
        self._dropped, self._freed = g(self._dropped), g(self._freed)
        for f in self._ready:
            self._ready[f] = g(self._ready[f])
        for t in self._tasks.values():
            t.consumed, t.held = g(t.consumed), g(t.held)
        self._cap = cap

    def _positions(self, rows) -> np.ndarray:
        if self._identity:
            pos = np.asarray(rows, np.int64).reshape(-1)
            if len(pos) and (int(pos.min()) < 0 or int(pos.max()) >= self._n):
                bad = [int(r) for r in pos if not 0 <= r < self._n][:5]
                raise StoreError(f"unknown rows {bad}")
            return pos
        try:
            get = self._pos.__getitem__
            return np.fromiter((get(int(r)) for r in rows), np.int64, len(rows))
        except KeyError as e:
            raise StoreError(f"unknown row {e.args[0]}") from None

    # ------------------------------------------------------------------ writing
    def _new_task(self, task: str, inputs: tuple[str, ...]) -> None:
        self._tasks[task] = TaskMarks(task, inputs, self._cap)

    def add_rows(
        self,
        columns: dict[str, list],
        groups: list[int],
        versions: list[int] | None = None,
        *,
        rows: list[int] | None = None,
    ) -> list[int]:
        """Append rows (one per sample); the given columns count as written. Returns their indices.

        ``rows`` (sharded stores): explicit, unused global indices instead of the next ones.
        """
        k = len(groups)
        columns, versions = check_new_rows(columns, groups, versions)
        with self._cv:
            n = self._n
            if rows is None:
                rows_arr = np.arange(self._next_row, self._next_row + k, dtype=np.int64)
            else:
                rows_arr = np.asarray(rows, np.int64).reshape(-1)
                if len(rows_arr) != k:
                    raise StoreError(f"{len(rows_arr)} row indices for {k} rows")
                known = self._pos if not self._identity else None
                if k and (
                    (known is not None and any(int(r) in known for r in rows_arr))
                    or (known is None and int(rows_arr.min()) < self._n)
                    or len(np.unique(rows_arr)) != k
                ):
                    raise StoreError("add_rows: row indices already in use")
            if k == 0:
                return []
            self._grow(n + k)
            lo, hi = int(rows_arr.min()), int(rows_arr.max())
            ascending = k == 1 or bool((np.diff(rows_arr) > 0).all())
            if self._identity and not (lo == n and hi == n + k - 1 and ascending):
                self._identity = False
                self._pos = {int(r): p for p, r in enumerate(self._row[:n].tolist())}
            if not self._identity:
                self._pos.update(zip(rows_arr.tolist(), range(n, n + k)))
            if not ascending or (n and lo <= int(self._row[n - 1])):
                self._sorted = False
            self._next_row = max(self._next_row, hi + 1)
            sl = slice(n, n + k)
            self._row[sl] = rows_arr
            self._group[sl] = np.asarray(groups, np.int64)
            if versions is not None:
                self._version[sl] = [UNSET if v is None else v for v in versions]
            for f, col in self._data.items():
                col.extend(columns[f] if f in columns else [None] * k)
            for f, v in columns.items():
                if f not in self._data:
                    self._data[f] = [None] * n + list(v)
                    self._ready[f] = np.zeros(self._cap, bool)
                self._ready[f][sl] = True
            self._n = n + k
            self._changes += 1
            self._cv.notify_all()
            return rows_arr.tolist()

    def _write_pos(self, pos: np.ndarray, columns: dict[str, list]) -> None:
        k = len(pos)
        for f, v in columns.items():
            if f in ("_row", "_group"):
                raise StoreError(f"{f} is set by the store")
            if len(v) != k:
                raise StoreError(f"column {f!r} has {len(v)} values for {k} rows")
            if f != "_version" and f in self._ready:
                twice = self._ready[f][pos]
                if twice.any():
                    rows = self._row[pos[twice]][:5].tolist()
                    raise StoreError(f"field {f!r} written twice on rows {rows}")
        if k > 1 and len(np.unique(pos)) != k:
            raise StoreError("write: a row appears twice")
        if k == 0:
            return
        for f, v in columns.items():
            if f == "_version":
                self._version[pos] = [UNSET if x is None else x for x in v]
                continue
            if f not in self._data:
                self._data[f] = [None] * self._n
                self._ready[f] = np.zeros(self._cap, bool)
            put(self._data[f], pos, list(v))
            self._ready[f][pos] = True
        self._changes += 1
        self._cv.notify_all()

    def all_freed(self, rows) -> bool:
        """Whether :meth:`gc` has freed the values of every row in ``rows``."""
        with self._cv:
            return bool(self._freed[self._positions(rows)].all())

    # ------------------------------------------------------------------ inspection
    def _n_rows(self) -> int:
        return self._n

    def _n_freed(self) -> int:
        return int(self._freed[: self._n].sum())

    def _n_ready(self, t: TaskMarks) -> int:
        return int(len(self._eligible(t, None, None)))

    def _n_ready_below(self, t: TaskMarks, max_row: int, cap: int) -> int:
        return min(int(cap), int(len(self._eligible(t, max_row, None, limit=cap))))

    def gc(self) -> int:
        """Free the values of rows every registered task has consumed (or that were dropped) and
        no lease holds; indices, groups, versions and marks stay. Returns rows newly freed."""
        with self._cv:
            if not self._tasks:
                return 0
            n, lo = self._n, self._gc_floor
            done = ~self._freed[lo:n]
            for t in self._tasks.values():
                done &= (t.consumed[lo:n] | self._dropped[lo:n]) & ~t.held[lo:n]
            pos = np.flatnonzero(done) + lo
            for col in self._data.values():
                for p in pos.tolist():
                    col[p] = None
            self._freed[pos] = True
            freed = self._freed[lo:n]
            self._gc_floor = lo + (int(np.argmin(freed)) if not freed.all() else len(freed))
            return int(len(pos))

    # ------------------------------------------------------------------ checkpoint
    def snapshot(self) -> dict:
        """Plain-data checkpoint: rows, values, ready bits, marks, drops, leases in flight."""
        with self._cv:
            n = self._n
            fields = {}
            for f, col in self._data.items():
                pos = np.flatnonzero(self._ready[f][:n])
                fields[f] = {"rows": self._row[pos].tolist(), "values": take(col, pos)}
            return self._snapshot_frame(
                self._row[:n].tolist(), self._group[:n].tolist(),
                [None if v == UNSET else v for v in self._version[:n].tolist()], fields,
                self._row[np.flatnonzero(self._dropped[:n])].tolist(),
                self._row[np.flatnonzero(self._freed[:n])].tolist())

    @classmethod
    def restore(cls, d: dict, **kwargs) -> "SampleStore":
        """Rebuild a store from :meth:`snapshot` (rule 6)."""
        cls.check_snapshot(d)
        s = cls(d.get("lease_s", 60.0), **kwargs)
        for name, t in d["tasks"].items():
            s.register_task(name, t["inputs"])
        s.add_rows({}, d["groups"], d["versions"], rows=d["rows"])
        with s._cv:
            for f, fd in d["fields"].items():
                s._data[f] = [None] * s._n
                s._ready[f] = np.zeros(s._cap, bool)
                pos = s._positions(fd["rows"])
                put(s._data[f], pos, list(fd["values"]))
                s._ready[f][pos] = True
            s._dropped[s._positions(d["dropped"])] = True
            s._freed[s._positions(d["freed"])] = True
            for name, td in d["tasks"].items():
                t = s._tasks[name]
                for ts, rows in td["consumed"]:
                    pos = s._positions(rows)
                    t.consumed[pos] = True
                    t.n_consumed += len(pos)
                    t.order.append((ts, list(rows)))
            s._restore_counts(d)
        return s
