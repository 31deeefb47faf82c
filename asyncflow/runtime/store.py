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
waits on it. No Ray here: :mod:`asyncflow.runtime.ray_store` shards this class across actors.
"""
from __future__ import annotations

import heapq
import threading
import time
from collections import Counter
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Callable

import numpy as np

from asyncflow.errors import AsyncflowError

BOOKKEEPING = ("_row", "_group", "_version")
SNAPSHOT_FORMAT = 1
_UNSET = -1  # _version of a row nobody has stamped yet


class StoreError(AsyncflowError):
    """Misuse of the sample store: unknown task or row, a field written twice, bad shapes."""


class StoreLost(StoreError):
    """A store shard (Ray actor) died or did not answer within its bound: the run cannot go on."""

def check_new_rows(columns: dict, groups: list[int], versions: list[int] | None):
    """``add_rows``' arguments checked (every store backend shares this): a copy of ``columns``
    without ``_version`` (moved to ``versions``); bookkeeping columns may not be given."""
    k = len(groups)
    columns = dict(columns)
    if versions is None and "_version" in columns:
        versions = columns.pop("_version")
    for f, v in columns.items():
        if f in ("_row", "_group"):
            raise StoreError(f"{f} is set by the store")
        if len(v) != k:
            raise StoreError(f"column {f!r} has {len(v)} values for {k} rows")
    if versions is not None and len(versions) != k:
        raise StoreError(f"versions has {len(versions)} values for {k} rows")
    return columns, versions



@dataclass
class Lease:
    id: int
    task: str
    rows: list[int]  # global row indices, ascending
    columns: dict[str, list]  # requested fields + "_row", "_group", "_version" for those rows
    deadline: float  # time.monotonic() after which the rows are re-issued

    def __len__(self) -> int:
        return len(self.rows)


class _Task:
    __slots__ = ("name", "inputs", "consumed", "held", "floor", "order", "n_consumed", "n_held")

    def __init__(self, name: str, inputs: tuple[str, ...], cap: int):
        self.name = name
        self.inputs = inputs
        self.consumed = np.zeros(cap, bool)
        self.held = np.zeros(cap, bool)
        self.floor = 0  # every position below is consumed or dropped
        self.order: list[tuple[float, list[int]]] = []  # (ack time, rows) per ack
        self.n_consumed = 0
        self.n_held = 0


class _LeaseRec:
    __slots__ = ("id", "task", "pos", "rows", "deadline", "owner", "counted")

    def __init__(self, id: int, task: _Task, pos: np.ndarray, rows: list[int], deadline: float,
                 owner: str | None = None):
        self.id, self.task, self.pos, self.rows, self.deadline = id, task, pos, rows, deadline
        self.owner = owner
        self.counted = True  # False: one part of a sharded store's lease, not its first


def _run(pos: np.ndarray) -> tuple[int, int] | None:
    """(a, b) when ``pos`` is the contiguous ascending run a..b, else None."""
    k = len(pos)
    a, b = int(pos[0]), int(pos[-1])
    if b - a == k - 1 and (k <= 2 or bool((np.diff(pos) == 1).all())):
        return a, b
    return None


def _take(col: list, pos: np.ndarray) -> list:
    """``col[pos]`` for a Python list: one slice when ``pos`` is a contiguous run."""
    if len(pos) == 0:
        return []
    run = _run(pos)
    if run is not None:
        return col[run[0] : run[1] + 1]
    return list(itemgetter(*pos.tolist())(col))


def _put(col: list, pos: np.ndarray, values: list) -> None:
    """``col[pos] = values`` for a Python list."""
    if len(pos) == 0:
        return
    run = _run(pos)
    if run is not None:
        col[run[0] : run[1] + 1] = values
    else:
        for p, v in zip(pos.tolist(), values):
            col[p] = v


class SampleStore:
    """In-process sample store; see the module docstring for the rules."""

    def __init__(self, lease_s: float = 60.0, *, clock: Callable[[], float] = time.monotonic):
        self.lease_s = float(lease_s)
        self._clock = clock
        self._cv = threading.Condition()
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
        self._next_row = 0
        self._data: dict[str, list] = {}
        self._ready: dict[str, np.ndarray] = {}
        self._tasks: dict[str, _Task] = {}
        self._leases: dict[int, _LeaseRec] = {}
        self._heap: list[tuple[float, int]] = []  # (deadline, lease id)
        self._next_lease = 1
        self._drops: Counter = Counter()
        self._gc_floor = 0
        self._changes = 0  # bumped whenever rows may have become eligible (long polls watch it)
        self._counters = Counter()  # leases_reissued, rows_reissued, stale_acks, stale_writes, ...

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
        self._version = g(self._version, _UNSET)
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

    def _task(self, task: str) -> _Task:
        try:
            return self._tasks[task]
        except KeyError:
            raise StoreError(f"unknown task {task!r}; register_task it first") from None

    # ------------------------------------------------------------------ writing
    def register_task(self, task: str, inputs: list[str]) -> None:
        """Declare a consuming task and the fields a row needs before the task may get it."""
        inputs = tuple(inputs)
        with self._cv:
            t = self._tasks.get(task)
            if t is not None:
                if t.inputs != inputs:
                    raise StoreError(f"task {task!r} already registered with inputs {list(t.inputs)}")
                return
            self._tasks[task] = _Task(task, inputs, self._cap)

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
                self._version[sl] = [_UNSET if v is None else v for v in versions]
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
                self._version[pos] = [_UNSET if x is None else x for x in v]
                continue
            if f not in self._data:
                self._data[f] = [None] * self._n
                self._ready[f] = np.zeros(self._cap, bool)
            _put(self._data[f], pos, list(v))
            self._ready[f][pos] = True
        self._changes += 1
        self._cv.notify_all()

    # ------------------------------------------------------------------ reading
    def _eligible(self, t: _Task, max_row: int | None, min_version: int | None,
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

    def _scan(self, t: _Task, lo: int, hi: int, max_row: int | None,
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
        t: _Task,
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
                bool(filter_fn({"_row": int(r), "_group": int(g), "_version": None if v == _UNSET else int(v)}))
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
            cols[f] = [None] * len(pos) if col is None else _take(col, pos)
        cols["_row"] = self._row[pos].tolist()
        cols["_group"] = self._group[pos].tolist()
        cols["_version"] = [None if v == _UNSET else v for v in self._version[pos].tolist()]
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
            if left <= 0:
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
            return [self._lease_locked(t, pos[i:i + split], fields, now, lease_s, owner)
                    for i in range(0, len(pos), split)]

    def _lease_locked(self, t: _Task, pos: np.ndarray, fields, now: float, lease_s,
                      owner: str | None = None) -> Lease:
        lid = self._next_lease
        self._next_lease += 1
        deadline = now + (self.lease_s if lease_s is None else lease_s)
        t.held[pos] = True
        t.n_held += len(pos)
        rows = self._row[pos].tolist()
        self._leases[lid] = _LeaseRec(lid, t, pos, rows, deadline, owner)
        heapq.heappush(self._heap, (deadline, lid))
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
                if left <= 0 or self._changes != since:
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

    def _acked(self, lease_id: int | Lease) -> _LeaseRec | None:
        """The live lease an ack names; None (counted as a stale ack) if it is not live."""
        rec = self._leases.get(getattr(lease_id, "id", lease_id))
        if rec is None:
            self._counters["stale_acks"] += 1
        return rec

    def _consume(self, t: _Task, pos: np.ndarray, rows: list[int]) -> None:
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

    def _part(self, rec: _LeaseRec, rows) -> tuple[np.ndarray, np.ndarray]:
        """(positions of ``rows`` in ``rec``, in ``rows``' order; mask of the rows it keeps)."""
        at = {int(r): i for i, r in enumerate(rec.rows)}
        try:
            idx = np.asarray([at[int(r)] for r in rows], np.int64)
        except KeyError as e:
            raise StoreError(f"row {e.args[0]} is not in lease {rec.id}") from None
        keep = np.ones(len(rec.rows), bool)
        keep[idx] = False
        return rec.pos[idx], keep

    def _shrink(self, rec: _LeaseRec, keep: np.ndarray) -> None:
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

    def all_freed(self, rows) -> bool:
        """Whether :meth:`gc` has freed the values of every row in ``rows``."""
        with self._cv:
            return bool(self._freed[self._positions(rows)].all())

    def start_rows_at(self, first_row: int) -> None:
        """Number the next rows from ``first_row`` on (at least): a resumed run's rows before
        the trainer's next window were trained before its checkpoint."""
        with self._cv:
            self._next_row = max(self._next_row, int(first_row))

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

    def _unhold(self, rec: _LeaseRec) -> None:
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
            return int(len(self._eligible(self._task(task), None, None)))

    def stats(self) -> dict:
        with self._cv:
            tasks = {
                name: {
                    "consumed": t.n_consumed,
                    "leased": t.n_held,
                    "ready": int(len(self._eligible(t, None, None))),
                }
                for name, t in self._tasks.items()
            }
            c = self._counters
            return {
                "rows": self._n,
                "freed": int(self._freed[: self._n].sum()),
                "tasks": tasks,
                "drops": dict(self._drops),
                "leases_live": sum(rec.counted for rec in self._leases.values()),
                "leases_reissued": c["leases_reissued"],
                "rows_reissued": c["rows_reissued"],
                "stale_acks": c["stale_acks"],
                "stale_writes": c["stale_writes"],
                "leases_restored": c["leases_restored"],
                "leases_revoked": c["leases_revoked"],
            }

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
            rows = self._row[:n].tolist()
            fields = {}
            for f, col in self._data.items():
                pos = np.flatnonzero(self._ready[f][:n])
                fields[f] = {"rows": self._row[pos].tolist(), "values": _take(col, pos)}
            return {
                "format": SNAPSHOT_FORMAT,
                "lease_s": self.lease_s,
                "next_row": self._next_row,
                "next_lease": self._next_lease,
                "rows": rows,
                "groups": self._group[:n].tolist(),
                "versions": [None if v == _UNSET else v for v in self._version[:n].tolist()],
                "fields": fields,
                "dropped": self._row[np.flatnonzero(self._dropped[:n])].tolist(),
                "freed": self._row[np.flatnonzero(self._freed[:n])].tolist(),
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

    @classmethod
    def restore(cls, d: dict, **kwargs) -> "SampleStore":
        """Rebuild a store from :meth:`snapshot` (rule 6)."""
        if d.get("format") != SNAPSHOT_FORMAT:
            raise StoreError(f"snapshot format {d.get('format')!r} is not {SNAPSHOT_FORMAT}")
        s = cls(d.get("lease_s", 60.0), **kwargs)
        for name, t in d["tasks"].items():
            s.register_task(name, t["inputs"])
        s.add_rows({}, d["groups"], d["versions"], rows=d["rows"])
        with s._cv:
            for f, fd in d["fields"].items():
                s._data[f] = [None] * s._n
                s._ready[f] = np.zeros(s._cap, bool)
                pos = s._positions(fd["rows"])
                _put(s._data[f], pos, list(fd["values"]))
                s._ready[f][pos] = True
            s._dropped[s._positions(d["dropped"])] = True
            s._freed[s._positions(d["freed"])] = True
            s._drops.update(d["drops"])
            for name, td in d["tasks"].items():
                t = s._tasks[name]
                for ts, rows in td["consumed"]:
                    pos = s._positions(rows)
                    t.consumed[pos] = True
                    t.n_consumed += len(pos)
                    t.order.append((ts, list(rows)))
            s._counters.update(d.get("counters", {}))
            s._counters["leases_restored"] += sum(bool(x.get("counted", True)) for x in d["leases"])
            s._next_row = max(s._next_row, d["next_row"])
            s._next_lease = d["next_lease"]
        return s
