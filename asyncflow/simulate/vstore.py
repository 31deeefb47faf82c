"""An event-indexed sample store for the simulator (docs/architecture.md, "The simulator").

:class:`VStore` implements the :class:`~asyncflow.runtime.store.protocol.Store` protocol with the
semantics of the in-process :class:`~asyncflow.runtime.store.local.SampleStore` (the rules of
its module docstring: lowest rows first, whole groups, exclusive leases, expiry, stale acks,
drops, snapshots), but where that store scans its numpy marks on every read, this one keeps,
per consuming task, the set of rows eligible right now, updated on the events that change it:

- a row becomes eligible for a task when the last of the task's inputs is written (or the row
  is added with them), and when a lease of it is released, expires or is revoked;
- it stops being eligible when it is leased, consumed (ack) or dropped.

A read pops the lowest rows off the task's heap of eligible rows (entries of rows no longer
eligible are skipped and discarded as they surface); a whole-groups read takes groups off a
heap keyed by each full group's lowest eligible row. So a read of k rows costs O(k log n)
Python work, independent of how many rows the store holds; reads with a row filter or a
version bound skip (and put back) the eligible rows they pass over.

``tests/test_store_contract.py`` runs the store contract against it and
``tests/test_vstore_props.py`` drives it and a SampleStore with the same random operations.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from asyncflow.runtime.store.base import StoreBase
from asyncflow.runtime.store.common import UNSET, Lease, StoreError, check_new_rows
from asyncflow.simulate.vstore_leases import VLeases
from asyncflow.simulate.vstore_task import OneThread, VLease, VTask, select_groups


class VStore(VLeases, StoreBase):
    """Event-indexed in-process store (module docstring); a drop-in for SampleStore. How its
    indexes follow a lease's rows is :class:`~asyncflow.simulate.vstore_leases.VLeases`; what
    it shares with SampleStore (the lease lifecycle, ``write``, inspection, the snapshot's
    frame) is :class:`~asyncflow.runtime.store.base.StoreBase`."""

    def __init__(self, lease_s: float = 60.0, *, clock: Callable[[], float] = time.monotonic,
                 threads: bool = True):
        self._init_state(lease_s, clock)
        if not threads:  # one thread (the simulator): no lock to take
            self._cv = OneThread()
        self._row: list[int] = []  # position -> row
        self._group: list[int] = []
        self._version: list[int] = []
        self._dropped = bytearray()
        self._freed = bytearray()
        self._pos: dict[int, int] | None = None  # row -> position; None while position == row
        self._ready: dict[str, bytearray] = {}
        self._tasks: dict[str, VTask]
        self._readers: dict[str, list[VTask]] = {}  # field -> the tasks it is an input of
        self._leases: dict[int, VLease]
        self._done: list[int] = []  # position -> tasks that consumed it
        self._gc_cand: list[int] = []  # positions that may be freeable
        self._waiters = 0  # reads waiting on _cv (a write notifies only when there are some)

    # ------------------------------------------------------------------ positions
    def _positions(self, rows) -> list[int]:
        if self._pos is None:
            pos = [int(r) for r in rows]
            n = len(self._row)
            if pos and (min(pos) < 0 or max(pos) >= n):
                bad = [r for r in pos if not 0 <= r < n][:5]
                raise StoreError(f"unknown rows {bad}")
            return pos
        try:
            get = self._pos.__getitem__
            return [get(int(r)) for r in rows]
        except KeyError as e:
            raise StoreError(f"unknown row {e.args[0]}") from None

    def _p(self, row: int) -> int:
        return row if self._pos is None else self._pos[row]

    def _recheck(self, t: VTask, pos) -> None:
        """Positions ``pos`` may have become eligible for ``t``: those that are, join its set."""
        readies = t.readies
        if readies is None:  # the ready bits of t's inputs, once they all exist
            readies = [self._ready.get(f) for f in t.inputs]
            if any(r is None for r in readies):
                return
            t.readies = readies
        consumed, held, dropped, elig = t.consumed, t.held, self._dropped, t.elig
        row, group = self._row, self._group
        for p in pos:
            if consumed[p] or held[p] or dropped[p]:
                continue
            for r in readies:
                if not r[p]:
                    break
            else:
                rr = row[p]
                if rr not in elig:
                    t.add(rr, group[p])

    # ------------------------------------------------------------------ writing
    def _new_task(self, task: str, inputs: tuple[str, ...]) -> None:
        t = self._tasks[task] = VTask(task, inputs, len(self._row))
        for f in set(inputs):
            self._readers.setdefault(f, []).append(t)
        self._recheck(t, range(len(self._row)))

    def add_rows(self, columns: dict[str, list], groups: list[int],
                 versions: list[int] | None = None, *, rows: list[int] | None = None) -> list[int]:
        k = len(groups)
        columns, versions = check_new_rows(columns, groups, versions)
        with self._cv:
            n = len(self._row)
            if rows is None:
                new = list(range(self._next_row, self._next_row + k))
            else:
                new = [int(r) for r in rows]
                if len(new) != k:
                    raise StoreError(f"{len(new)} row indices for {k} rows")
                if k and (len(set(new)) != k or (
                        any(r in self._pos for r in new) if self._pos is not None
                        else min(new) < n)):
                    raise StoreError("add_rows: row indices already in use")
            if k == 0:
                return []
            if self._pos is None and new != list(range(n, n + k)):
                self._pos = {r: p for p, r in enumerate(self._row)}
            if self._pos is not None:
                self._pos.update(zip(new, range(n, n + k)))
            self._next_row = max(self._next_row, max(new) + 1)
            self._row.extend(new)
            self._group.extend(int(g) for g in groups)
            self._version.extend([UNSET] * k if versions is None else
                                 [UNSET if v is None else int(v) for v in versions])
            zeros = bytes(k)
            self._dropped.extend(zeros)
            self._freed.extend(zeros)
            self._done.extend([0] * k)
            for f, col in self._data.items():
                col.extend(columns[f] if f in columns else [None] * k)
                self._ready[f].extend(b"\x01" * k if f in columns else zeros)
            for f, v in columns.items():
                if f not in self._data:
                    self._data[f] = [None] * n + list(v)
                    self._ready[f] = bytearray(n) + b"\x01" * k
                    self._new_field()
            for t in self._tasks.values():
                t.grow(k)
                if all(f in columns for f in t.inputs):
                    add = t.add
                    for r, g in zip(new, groups):
                        add(r, int(g))
                t.tidy()
            self._changed()
            return new

    def _write_pos(self, pos: list[int], columns: dict[str, list]) -> None:
        k = len(pos)
        if k == 1:  # a serve loop writes each sample as it finishes
            return self._write_one(pos[0], columns)
        ready_of = self._ready
        for f, v in columns.items():
            if f == "_row" or f == "_group":
                raise StoreError(f"{f} is set by the store")
            if len(v) != k:
                raise StoreError(f"column {f!r} has {len(v)} values for {k} rows")
            r = ready_of.get(f) if f != "_version" else None
            if r is not None and (r[pos[0]] if k == 1 else any(r[p] for p in pos)):
                rows = [self._row[p] for p in pos if r[p]][:5]
                raise StoreError(f"field {f!r} written twice on rows {rows}")
        if k > 1 and len(set(pos)) != k:
            raise StoreError("write: a row appears twice")
        if k == 0:
            return
        touched: list = []
        for f, v in columns.items():
            if f == "_version":
                ver = self._version
                for p, x in zip(pos, v):
                    ver[p] = UNSET if x is None else x
                continue
            col = self._data.get(f)
            if col is None:
                col = self._data[f] = [None] * len(self._row)
                ready_of[f] = bytearray(len(self._row))
                self._new_field()
            ready = ready_of[f]
            if k == 1:
                p = pos[0]
                col[p] = v[0]
                ready[p] = 1
            else:
                for p, x in zip(pos, v):
                    col[p] = x
                    ready[p] = 1
            touched += self._readers.get(f, ())
        for t in (touched if len(touched) < 2 else dict.fromkeys(touched)):
            self._recheck(t, pos)
        self._changed()

    def _write_one(self, p: int, columns: dict[str, list]) -> None:
        """:meth:`_write_pos` of one position ``p`` (the same checks, errors and effects)."""
        ready_of = self._ready
        for f, v in columns.items():
            if f == "_row" or f == "_group":
                raise StoreError(f"{f} is set by the store")
            if len(v) != 1:
                raise StoreError(f"column {f!r} has {len(v)} values for 1 rows")
            if f != "_version":
                r = ready_of.get(f)
                if r is not None and r[p]:
                    raise StoreError(f"field {f!r} written twice on rows {[self._row[p]]}")
        touched: list = []
        data, readers = self._data, self._readers
        for f, v in columns.items():
            x = v[0]
            if f == "_version":
                self._version[p] = UNSET if x is None else x
                continue
            col = data.get(f)
            if col is None:
                col = data[f] = [None] * len(self._row)
                ready_of[f] = bytearray(len(self._row))
                self._new_field()
            col[p] = x
            ready_of[f][p] = 1
            touched += readers.get(f, ())
        pos = (p,)
        for t in (touched if len(touched) < 2 else dict.fromkeys(touched)):
            self._recheck(t, pos)
        self._changed()

    def _new_field(self) -> None:
        for t in self._tasks.values():
            t.readies = None

    def _changed(self) -> None:
        """Rows may have become eligible: wake the reads that wait (``get(timeout=...)``)."""
        self._changes += 1
        if self._waiters:
            self._cv.notify_all()

    def all_freed(self, rows) -> bool:
        with self._cv:
            return all(self._freed[p] for p in self._positions(rows))

    # ------------------------------------------------------------------ reads
    def _ok(self, min_version, filter_fn):
        """The row test of a read's ``min_version`` and ``filter_fn`` (None without them)."""
        if filter_fn is None and min_version is None:
            return None

        def ok(r: int) -> bool:
            p = self._p(r)
            if min_version is not None and self._version[p] < min_version:
                return False
            return filter_fn is None or bool(filter_fn(self._row_info(p)))
        return ok

    def _row_info(self, p: int) -> dict:
        v = self._version[p]
        return {"_row": self._row[p], "_group": self._group[p], "_version": None if v == UNSET else v}

    def _select(self, t: VTask, n: int, whole_groups: bool, group_size: int, max_row,
                filter_fn, min_version) -> tuple[list[int], bool]:
        """(rows ascending, whether they were popped off the heap: :meth:`VTask.unpop` puts
        them back if they are not leased)."""
        ok = self._ok(min_version, filter_fn)
        if not whole_groups:
            return t.pop_lowest(n, max_row, ok), True
        if group_size < 1:
            raise StoreError("group_size must be >= 1")
        if n // group_size == 0:
            return [], False
        if ok is None:
            return t.full_groups(n // group_size, group_size, max_row,
                                 lambda r: self._group[self._p(r)]), False
        cand = [r for r in sorted(t.elig) if (max_row is None or r < max_row) and ok(r)]
        return select_groups(cand, [self._group[self._p(r)] for r in cand],
                             n // group_size, group_size), False

    def _wait_select(self, t: VTask, deadline: float, need: int, select):
        while True:
            now = self._clock()
            self._expire_locked(now)
            rows, popped = select() if len(t.elig) >= need else ([], False)  # (none to pop)
            if len(rows) >= need:
                return rows, popped, now
            if popped:
                t.unpop(rows)
            left = deadline - now
            if left <= 0 or self._no_waits:
                return None
            if self._heap:
                left = min(left, max(self._heap[0][0] - now, 0.0) + 1e-3)
            self._waiters += 1
            try:
                self._cv.wait(left)
            finally:
                self._waiters -= 1

    def get(self, task: str, n: int, *, min_rows: int = 1, whole_groups: bool = False,
            group_size: int = 1, max_row: int | None = None, timeout: float = 0.0,
            filter_fn: Callable[[dict], Any] | None = None, min_version: int | None = None,
            fields: list[str] | None = None, lease_s: float | None = None,
            owner: str | None = None) -> Lease | None:
        if timeout <= 0 and not whole_groups and filter_fn is None and min_version is None:
            with self._cv:  # the simulator's reads: the lowest rows, now or never
                t = self._tasks.get(task) or self._task(task)
                now = self._clock()
                if self._heap:
                    self._expire_locked(now)
                need = int(min_rows) if min_rows > 1 else 1
                if len(t.elig) < need:
                    return None
                rows = t.pop_lowest(n, max_row, None)
                if len(rows) < need:
                    t.unpop(rows)
                    return None
                return self._lease_locked(t, rows, fields, now, lease_s, owner)
        deadline = self._clock() + timeout
        with self._cv:
            t = self._task(task)
            got = self._wait_select(t, deadline, max(int(min_rows), 1), lambda: self._select(
                t, n, whole_groups, group_size, max_row, filter_fn, min_version))
            if got is None:
                return None
            return self._lease_locked(t, got[0], fields, got[2], lease_s, owner)

    def get_split(self, task: str, n: int, split: int, *, min_rows: int = 1,
                  max_row: int | None = None, timeout: float = 0.0, filter_fn=None,
                  min_version: int | None = None, fields: list[str] | None = None,
                  lease_s: float | None = None, owner: str | None = None) -> list[Lease]:
        split = max(1, int(split))
        need = max(1, min(int(min_rows), split))
        deadline = self._clock() + timeout

        def select():
            ok = self._ok(min_version, filter_fn)
            if ok is None:  # count first: pop only the rows it leases (a trainer reads often)
                k = len(t.elig) if max_row is None else t.count_below(max_row, n)
                cut = n if k >= n else k // split * split
                return (t.pop_lowest(cut, max_row, None) if cut else []), True
            rows = t.pop_lowest(n, max_row, ok)
            if len(rows) < n:
                cut = len(rows) // split * split
                t.unpop(rows[cut:])
                rows = rows[:cut]
            return rows, True

        with self._cv:
            t = self._task(task)
            got = self._wait_select(t, deadline, need, select)
            if got is None:
                return []
            rows, _, now = got
            return [self._lease_locked(t, rows[i:i + split], fields, now, lease_s, owner)
                    for i in range(0, len(rows), split)]

    def drop(self, rows: list[int], reason: str) -> int:
        with self._cv:
            pos = self._positions(rows)
            new = {p for p in pos if not self._dropped[p]}
            for p in new:
                self._dropped[p] = 1
                r, g = self._row[p], self._group[p]
                for t in self._tasks.values():
                    if r in t.elig:
                        t.remove(r, g)
                self._gc_cand.append(p)
            self._drops[reason] += len(new)
            return len(new)

    # ------------------------------------------------------------------ inspection
    def _n_rows(self) -> int:
        return len(self._row)

    def _n_freed(self) -> int:
        return sum(self._freed)

    def _n_ready(self, t: VTask) -> int:
        return len(t.elig)

    def _n_ready_below(self, t: VTask, max_row: int, cap: int) -> int:
        return t.count_below(max_row, cap)

    def gc(self) -> int:
        """Free the values of rows every task consumed (or that were dropped) and no lease
        holds (SampleStore.gc); only rows whose last consumption or drop came since are looked
        at."""
        with self._cv:
            if not self._tasks:
                return 0
            tasks = list(self._tasks.values())
            keep, freed = [], 0
            for p in dict.fromkeys(self._gc_cand):
                if self._freed[p]:
                    continue
                drop = self._dropped[p]
                if any(t.held[p] for t in tasks):
                    if drop:
                        keep.append(p)
                    continue
                if not drop and not all(t.consumed[p] for t in tasks):
                    continue
                for col in self._data.values():
                    col[p] = None
                self._freed[p] = 1
                freed += 1
            self._gc_cand = keep
            return freed

    # ------------------------------------------------------------------ checkpoint
    def snapshot(self) -> dict:
        """Plain data, in SampleStore's format (either store restores the other's)."""
        with self._cv:
            fields = {}
            for f, col in self._data.items():
                ready = self._ready[f]
                pos = [p for p in range(len(self._row)) if ready[p]]
                fields[f] = {"rows": [self._row[p] for p in pos], "values": [col[p] for p in pos]}
            n = len(self._row)
            return self._snapshot_frame(
                list(self._row), list(self._group),
                [None if v == UNSET else v for v in self._version], fields,
                [self._row[p] for p in range(n) if self._dropped[p]],
                [self._row[p] for p in range(n) if self._freed[p]])

    @classmethod
    def restore(cls, d: dict, **kwargs) -> "VStore":
        cls.check_snapshot(d)
        s = cls(d.get("lease_s", 60.0), **kwargs)
        s.add_rows({}, d["groups"], d["versions"], rows=d["rows"])
        with s._cv:
            for f, fd in d["fields"].items():
                s._data[f] = col = [None] * len(s._row)
                s._ready[f] = ready = bytearray(len(s._row))
                s._new_field()
                for p, v in zip(s._positions(fd["rows"]), fd["values"]):
                    col[p], ready[p] = v, 1
            for p in s._positions(d["dropped"]):
                s._dropped[p] = 1
            for p in s._positions(d["freed"]):
                s._freed[p] = 1
            s._restore_counts(d)
        for name, td in d["tasks"].items():
            s.register_task(name, td["inputs"])  # eligibility below, once marks are in
        with s._cv:
            for name, td in d["tasks"].items():
                t = s._tasks[name]
                for ts, rows in td["consumed"]:
                    for p in s._positions(rows):
                        t.consumed[p] = 1
                        s._done[p] += 1
                        if s._row[p] in t.elig:
                            t.remove(s._row[p], s._group[p])
                    t.n_consumed += len(rows)
                    t.order.append((ts, list(rows)))
            for t in s._tasks.values():
                t.rebuild()
        return s


__all__ = ["VStore"]
