"""One consuming task's indexes in :class:`~asyncflow.simulate.vstore.VStore`: the rows eligible
for it now (a set, and a min-heap of them whose stale entries are skipped lazily), its marks, and
-- once it has read whole groups -- its eligible rows per group and, per group size, a heap of
the full groups keyed by their lowest eligible row (docs/architecture.md, "The simulator")."""
from __future__ import annotations

from bisect import insort
from heapq import heappop, heappush
from typing import Callable

from asyncflow.runtime.store.common import StoreError


class OneThread:
    """The condition of a :class:`~asyncflow.simulate.vstore.VStore` that one thread uses
    (``threads=False``: the simulator's): entering it costs nothing, and a read that would
    wait for another thread's write is an error (no other thread can write)."""

    __slots__ = ()

    def __enter__(self) -> "OneThread":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def notify_all(self) -> None:
        return None

    def wait(self, timeout: float | None = None) -> bool:
        raise StoreError("a read with a timeout on a one-thread VStore: nothing can write "
                         "while it waits")


class VLease:
    """A live lease (its task, positions, rows, deadline, owner)."""

    __slots__ = ("id", "task", "pos", "rows", "deadline", "owner")
    counted = True  # the simulator's store is never a shard: every lease counts

    def __init__(self, id: int, task: "VTask", pos: list[int], rows: list[int], deadline: float,
                 owner: str | None):
        self.id, self.task, self.pos, self.rows = id, task, pos, rows
        self.deadline, self.owner = deadline, owner


class VTask:
    """A task's eligible rows and marks (module docstring)."""

    __slots__ = ("name", "inputs", "consumed", "held", "order", "n_consumed", "n_held", "elig",
                 "heap", "groups", "gheaps", "readies")

    def __init__(self, name: str, inputs: tuple[str, ...], n: int):
        self.name, self.inputs = name, inputs
        self.consumed = bytearray(n)  # by position
        self.held = bytearray(n)
        self.order: list[tuple[float, list[int]]] = []  # (ack time, rows) per ack
        self.n_consumed = self.n_held = 0
        self.elig: set[int] = set()  # rows eligible now
        self.heap: list[int] = []  # every eligible row at least once (and stale entries)
        self.groups: dict[int, list[int]] | None = None  # group -> its eligible rows, ascending
        self.gheaps: dict[int, list[tuple[int, int]]] = {}  # size -> [(lowest row, group)]
        self.readies: list | None = None  # the store's ready bits of the inputs (VStore._recheck)

    def grow(self, k: int) -> None:
        z = bytes(k)
        self.consumed.extend(z)
        self.held.extend(z)

    # -- the eligible set
    def add(self, r: int, g: int) -> None:
        self.elig.add(r)
        heappush(self.heap, r)
        if self.groups is not None:
            lst = self.groups.get(g)
            if lst is None:
                lst = self.groups[g] = []
            insort(lst, r)
            for size, hp in self.gheaps.items():
                if len(lst) == size or (lst[0] == r and len(lst) > size):
                    heappush(hp, (lst[0], g))

    def remove(self, r: int, g: int) -> None:
        self.elig.discard(r)
        if self.groups is not None:
            lst = self.groups[g]
            low = lst[0] == r
            lst.remove(r)
            if not lst:
                del self.groups[g]
            elif low:
                for size, hp in self.gheaps.items():
                    if len(lst) >= size:
                        heappush(hp, (lst[0], g))

    def tidy(self) -> None:
        """Rebuild a heap grown mostly stale (rows leased by whole-group reads leave theirs)."""
        if len(self.heap) > 2 * len(self.elig) + 256:
            self.heap = sorted(self.elig)
        if self.groups is not None:
            for size, hp in self.gheaps.items():
                if len(hp) > 2 * len(self.groups) + 256:
                    self.gheaps[size] = self._full(size)

    def rebuild(self) -> None:
        self.heap = sorted(self.elig)
        for size in self.gheaps:
            self.gheaps[size] = self._full(size)

    def _full(self, size: int) -> list[tuple[int, int]]:
        return sorted((lst[0], g) for g, lst in self.groups.items() if len(lst) >= size)

    # -- reads
    def pop_lowest(self, n: int, max_row: int | None,
                   ok: Callable[[int], bool] | None) -> list[int]:
        """Pop up to ``n`` lowest eligible rows below ``max_row`` that ``ok`` accepts (ascending;
        the rows it passes over go back on the heap)."""
        heap, elig = self.heap, self.elig
        out: list[int] = []
        skipped: list[int] = []
        last = None
        while heap and len(out) < n:
            r = heap[0]
            if r == last or r not in elig:  # a duplicate entry, or a row no longer eligible
                heappop(heap)
                continue
            if max_row is not None and r >= max_row:
                break
            heappop(heap)
            last = r
            if ok is None or ok(r):
                out.append(r)
            else:
                skipped.append(r)
        for r in skipped:
            heappush(heap, r)
        return out

    def count_below(self, max_row: int, cap: int) -> int:
        """How many eligible rows are below ``max_row``, counted up to ``cap``, without popping:
        the heap's entries below ``max_row`` are the subtree of its root that holds them (an
        entry's children are not lower), so only those are visited, not every eligible row."""
        heap, elig = self.heap, self.elig
        size = len(heap)
        seen: set[int] = set()
        stack = [0] if size else []
        while stack and len(seen) < cap:
            i = stack.pop()
            r = heap[i]
            if r >= max_row:
                continue
            if r in elig:
                seen.add(r)
            j = 2 * i + 1
            if j < size:
                stack.append(j)
                if j + 1 < size:
                    stack.append(j + 1)
        return len(seen)

    def unpop(self, rows: list[int]) -> None:
        """Put back rows :meth:`pop_lowest` gave that were not leased."""
        for r in rows:
            heappush(self.heap, r)

    def full_groups(self, n_groups: int, size: int, max_row: int | None,
                    group_of: Callable[[int], int]) -> list[int]:
        """The rows (ascending) of up to ``n_groups`` groups with ``size`` eligible rows below
        ``max_row``, the lowest ``size`` of each, groups in the order of their lowest row."""
        if self.groups is None:
            self.groups = {}
            for r in sorted(self.elig):
                self.groups.setdefault(group_of(r), []).append(r)
        hp = self.gheaps.get(size)
        if hp is None:
            hp = self.gheaps[size] = self._full(size)
        groups = self.groups
        chosen: list[int] = []
        back: list[tuple[int, int]] = []
        seen: set[int] = set()
        while hp and len(chosen) < n_groups:
            m, g = hp[0]
            lst = groups.get(g)
            if lst is None or len(lst) < size or lst[0] != m or g in seen:
                heappop(hp)
                continue
            if max_row is not None and m >= max_row:
                break
            heappop(hp)
            seen.add(g)
            back.append((m, g))
            if max_row is None or lst[size - 1] < max_row:
                chosen.append(g)
        for e in back:
            heappush(hp, e)
        out = [r for g in chosen for r in groups[g][:size]]
        out.sort()
        return out


def select_groups(cand: list[int], groups: list[int], n_groups: int, size: int) -> list[int]:
    """SampleStore's whole-groups rule over candidate rows ``cand`` (ascending) of ``groups``:
    groups with ``size`` candidates, the lowest ``size`` of each, the first ``n_groups`` groups
    by their lowest row; their rows, ascending."""
    by: dict[int, list[int]] = {}
    for r, g in zip(cand, groups):
        by.setdefault(g, []).append(r)
    full = sorted((rows[0], g) for g, rows in by.items() if len(rows) >= size)[:n_groups]
    out = [r for _, g in full for r in by[g][:size]]
    out.sort()
    return out


__all__ = ["OneThread", "VLease", "VTask", "select_groups"]
