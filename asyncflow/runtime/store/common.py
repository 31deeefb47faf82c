"""The sample store's shared vocabulary: its errors, :class:`Lease`, the argument check of
``add_rows`` every backend shares, and the list helpers of the in-process bookkeeping (a
position array taken from / put into a Python list column). No Ray here.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter

import numpy as np

from asyncflow.errors import AsyncflowError

BOOKKEEPING = ("_row", "_group", "_version")
SNAPSHOT_FORMAT = 1
UNSET = -1  # _version of a row nobody has stamped yet


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


class TaskMarks:
    """One consuming task's marks over the store's positions (consumed, held)."""

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


class LeaseRecord:
    """A live lease as the store keeps it (its positions, rows, deadline, owner)."""

    __slots__ = ("id", "task", "pos", "rows", "deadline", "owner", "counted")

    def __init__(self, id: int, task: TaskMarks, pos: np.ndarray, rows: list[int], deadline: float,
                 owner: str | None = None):
        self.id, self.task, self.pos, self.rows, self.deadline = id, task, pos, rows, deadline
        self.owner = owner
        self.counted = True  # False: one part of a sharded store's lease, not its first


def contiguous_run(pos: np.ndarray) -> tuple[int, int] | None:
    """(a, b) when ``pos`` is the contiguous ascending run a..b, else None."""
    k = len(pos)
    a, b = int(pos[0]), int(pos[-1])
    if b - a == k - 1 and (k <= 2 or bool((np.diff(pos) == 1).all())):
        return a, b
    return None


def take(col: list, pos: np.ndarray) -> list:
    """``col[pos]`` for a Python list: one slice when ``pos`` is a contiguous run."""
    if len(pos) == 0:
        return []
    run = contiguous_run(pos)
    if run is not None:
        return col[run[0] : run[1] + 1]
    return list(itemgetter(*pos.tolist())(col))


def put(col: list, pos: np.ndarray, values: list) -> None:
    """``col[pos] = values`` for a Python list."""
    if len(pos) == 0:
        return
    run = contiguous_run(pos)
    if run is not None:
        col[run[0] : run[1] + 1] = values
    else:
        for p, v in zip(pos.tolist(), values):
            col[p] = v

