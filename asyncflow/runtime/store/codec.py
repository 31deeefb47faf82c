"""The sample store's column codec: how column values travel between a store handle and its
shards (:mod:`asyncflow.runtime.store.ray`).

A column is a Python list, a numpy array, or a :class:`Ragged` (variable-length rows as one flat
array plus offsets). numpy and :class:`Ragged` columns move without per-row pickling; a long list
column is pickled once by the writing handle (:class:`Pickled`) and moved as bytes. This module
imports no Ray.
"""
from __future__ import annotations

import itertools
import pickle

import numpy as np

from asyncflow.runtime.store.common import take


class Ragged:
    """Variable-length rows (token ids) as one flat array and ``offsets`` (length rows + 1):
    row ``i`` is ``flat[offsets[i]:offsets[i + 1]]``. A column type the store moves without
    per-row pickling; indexing a row gives a numpy array."""

    __slots__ = ("flat", "offsets")

    def __init__(self, flat, offsets):
        self.flat = np.asarray(flat)
        self.offsets = np.asarray(offsets, np.int64)

    @classmethod
    def from_lists(cls, rows, dtype=np.int64) -> "Ragged":
        k = len(rows)
        off = np.zeros(k + 1, np.int64)
        np.cumsum(np.fromiter(map(len, rows), np.int64, k), out=off[1:])
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype, int(off[-1]))
        return cls(flat, off)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def nbytes(self) -> int:
        return int(self.flat.nbytes + self.offsets.nbytes)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __getitem__(self, i):
        if isinstance(i, slice):
            a, b, step = i.indices(len(self))
            if step != 1:
                return self.take(np.arange(a, b, step))
            b = max(a, b)
            o = self.offsets[a : b + 1]
            return Ragged(self.flat[o[0] : o[-1]], o - o[0])
        i = int(i)
        if i < 0:
            i += len(self)
        return self.flat[self.offsets[i] : self.offsets[i + 1]]

    def __iter__(self):
        o = self.offsets.tolist()
        for a, b in zip(o[:-1], o[1:]):
            yield self.flat[a:b]

    def take(self, idx) -> "Ragged":
        idx = np.asarray(idx, np.int64).reshape(-1)
        if len(idx) == 0:
            return Ragged(self.flat[:0], np.zeros(1, np.int64))
        a, b = int(idx[0]), int(idx[-1])
        if b - a == len(idx) - 1 and (len(idx) <= 2 or bool((np.diff(idx) == 1).all())):
            return self[a : b + 1]
        starts = self.offsets[idx]
        lens = self.offsets[idx + 1] - starts
        off = np.zeros(len(idx) + 1, np.int64)
        np.cumsum(lens, out=off[1:])
        gather = np.repeat(starts - off[:-1], lens) + np.arange(int(off[-1]))
        return Ragged(self.flat[gather], off)

    @staticmethod
    def concat(parts) -> "Ragged":
        parts = list(parts)
        if len(parts) == 1:
            return parts[0]
        flat = np.concatenate([p.flat for p in parts])
        shift = np.cumsum([0] + [int(p.offsets[-1] - p.offsets[0]) for p in parts[:-1]])
        off = np.concatenate([parts[0].offsets[:1] - parts[0].offsets[0]]
                             + [p.offsets[1:] - p.offsets[0] + s for p, s in zip(parts, shift)])  # fmt: skip
        return Ragged(flat, off)

    def tolist(self) -> list[list]:
        vals, o = self.flat.tolist(), self.offsets.tolist()
        return [vals[a:b] for a, b in zip(o[:-1], o[1:])]

    def __eq__(self, other) -> bool:
        if isinstance(other, Ragged):
            return bool(np.array_equal(self.offsets - self.offsets[0], other.offsets - other.offsets[0])
                        and np.array_equal(self.flat[self.offsets[0]:self.offsets[-1]],
                                           other.flat[other.offsets[0]:other.offsets[-1]]))  # fmt: skip
        try:
            return len(self) == len(other) and self.tolist() == [list(x) for x in other]
        except TypeError:
            return NotImplemented

    def __repr__(self) -> str:
        return f"Ragged({len(self)} rows, {len(self.flat)} values, {self.flat.dtype})"


def col_take(col, idx: np.ndarray):
    """``col[idx]`` for a list, numpy array or Ragged column (a slice/view when contiguous)."""
    if isinstance(col, np.ndarray):
        if len(idx) and int(idx[-1]) - int(idx[0]) == len(idx) - 1 and (len(idx) <= 2 or bool((np.diff(idx) == 1).all())):
            return col[int(idx[0]) : int(idx[-1]) + 1]
        return col[idx]
    if isinstance(col, Ragged):
        return col.take(idx)
    return take(col if isinstance(col, list) else list(col), idx)


def col_concat(parts: list):
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts)
    if all(isinstance(p, Ragged) for p in parts):
        return Ragged.concat(parts)
    out: list = []
    for p in parts:
        out.extend(p.tolist() if isinstance(p, np.ndarray) else p)
    return out


def plain(col) -> list:
    """A column as plain Python data (snapshots)."""
    if isinstance(col, (np.ndarray, Ragged)):
        return col.tolist()
    return [x.tolist() if isinstance(x, np.ndarray) else x for x in col]


class Pickled:
    """A list column pickled once by the writing handle: shards move it as bytes (no per-row
    unpickling/pickling in the shard); the reading handle unpickles it once per chunk."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data

    @property
    def nbytes(self) -> int:
        return len(self.data)


def pack_cols(columns: dict | None, min_rows: int = 64) -> dict | None:
    """List columns of ``min_rows`` or more as :class:`Pickled` (what the handle sends)."""
    if not columns:
        return columns
    return {f: Pickled(pickle.dumps(v, protocol=5))
            if f != "_version" and not isinstance(v, (np.ndarray, Ragged)) and len(v) >= min_rows else v
            for f, v in columns.items()}  # fmt: skip


def unpack_cols(columns: dict) -> dict:
    if not any(isinstance(v, Pickled) for v in columns.values()):
        return columns
    return {f: pickle.loads(v.data) if isinstance(v, Pickled) else v for f, v in columns.items()}


def nbytes(col) -> int:
    if isinstance(col, (np.ndarray, Ragged, Pickled)):
        return col.nbytes
    k = len(col)
    if k == 0:
        return 0
    x = col[0]
    if isinstance(x, np.ndarray):
        return k * (x.nbytes + 100)
    if isinstance(x, (list, tuple, str, bytes)):
        return k * (3 * len(x) + 16)
    return 9 * k
