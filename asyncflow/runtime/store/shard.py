"""One shard of the sharded sample store (:mod:`asyncflow.runtime.store.ray`), run as a Ray
actor: the row bookkeeping of its rows (an in-process
:class:`~asyncflow.runtime.store.local.SampleStore` whose values are chunk locators) and the data
chunks it references; shard 0 also allocates row indices.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import ray

from asyncflow.runtime.options import DEFAULT_CALL_TIMEOUT_S
from asyncflow.runtime.store.codec import col_take, nbytes, plain, unpack_cols
from asyncflow.runtime.store.common import Lease, StoreError
from asyncflow.runtime.store.local import SampleStore
from asyncflow.runtime.store.remote import DONE, INLINE, POLL_S, bounded_get


class Shard:
    """One shard: the row bookkeeping (a SampleStore whose values are chunk locators) and the
    data chunks it references; shard 0 also allocates row indices."""

    def __init__(self, index: int, lease_s: float, inline_bytes: int = INLINE,
                 call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S):
        self.index = index
        self.store = SampleStore(lease_s)
        self.inline_bytes = int(inline_bytes)
        self.call_timeout_s = float(call_timeout_s)
        self._next_row = 0
        self._alloc_lock = threading.Lock()
        self._chunk_lock = threading.Lock()
        self._chunks: dict[int, tuple[Any, np.ndarray]] = {}  # cid -> (ObjectRef | dict, rows)
        self._next_cid = 1
        self._peers: list = []
        self._cancelled: dict[str, float] = {}
        # lease parts whose every row was acked or released by ack_rows/release_rows: the lease
        # lives on in its other parts, so an op on this part answers None ("nothing here"), not
        # False ("the lease is stale")
        self._done: OrderedDict = OrderedDict()

    def ping(self) -> int:
        return self.index

    def set_peers(self, handles: list) -> None:
        self._peers = list(handles)

    # -------------------------------------------------------------- rows
    def _alloc(self, lengths: list[int], chunk: int) -> list[int]:
        """Start index of each group run, in call order; no run straddles a chunk boundary."""
        with self._alloc_lock:
            cur = self._next_row
            if lengths and all(x == lengths[0] for x in lengths) and chunk % lengths[0] == 0:
                size = lengths[0]
                cur = -(-cur // size) * size
                starts = list(range(cur, cur + size * len(lengths), size))
                cur += size * len(lengths)
            else:
                starts = []
                for size in lengths:
                    if size > chunk:
                        raise StoreError(f"a group of {size} rows does not fit a chunk of {chunk}")
                    if cur % chunk + size > chunk:
                        cur = -(-cur // chunk) * chunk
                    starts.append(cur)
                    cur += size
            self._next_row = cur
            return starts

    def next_row(self, value: int | None = None) -> int:
        with self._alloc_lock:
            if value is not None:
                self._next_row = max(self._next_row, value)
            return self._next_row

    # -------------------------------------------------------------- data chunks
    def _chunk(self, obj, rows: np.ndarray) -> int:
        with self._chunk_lock:
            cid = self._next_cid
            self._next_cid += 1
            self._chunks[cid] = (obj, np.asarray(rows, np.int64))
            return cid

    def _drop_chunk(self, cid: int | None) -> None:
        if cid is not None:
            with self._chunk_lock:
                self._chunks.pop(cid, None)

    def _ingest(self, columns: dict, rows):
        """Keep ``columns`` as one chunk (``_version`` goes to the bookkeeping); returns the
        locator columns for ``rows`` and the chunk id (None when there was no data)."""
        data = {f: v for f, v in columns.items() if f != "_version"}
        out = {f: v for f, v in columns.items() if f == "_version"}
        if not data:
            return out, None
        big = sum(nbytes(v) for v in data.values()) > self.inline_bytes
        cid = self._chunk(ray.put(data) if big else data, rows)
        base = cid << 32
        locs = list(range(base, base + len(rows)))
        for f in data:
            out[f] = locs
        return out, cid

    def add_rows(self, payload: dict, groups, versions, lengths: list[int], chunk: int) -> np.ndarray:
        """Shard 0: allocate rows, keep the data once, give every shard its rows' bookkeeping."""
        k = len(groups)
        starts = np.asarray(self._alloc(lengths, chunk), np.int64)
        lengths = np.asarray(lengths, np.int64)
        run_starts = np.r_[0, np.cumsum(lengths)[:-1]]
        rows = np.repeat(starts - run_starts, lengths) + np.arange(k)
        groups = np.asarray(groups, np.int64)
        data = {f: v for f, v in payload.items() if f != "_version"}
        fields = list(data)
        big = sum(nbytes(v) for v in data.values()) > self.inline_bytes
        obj = ray.put(data) if big else None
        if not big:
            data = unpack_cols(data)
        nsh = max(1, len(self._peers))
        sh = (rows // chunk) % nsh
        refs, mine = [], None
        for s in (np.unique(sh).tolist() if nsh > 1 else [0]):
            idx = np.flatnonzero(sh == s) if nsh > 1 else np.arange(k)
            v = None if versions is None else [versions[i] for i in idx.tolist()]
            part = [obj] if big else {f: col_take(c, idx) for f, c in data.items()}
            args = (rows[idx], groups[idx].tolist(), v, part, idx if big else None, fields)
            if s == self.index:
                mine = args
            else:
                refs.append(self._peers[s].attach.remote(*args))
        try:
            if mine is not None:
                self.attach(*mine)
        finally:
            bounded_get(refs, self.call_timeout_s)
        return rows

    def attach(self, rows: np.ndarray, groups: list[int], versions, part, offsets, fields: list[str]) -> None:
        """Rows (allocated by shard 0) whose data is ``part``: ``[ref]`` (positions ``offsets``
        of a chunk in the object store) or an inline column dict."""
        cid = None
        try:
            if isinstance(part, list):
                cid = self._chunk(part[0], rows)
                locs = (np.asarray(offsets, np.int64) + (cid << 32)).tolist()
                cols = {f: locs for f in fields}
            else:
                cols, cid = self._ingest(part, rows)
            self.store.add_rows(cols, groups, versions, rows=rows.tolist())
        except BaseException:
            self._drop_chunk(cid)
            raise

    def write(self, rows: list[int], columns: dict, lease_id: int | None = None) -> bool:
        st = self.store
        if lease_id is not None and not st.live(lease_id):
            return st.write(rows, {}, lease_id=lease_id)  # counts the stale write
        return self._stored(columns, rows, lambda cols: st.write(rows, cols, lease_id=lease_id))

    # -------------------------------------------------------------- lease parts
    # A handle's lease is one part per shard (``_pack``); ``first`` is False for every part but
    # the lowest shard's, which alone counts a stale ack (the store counts leases, not parts).
    def _ended(self, lease_id: int, first: bool) -> bool | None:
        """None: the part ended with its last row (nothing to do here); False: not live, and
        not the first part (answer False without counting a stale ack); True: go on."""
        if lease_id in self._done:
            return None
        if not first and not self.store.live(lease_id):
            return False
        return True

    def _finished(self, lease_id: int, ok: bool) -> bool:
        if ok and not self.store.live(lease_id):
            self._done[lease_id] = True
            while len(self._done) > DONE:
                self._done.popitem(last=False)
        return ok

    def lease_op(self, method: str, lease_id: int, first: bool = True, *args):
        """``renew`` or ``release`` of one lease part (None: the part had ended, see ``_done``)."""
        go = self._ended(lease_id, first)
        return go if go is not True else getattr(self.store, method)(lease_id, *args)

    def renew_each(self, lease_ids: list[int], lease_s: float | None = None) -> list:
        """:meth:`lease_op` ``renew`` of many parts (a heartbeat), one answer each."""
        return [None if lid in self._done else self.store.renew(lid, lease_s) for lid in lease_ids]

    def uncount(self, lease_ids: list[int]) -> None:
        for lid in lease_ids:
            self.store.uncount(lid)

    def ack(self, lease_id: int, columns: dict | None = None, first: bool = True) -> bool | None:
        go = self._ended(lease_id, first)
        if go is not True:
            return go
        st = self.store
        rows = st.lease_rows(lease_id) if columns else None
        if rows is None:
            return st.ack(lease_id)
        return self._stored(columns, rows, lambda cols: st.ack(lease_id, cols))

    def ack_each(self, parts: list) -> list:
        """:meth:`ack` (no columns) of many lease parts, ``[(lease id, first), ...]``, in one
        call (the handle's ``ack_many``): one answer each, in order."""
        return [self.ack(lid, None, first) for lid, first in parts]

    def ack_rows(self, lease_id: int, rows: list[int], columns: dict | None = None,
                 first: bool = True) -> bool | None:
        go = self._ended(lease_id, first)
        if go is not True:
            return go
        if not columns:
            return self._finished(lease_id, self.store.ack_rows(lease_id, rows))
        return self._finished(lease_id, self._stored(
            columns, rows, lambda cols: self.store.ack_rows(lease_id, rows, cols)))

    def _stored(self, columns: dict, rows, call) -> bool:
        """``call(cols)`` with ``columns`` ingested for ``rows``; their chunk is freed again
        when the call fails or is refused (a stale lease)."""
        cols, cid = self._ingest(columns, rows)
        try:
            ok = call(cols)
        except BaseException:
            self._drop_chunk(cid)
            raise
        if not ok:
            self._drop_chunk(cid)
        return ok

    def release_rows(self, lease_id: int, rows: list[int], first: bool = True) -> bool | None:
        go = self._ended(lease_id, first)
        if go is not True:
            return go
        return self._finished(lease_id, self.store.release_rows(lease_id, rows))

    def trim(self, lease_id: int, keep: list[int], uncount: bool = False) -> bool:
        """Give back the rows of a live lease that are not in ``keep`` (the handle's surplus);
        ``uncount``: the part is not its lease's first (:meth:`SampleStore.uncount`)."""
        ok = self.store.trim(lease_id, keep)
        if uncount:
            self.store.uncount(lease_id)
        return ok

    def get(self, task, n, kw, acks: list | None = None):
        """A lease of this shard: (id, rows, bookkeeping columns, locators per field, chunks).
        With ``acks`` (``[(lease id, columns), ...]``, a worker's last leases): each acked first
        (:meth:`ack`), and the answer is ``(their answers, the lease)``."""
        answers = [self.ack(lid, cols or None, True) for lid, cols in acks or ()]
        lease = self.store.get(task, n, **kw)
        part = None if lease is None else self._part(lease)
        return part if acks is None else (answers, part)

    def get_split(self, task, n, split, kw):
        """:meth:`SampleStore.get_split` on this shard as one part over all its leases:
        ``(ids, sizes, rows, bookkeeping, locators, chunks)`` -- lease ``ids[i]`` is the next
        ``sizes[i]`` rows -- so the handle assembles the columns once, not once a lease; None
        when nothing was leased."""
        leases = self.store.get_split(task, n, split, **kw)
        if not leases:
            return None
        ids = [lease.id for lease in leases]
        sizes = [len(lease.rows) for lease in leases]
        if len(leases) == 1:
            return (ids, sizes, *self._part(leases[0])[1:])
        cols = {f: [x for lease in leases for x in lease.columns[f]] for f in leases[0].columns}
        rows = [r for lease in leases for r in lease.rows]
        return (ids, sizes, *self._part(Lease(0, task, rows, cols, 0.0))[1:])

    def _part(self, lease):
        book, locs, cids = {}, {}, set()
        for f, col in lease.columns.items():
            if f in ("_row", "_group", "_version"):
                book[f] = col
                continue
            try:
                arr = np.asarray(col, np.int64)
            except TypeError:  # rows without this field: None
                arr = np.asarray([-1 if x is None else x for x in col], np.int64)
            locs[f] = arr
            cids.update(np.unique(arr[arr >= 0] >> 32).tolist())
        chunks = self._chunks
        return lease.id, lease.rows, book, locs, {c: chunks[c][0] for c in cids}

    def gc(self) -> int:
        st = self.store
        freed = st.gc()
        with self._chunk_lock:
            for cid, (_, rows) in list(self._chunks.items()):
                if st.all_freed(rows):
                    del self._chunks[cid]
        return freed

    def chunk_count(self) -> int:
        return len(self._chunks)

    def snapshot(self) -> dict:
        d = self.store.snapshot()
        chunks = dict(self._chunks)
        refs = {c: o for c, (o, _) in chunks.items() if isinstance(o, ray.ObjectRef)}
        vals = dict(zip(refs, bounded_get(list(refs.values()), self.call_timeout_s))) if refs else {}
        for f, fd in d["fields"].items():
            locs = fd["values"]
            out: list = [None] * len(locs)
            arr = np.asarray([-1 if x is None else x for x in locs], np.int64)
            for c in np.unique(arr[arr >= 0] >> 32).tolist():
                where = np.flatnonzero((arr >> 32) == c)
                obj = vals[c] if c in vals else chunks[c][0]
                got = plain(col_take(unpack_cols({f: obj[f]})[f], arr[where] & 0xFFFFFFFF))
                for i, x in zip(where.tolist(), got):
                    out[i] = x
            fd["values"] = out
        return d

    def restore(self, d: dict) -> None:
        self._chunks.clear()
        self._done.clear()  # lease ids are the snapshot's from here on
        d = dict(d)
        fields = {}
        for f, fd in d["fields"].items():
            if not fd["rows"]:
                fields[f] = fd
                continue
            cols, _ = self._ingest({f: list(fd["values"])}, np.asarray(fd["rows"], np.int64))
            fields[f] = {"rows": fd["rows"], "values": cols[f]}
        d["fields"] = fields
        self.store = SampleStore.restore(d)

    def call(self, method: str, *args, **kwargs) -> Any:
        return getattr(self.store, method)(*args, **kwargs)

    def peek(self, task, n, kw, since=None, timeout=0.0, poll_id=None):
        """:meth:`SampleStore.peek` (a long poll with ``since``); the change counter is -1 once
        the store's waits are stopped (:meth:`SampleStore.stop_waits`): the handle's read
        gives up rather than poll again."""
        try:
            cancelled = (lambda: poll_id in self._cancelled) if poll_id else None
            got = self.store.peek(task, n, since=since, timeout=timeout, cancelled=cancelled, **kw)
            return (-1, got[1]) if self.store.waits_stopped else got
        finally:
            self._cancelled.pop(poll_id, None)

    def cancel_poll(self, poll_id: str) -> None:
        now = time.monotonic()
        self._cancelled[poll_id] = now
        if len(self._cancelled) > 1000:  # polls that finished before their cancel arrived
            for k, t in list(self._cancelled.items()):
                if now - t > 2 * POLL_S:
                    self._cancelled.pop(k, None)
        self.store.notify()

