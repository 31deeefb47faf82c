"""The sample store sharded across Ray actors: :class:`RayStore`, same methods as
:class:`~asyncflow.runtime.store.SampleStore`.

Layout. Global row indices are handed out by shard 0, in call order, so a later ``add_rows``
always gets higher indices (the driver relies on a step owning a contiguous range). Row ``r`` lives
on shard ``(r // chunk) % shards``; the allocator never lets a group straddle a chunk boundary (it
skips to the next chunk, leaving unused indices), so **a group lives on one shard** and whole-group
completeness is a shard-local question. Consequences: the rows of one group must be adjacent in one
``add_rows`` call, and a group may not have more than ``chunk`` rows.

Data path (after TransferQueue). Shards keep the row *bookkeeping* (a
:class:`~asyncflow.runtime.store.SampleStore`: ready bits, consumption marks, leases) but not the
column data: every write (``add_rows``, ``write``, ``ack(lease, columns)``) becomes one *data chunk*
(the call's ``dict[field, column]``), ``ray.put`` by the shard that receives it (so the shard owns
it: the data outlives the producer), or kept inline in the shard when it is small
(``inline_bytes``). A row's value of a field is a *locator* ``chunk id << 32 | position``. ``get``
returns row indices, locators and the chunks' object refs; the handle fetches all new chunks in one
``ray.get`` (numpy columns: zero-copy from the object store), keeps a small cache of them, and
slices. ``add_rows`` is one call: shard 0 allocates the rows, puts the data once and hands the
other shards their rows' bookkeeping with the same object ref.

Columns may be Python lists (values come back as lists, as written), numpy arrays (come back as
numpy arrays, read-only views where possible) or :class:`Ragged` (variable-length rows such as
token ids as one flat array + offsets, no padding; come back as :class:`Ragged`). numpy and
:class:`Ragged` columns move without per-row pickling: that is the fast path.

``get`` across shards (the ordering guarantee): every shard leases its lowest eligible rows (up to
``n``; whole groups: its lowest ``n // group_size`` groups) in one parallel round; the handle keeps
the ``n`` lowest over all shards (whole groups: the groups with the lowest first rows) and gives the
rest back (``trim``: only when there is a surplus). So without competing replicas of the same task,
``get`` returns exactly the lowest eligible rows, as the in-process store does. With competitors,
a competitor may briefly hold rows another then gives back; never a duplicate, always below
``max_row``. If the total falls below ``min_rows`` everything is released and the handle waits with
a long poll on every shard's change counter (no busy polling), then tries again until ``timeout``.

Leases: the handle's lease id packs the shards' own lease ids (``40`` bits each), so any copy of
the handle (it pickles: workers use it) can ack, release or renew it. A lease over several shards
is still one lease: it lives while any part holds rows (a part whose rows were all acked or
released by ``ack_rows``/``release_rows`` answers "ended", not "stale"), a row of another shard
or of an ended part is a ``StoreError``, and the counts (``leases_live``, ``leases_reissued``,
``leases_revoked``, ``leases_restored``, ``stale_acks``, what ``expire``, ``revoke`` and
``renew_many`` return) count leases, not parts: only the lowest shard's part is counted
(:meth:`SampleStore.uncount` marks the others). Expiry is per shard (the parts share a deadline
and are renewed together); a multi-part ack is not atomic across shards, and once the counted
part has ended by ``ack_rows`` the lease's other live parts are not in ``leases_live``.

``gc`` frees the values of fully consumed rows and drops a shard's reference to a chunk once all of
that shard's rows in it are freed (Ray frees the object when no shard references it).
``snapshot`` fetches the referenced chunks and writes plain values; ``restore`` puts them back.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

import numpy as np
import ray

from asyncflow.runtime.codec import Ragged  # noqa: F401 -- re-exported: columns users build
from asyncflow.runtime.codec import col_concat as _col_concat
from asyncflow.runtime.codec import col_take as _col_take
from asyncflow.runtime.codec import nbytes as _nbytes
from asyncflow.runtime.codec import pack_cols as _pack_cols
from asyncflow.runtime.codec import plain as _plain
from asyncflow.runtime.codec import unpack_cols as _unpack_cols
from asyncflow.runtime.store import (SNAPSHOT_FORMAT, Lease, SampleStore, StoreError, StoreLost,
                                     check_new_rows)

_BITS = 40
_MASK = (1 << _BITS) - 1
_POLL_S = 5.0  # the longest one long poll waits before the handle re-polls
_INLINE = 64 * 1024  # chunks below this many bytes stay inline in the shard (no object store)
_CACHE = 16  # fetched chunks a handle keeps
_DONE = 65536  # lease parts a shard remembers as ended by their last row (ack_rows/release_rows)
# every call to a shard is bounded: a shard that does not answer within this many seconds (plus
# the call's own wait) is lost, and the caller gets StoreLost instead of hanging forever
CALL_TIMEOUT_S = float(os.environ.get("ASYNCFLOW_CALL_TIMEOUT_S", "120"))


def _get(refs, wait_s: float = 0.0):
    """``ray.get`` with a bound; a shard that times out or died is :class:`StoreLost`."""
    limit = CALL_TIMEOUT_S + float(wait_s or 0.0)
    try:
        return ray.get(refs, timeout=limit)
    except ray.exceptions.GetTimeoutError:
        raise StoreLost(f"a sample-store shard did not answer within {limit:.0f} s") from None
    except ray.exceptions.RayActorError as e:
        raise StoreLost(f"a sample-store shard died ({str(e).splitlines()[0][:200]})") from None


# ---------------------------------------------------------------------- column types
# ---------------------------------------------------------------------- shards
class _Shard:
    """One shard: the row bookkeeping (a SampleStore whose values are chunk locators) and the
    data chunks it references; shard 0 also allocates row indices."""

    def __init__(self, index: int, lease_s: float, inline_bytes: int = _INLINE):
        self.index = index
        self.store = SampleStore(lease_s)
        self.inline_bytes = int(inline_bytes)
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

    def alloc(self, lengths: list[int], chunk: int) -> list[int]:
        return self._alloc(lengths, chunk)

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
        big = sum(_nbytes(v) for v in data.values()) > self.inline_bytes
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
        big = sum(_nbytes(v) for v in data.values()) > self.inline_bytes
        obj = ray.put(data) if big else None
        if not big:
            data = _unpack_cols(data)
        nsh = max(1, len(self._peers))
        sh = (rows // chunk) % nsh
        refs, mine = [], None
        for s in (np.unique(sh).tolist() if nsh > 1 else [0]):
            idx = np.flatnonzero(sh == s) if nsh > 1 else np.arange(k)
            v = None if versions is None else [versions[i] for i in idx.tolist()]
            part = [obj] if big else {f: _col_take(c, idx) for f, c in data.items()}
            args = (rows[idx], groups[idx].tolist(), v, part, idx if big else None, fields)
            if s == self.index:
                mine = args
            else:
                refs.append(self._peers[s].attach.remote(*args))
        try:
            if mine is not None:
                self.attach(*mine)
        finally:
            _get(refs)
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
            while len(self._done) > _DONE:
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

    def get(self, task, n, kw):
        """A lease of this shard: (id, rows, bookkeeping columns, locators per field, chunks)."""
        lease = self.store.get(task, n, **kw)
        return None if lease is None else self._part(lease)

    def get_split(self, task, n, split, kw):
        """:meth:`SampleStore.get_split` on this shard: a list of :meth:`get`'s parts."""
        return [self._part(lease) for lease in self.store.get_split(task, n, split, **kw)]

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
        vals = dict(zip(refs, _get(list(refs.values())))) if refs else {}
        for f, fd in d["fields"].items():
            locs = fd["values"]
            out: list = [None] * len(locs)
            arr = np.asarray([-1 if x is None else x for x in locs], np.int64)
            for c in np.unique(arr[arr >= 0] >> 32).tolist():
                where = np.flatnonzero((arr >> 32) == c)
                obj = vals[c] if c in vals else chunks[c][0]
                got = _plain(_col_take(_unpack_cols({f: obj[f]})[f], arr[where] & 0xFFFFFFFF))
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
        try:
            cancelled = (lambda: poll_id in self._cancelled) if poll_id else None
            return self.store.peek(task, n, since=since, timeout=timeout, cancelled=cancelled, **kw)
        finally:
            self._cancelled.pop(poll_id, None)

    def cancel_poll(self, poll_id: str) -> None:
        now = time.monotonic()
        self._cancelled[poll_id] = now
        if len(self._cancelled) > 1000:  # polls that finished before their cancel arrived
            for k, t in list(self._cancelled.items()):
                if now - t > 2 * _POLL_S:
                    self._cancelled.pop(k, None)
        self.store.notify()


def _pack(parts: dict[int, int]) -> int:
    return sum(lid << (_BITS * s) for s, lid in parts.items())


def _unpack(lease_id: int, shards: int) -> dict[int, int]:
    return {s: (lease_id >> (_BITS * s)) & _MASK for s in range(shards) if (lease_id >> (_BITS * s)) & _MASK}


def _joined(answers) -> bool:
    """One lease's answer from its parts': None is a part that had ended with its last row; the
    lease is live while some part is, and an op succeeds when every live part's does."""
    live = [a for a in answers if a is not None]
    return bool(live) and all(live)


class RayStore:
    """A :class:`SampleStore` sharded over ``shards`` Ray actors (module docstring)."""

    def __init__(
        self,
        shards: int = 2,
        lease_s: float = 60.0,
        chunk: int = 1024,
        *,
        actor_options: dict | None = None,
        inline_bytes: int = _INLINE,
        _handles: list | None = None,
    ):
        self.lease_s = float(lease_s)
        self.chunk = int(chunk)
        if _handles is None:
            opts = {"num_cpus": 0, "max_concurrency": 64, **(actor_options or {})}
            cls = ray.remote(_Shard).options(**opts)
            _handles = [cls.remote(i, lease_s, inline_bytes) for i in range(shards)]
            _get([h.ping.remote() for h in _handles])
        self._shards = list(_handles)
        _get(self._shards[0].set_peers.remote(self._shards))
        self._init_local()

    def _init_local(self) -> None:
        self._poll_ids = (f"{os.getpid()}-{uuid.uuid4().hex[:8]}-{i}" for i in itertools.count())
        self._issued: dict[int, list[int]] = {}  # lease id -> rows, for ack(lease_id, columns)
        self._cache: OrderedDict = OrderedDict()  # ObjectRef -> fetched chunk
        self._cache_lock = threading.Lock()

    def __getstate__(self):
        return {"lease_s": self.lease_s, "chunk": self.chunk, "_shards": self._shards}

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._init_local()

    @property
    def shards(self) -> int:
        return len(self._shards)

    def shutdown(self) -> None:
        """Kill the shard actors (the store's data goes with them)."""
        for h in self._shards:
            try:
                ray.kill(h)
            except Exception:  # already gone
                pass

    # ------------------------------------------------------------------ routing
    def _shard_of(self, rows) -> np.ndarray:
        return (np.asarray(rows, np.int64) // self.chunk) % len(self._shards)

    def _split(self, rows, columns: dict | None):
        """{shard: (rows, column chunk)} for rows listed in ``rows`` order."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        if len(self._shards) == 1:
            return {0: (rows.tolist(), columns)}
        sh = self._shard_of(rows)
        out = {}
        for s in np.unique(sh).tolist():
            idx = np.flatnonzero(sh == s)
            cols = None if columns is None else {f: _col_take(v, idx) for f, v in columns.items()}
            out[s] = (rows[idx].tolist(), cols)
        return out

    def _all(self, method: str, *args, **kwargs) -> list:
        return _get([h.call.remote(method, *args, **kwargs) for h in self._shards])

    # ------------------------------------------------------------------ writing
    def register_task(self, task: str, inputs: list[str]) -> None:
        self._all("register_task", task, list(inputs))

    def start_rows_at(self, first_row: int) -> None:
        """Number the next rows from ``first_row`` on (shard 0 allocates them)."""
        _get(self._shards[0].next_row.remote(int(first_row)))

    def add_rows(self, columns: dict, groups: list[int], versions: list[int] | None = None) -> list[int]:
        """Append rows; a group's rows must be adjacent here (module docstring). Returns indices.
        One call (to shard 0, which allocates the rows and keeps the data)."""
        k = len(groups)
        columns, versions = check_new_rows(columns, groups, versions)
        if k == 0:
            return []
        g = np.asarray(groups, np.int64)
        starts_of_runs = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        lengths = np.diff(np.r_[starts_of_runs, k])
        if len(np.unique(g[starts_of_runs])) != len(starts_of_runs):
            raise StoreError("add_rows: the rows of a group must be adjacent")
        versions = None if versions is None else list(versions)
        payload = _pack_cols(columns)
        rows = _get(self._shards[0].add_rows.remote(payload, g, versions, lengths.tolist(), self.chunk))
        return rows.tolist()

    def write(self, rows: list[int], columns: dict, *, lease_id: int | None = None) -> bool:
        parts = None if lease_id is None else _unpack(getattr(lease_id, "id", lease_id), len(self._shards))
        refs = []
        for s, (srows, scols) in self._split(rows, columns).items():
            lid = None if parts is None else parts.get(s, _MASK)  # _MASK: a lease id no shard has
            refs.append(self._shards[s].write.remote(srows, _pack_cols(scols), lid))
        return all(_get(refs))

    # ------------------------------------------------------------------ reading
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
        filter_fn=None,
        min_version: int | None = None,
        fields: list[str] | None = None,
        lease_s: float | None = None,
        owner: str | None = None,
    ) -> Lease | None:
        """As :meth:`SampleStore.get`, across shards (ordering: module docstring)."""
        deadline = time.monotonic() + timeout
        sel = {"whole_groups": whole_groups, "group_size": group_size, "max_row": max_row,
               "min_version": min_version, "filter_fn": filter_fn}  # fmt: skip
        need = max(int(min_rows), 1)
        unit = group_size if whole_groups else 1
        if len(self._shards) == 1:
            kw = {**sel, "min_rows": min_rows, "timeout": timeout, "fields": fields,
                  "lease_s": lease_s, "owner": owner}
            part = _get(self._shards[0].get.remote(task, n, kw), timeout)
            return None if part is None else self._assemble(task, {0: part}, lease_s)
        kw = {**sel, "min_rows": 1, "timeout": 0.0, "fields": fields, "lease_s": lease_s,
              "owner": owner}
        polls: dict[int, tuple[str, Any]] = {}
        try:
            while True:
                # one round: every shard leases its lowest rows; keep the lowest n over all
                refs = [h.get.remote(task, n, kw) for h in self._shards]
                parts = {s: p for s, p in enumerate(_get(refs)) if p is not None}
                parts = self._keep_lowest(parts, n // unit, whole_groups)
                if sum(len(p[1]) for p in parts.values()) >= need:
                    return self._assemble(task, parts, lease_s)
                if parts:
                    _get([self._shards[s].call.remote("release", p[0]) for s, p in parts.items()])
                if time.monotonic() >= deadline:
                    return None
                latest = _get([h.peek.remote(task, n, sel) for h in self._shards])
                while True:  # wait until the shards together look like enough
                    if sum(self._quota(latest, n // unit, unit).values()) >= need:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    for s, h in enumerate(self._shards):
                        if s not in polls:
                            pid = next(self._poll_ids)
                            polls[s] = (pid, h.peek.remote(task, n, sel, latest[s][0], min(left, _POLL_S), pid))
                    by_ref = {ref: s for s, (_, ref) in polls.items()}
                    done, _ = ray.wait(list(by_ref), num_returns=1, timeout=left)
                    for ref in done:
                        s = by_ref[ref]
                        latest[s] = _get(ref)
                        del polls[s]
        finally:
            for s, (pid, _) in polls.items():
                self._shards[s].cancel_poll.remote(pid)

    def get_split(
        self,
        task: str,
        n: int,
        split: int,
        *,
        min_rows: int = 1,
        max_row: int | None = None,
        timeout: float = 0.0,
        filter_fn=None,
        min_version: int | None = None,
        fields: list[str] | None = None,
        lease_s: float | None = None,
        owner: str | None = None,
    ) -> list[Lease]:
        """As :meth:`SampleStore.get_split`: one actor call with one shard; with several, the
        shards' ordering rule holds only read by read, so the leases are taken one
        :meth:`get` of ``split`` rows at a time (the first waits ``timeout``)."""
        kw = {"max_row": max_row, "min_version": min_version, "filter_fn": filter_fn,
              "fields": fields, "lease_s": lease_s, "owner": owner}
        if len(self._shards) == 1:
            parts = _get(self._shards[0].get_split.remote(
                task, n, split, {**kw, "min_rows": min_rows, "timeout": timeout}), timeout)
            return [self._assemble(task, {0: p}, lease_s) for p in parts]
        out: list[Lease] = []
        while sum(len(x.rows) for x in out) < n:
            left = n - sum(len(x.rows) for x in out)
            want = min(split, left)
            lease = self.get(task, want, min_rows=want if out else min(min_rows, want),
                             timeout=0.0 if out else timeout, **kw)
            if lease is None:
                break
            out.append(lease)
        return out

    def _keep_lowest(self, parts: dict[int, tuple], units: int, whole_groups: bool) -> dict[int, tuple]:
        """The lowest ``units`` rows (groups) over the shards' leases; the rest is given back."""
        if len(parts) <= 1:  # one shard's lease is already its lowest units
            return parts
        lead = min(parts)  # the part counted as the lease (SampleStore.uncount)
        keys = []
        for s, p in parts.items():
            if whole_groups:
                first: dict[int, int] = {}
                for r, g in zip(p[1], p[2]["_group"]):
                    if g not in first or r < first[g]:
                        first[g] = r
                keys += [(r, s, g) for g, r in first.items()]
            else:
                keys += [(r, s, r) for r in p[1]]
        if len(keys) <= units:  # every part kept: all but the first are not counted as leases
            _get([self._shards[s].uncount.remote([p[0]]) for s, p in parts.items() if s != lead])
            return parts
        keys.sort()
        chosen: dict[int, set] = {}
        for _, s, u in keys[:units]:
            chosen.setdefault(s, set()).add(u)
        lead = min(chosen)
        out, refs = {}, []
        for s, p in parts.items():
            pick = chosen.get(s)
            if not pick:
                refs.append(self._shards[s].call.remote("release", p[0]))
                continue
            col = p[2]["_group"] if whole_groups else p[1]
            keep = np.flatnonzero(np.fromiter((u in pick for u in col), bool, len(col)))
            if len(keep) == len(col):
                out[s] = p
                if s != lead:
                    refs.append(self._shards[s].uncount.remote([p[0]]))
                continue
            lid, rows, book, locs, chunks = p
            rows = [rows[i] for i in keep.tolist()]
            book = {f: [v[i] for i in keep.tolist()] for f, v in book.items()}
            locs = {f: v[keep] for f, v in locs.items()}
            refs.append(self._shards[s].trim.remote(lid, rows, s != lead))
            out[s] = (lid, rows, book, locs, chunks)
        _get(refs)
        return out

    @staticmethod
    def _quota(latest, units: int, unit: int) -> dict[int, int]:
        """Rows per shard so that the lowest ``units`` peeked units are taken."""
        keys = [(r, s) for s, (_, rows) in enumerate(latest) for r in rows]
        keys.sort()
        quota: dict[int, int] = {}
        for _, s in keys[:units]:
            quota[s] = quota.get(s, 0) + unit
        return quota

    def _fetch(self, refs: list) -> list:
        """Chunks by ref, one ``ray.get`` for those not cached."""
        with self._cache_lock:
            miss = [r for r in dict.fromkeys(refs) if r not in self._cache]
        got = {r: _unpack_cols(v) for r, v in zip(miss, _get(miss))} if miss else {}
        with self._cache_lock:
            for r, v in got.items():
                self._cache[r] = v
            out = []
            for r in refs:
                v = got.get(r)
                if v is None:
                    v = self._cache[r]
                    self._cache.move_to_end(r)
                out.append(v)
            while len(self._cache) > _CACHE:
                self._cache.popitem(last=False)
        return out

    def _assemble(self, task: str, parts: dict[int, tuple], lease_s) -> Lease:
        lid = _pack({s: p[0] for s, p in parts.items()})
        deadline = time.monotonic() + (self.lease_s if lease_s is None else lease_s)
        plist = list(parts.items())
        # every chunk referenced, numbered 0..; refs fetched at once
        objs, index = [], {}
        for s, p in plist:
            for c, o in p[4].items():
                index[(s, c)] = len(objs)
                objs.append(o)
        is_ref = [isinstance(o, ray.ObjectRef) for o in objs]
        if any(is_ref):
            fetched = iter(self._fetch([o for o, r in zip(objs, is_ref) if r]))
            objs = [next(fetched) if r else o for o, r in zip(objs, is_ref)]
        objs = [o if r else _unpack_cols(o) for o, r in zip(objs, is_ref)]
        if len(plist) == 1:
            (_, (_, rows, book, locs, _)), = plist
            order = None
        else:
            rows = [r for _, p in plist for r in p[1]]
            order = np.argsort(np.asarray(rows, np.int64), kind="stable")
            rows = np.asarray(rows, np.int64)[order].tolist()
            book = {f: [x for _, p in plist for x in p[2][f]] for f in plist[0][1][2]}
            book = {f: [v[i] for i in order.tolist()] for f, v in book.items()}
        cols: dict[str, Any] = {}
        for f in plist[0][1][3]:
            keys, offs = [], []
            for s, p in plist:
                loc = p[3][f]
                cid = loc >> 32
                key = np.full(len(loc), -1, np.int64)
                ok = loc >= 0
                if ok.any():
                    u, inv = np.unique(cid[ok], return_inverse=True)
                    key[ok] = np.asarray([index[(s, c)] for c in u.tolist()], np.int64)[inv]
                keys.append(key)
                offs.append(loc & 0xFFFFFFFF)
            key = np.concatenate(keys) if len(keys) > 1 else keys[0]
            off = np.concatenate(offs) if len(offs) > 1 else offs[0]
            if order is not None:
                key, off = key[order], off[order]
            cols[f] = self._gather(objs, f, key, off)
        cols.update(book)
        if len(self._issued) > 10000:
            self._issued.clear()
        self._issued[lid] = rows
        return Lease(lid, task, rows, cols, deadline)

    @staticmethod
    def _gather(objs: list, f: str, key: np.ndarray, off: np.ndarray):
        k = len(key)
        if k == 0:
            return []
        cut = np.flatnonzero(key[1:] != key[:-1]) + 1
        bounds = [0, *cut.tolist(), k]
        segs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            c = int(key[a])
            segs.append([None] * (b - a) if c < 0 else _col_take(objs[c][f], off[a:b]))
        return _col_concat(segs)

    # ------------------------------------------------------------------ lease lifecycle
    def ack(self, lease_id: int | Lease, columns: dict | None = None) -> bool:
        """As :meth:`SampleStore.ack`. With ``columns``, pass the Lease (or use the handle that
        got it): the handle must know the lease's rows to route them."""
        parts, refs = self._send_ack(lease_id, columns)
        return self._acked(parts, _get(refs))

    def ack_many(self, lease_ids: list) -> list[bool]:
        """As :meth:`SampleStore.ack_many`: every shard call of every lease is sent before any
        answer is awaited, so the leases cost one round trip, not one each (and the order in
        which they are consumed among themselves is not defined)."""
        sent = [self._send_ack(lease) for lease in lease_ids]
        answers = _get([r for _, refs in sent for r in refs])
        out, i = [], 0
        for parts, refs in sent:
            out.append(self._acked(parts, answers[i:i + len(refs)]))
            i += len(refs)
        return out

    def _send_ack(self, lease_id: int | Lease, columns: dict | None = None) -> tuple[dict, list]:
        """Send a lease's ack to each shard it has a part on: (its parts, the calls' refs)."""
        lid = getattr(lease_id, "id", lease_id)
        parts = _unpack(lid, len(self._shards))
        rows = getattr(lease_id, "rows", None) or self._issued.get(lid)
        self._issued.pop(lid, None)
        first = min(parts, default=0)
        if columns and len(parts) > 1:
            if rows is None:
                raise StoreError("ack with columns needs the Lease (this handle did not issue it)")
            split = self._split(rows, columns)
            refs = [self._shards[s].ack.remote(p, _pack_cols(split.get(s, (None, None))[1]), s == first)
                    for s, p in parts.items()]
        else:
            refs = [self._shards[s].ack.remote(p, _pack_cols(columns), s == first) for s, p in parts.items()]
        return parts, refs

    def _acked(self, parts: dict[int, int], answers: list) -> bool:
        """A lease's ack from its parts' answers: a stale ack (every part had ended) is counted
        once."""
        if answers and all(a is None for a in answers):
            self._stale_ack(parts)
        return _joined(answers)

    def _rows_op(self, method: str, lease_id: int | Lease, rows: list[int], columns: dict | None) -> bool:
        """``ack_rows`` or ``release_rows``: each shard does its part of ``rows``. A row on a
        shard where the lease has no part, or only a part that had ended, is not the lease's:
        StoreError, as in the in-process store."""
        lid = getattr(lease_id, "id", lease_id)
        parts = _unpack(lid, len(self._shards))
        split = self._split([int(r) for r in rows], columns or {})
        foreign = [r_s[0] for s, (r_s, _) in split.items() if s not in parts and r_s]
        if foreign and parts:
            raise StoreError(f"row {foreign[0]} is not in lease {lid}")
        shards = [s for s in split if s in parts]
        first = min(shards, default=0)  # the one part that counts a stale ack
        if method == "ack_rows":
            refs = [self._shards[s].ack_rows.remote(parts[s], split[s][0], _pack_cols(split[s][1]) if columns else None,
                                                    s == first) for s in shards]
        else:
            refs = [self._shards[s].release_rows.remote(parts[s], split[s][0], s == first) for s in shards]
        answers = _get(refs)
        ended = [split[s][0][0] for s, a in zip(shards, answers) if a is None]
        if ended and not any(answers):  # is the lease live in a part not asked?
            others = [s for s in parts if s not in shards]
            answers += _get([self._shards[s].call.remote("live", parts[s]) for s in others])
        if ended and any(answers):
            raise StoreError(f"row {ended[0]} is not in lease {lid}")
        if method == "ack_rows" and answers and all(a is None for a in answers):
            self._stale_ack(parts)
        return _joined(answers)

    def _stale_ack(self, parts: dict[int, int]) -> None:
        """Every part of the lease had ended: an ack of it is stale, counted once (the ack of
        its first, ended part, which the shard's store counts)."""
        first = min(parts)
        _get(self._shards[first].call.remote("ack", parts[first]))

    def ack_rows(self, lease_id: int | Lease, rows: list[int], columns: dict | None = None) -> bool:
        """As :meth:`SampleStore.ack_rows`: each shard acks its part of ``rows``."""
        return self._rows_op("ack_rows", lease_id, rows, columns)

    def release_rows(self, lease_id: int | Lease, rows: list[int]) -> bool:
        return self._rows_op("release_rows", lease_id, rows, None)

    def _lease_op(self, method: str, lease_id: int | Lease, *args) -> bool:
        lid = getattr(lease_id, "id", lease_id)
        parts = _unpack(lid, len(self._shards))
        first = min(parts, default=0)
        return _joined(_get([self._shards[s].lease_op.remote(method, p, s == first, *args)
                             for s, p in parts.items()]))

    def release(self, lease_id: int | Lease) -> bool:
        self._issued.pop(getattr(lease_id, "id", lease_id), None)
        return self._lease_op("release", lease_id)

    def renew(self, lease_id: int | Lease, lease_s: float | None = None) -> bool:
        return self._lease_op("renew", lease_id, lease_s)

    def renew_many(self, lease_ids: list[int], lease_s: float | None = None) -> int:
        """Renew many leases: one call per shard that holds any of them (a heartbeat); returns
        how many leases were still live."""
        per: dict[int, list[int]] = {}
        parts = [_unpack(int(lid), len(self._shards)) for lid in lease_ids]
        for ps in parts:
            for s, p in ps.items():
                per.setdefault(s, []).append(p)
        if not per:
            return 0
        shards = list(per)
        got = dict(zip(shards, _get([self._shards[s].renew_each.remote(per[s], lease_s) for s in shards])))
        answer = {s: dict(zip(per[s], got[s])) for s in shards}
        return sum(_joined(answer[s][p] for s, p in ps.items()) for ps in parts)

    def revoke(self, owner: str) -> int:
        """Give back every live lease of worker ``owner`` on every shard (it died)."""
        return sum(self._all("revoke", owner))

    def expire(self, now: float | None = None) -> int:
        """Expire leases past deadline on every shard; returns the shard leases expired."""
        return sum(self._all("expire", now))

    def drop(self, rows: list[int], reason: str) -> int:
        refs = [self._shards[s].call.remote("drop", r, reason) for s, (r, _) in self._split(rows, None).items()]
        return sum(_get(refs))

    # ------------------------------------------------------------------ inspection
    def consumed(self, task: str) -> list[int]:
        """Rows consumed by ``task``, in ack order (shards' acks merged by ack time)."""
        logs = [e for log in self._all("consumed_log", task) for e in log]
        logs.sort(key=lambda e: e[0])
        return [r for _, rows in logs for r in rows]

    def pending(self, task: str) -> int:
        return sum(self._all("pending", task))

    def stats(self) -> dict:
        per = self._all("stats")
        out: dict = {"shards": per}
        for k in ("rows", "freed", "leases_live", "leases_reissued", "rows_reissued", "stale_acks",
                  "stale_writes", "leases_restored", "leases_revoked"):  # fmt: skip
            out[k] = sum(p[k] for p in per)
        out["drops"] = {}
        out["tasks"] = {}
        for p in per:
            for r, c in p["drops"].items():
                out["drops"][r] = out["drops"].get(r, 0) + c
            for t, d in p["tasks"].items():
                acc = out["tasks"].setdefault(t, {"consumed": 0, "leased": 0, "ready": 0})
                for k in acc:
                    acc[k] += d[k]
        return out

    def gc(self) -> int:
        """As :meth:`SampleStore.gc`; shards also drop their references to chunks whose rows
        are all freed."""
        return sum(_get([h.gc.remote() for h in self._shards]))

    # ------------------------------------------------------------------ checkpoint
    def snapshot(self) -> dict:
        next_row = _get(self._shards[0].next_row.remote())
        return {
            "format": SNAPSHOT_FORMAT,
            "backend": "ray",
            "lease_s": self.lease_s,
            "chunk": self.chunk,
            "next_row": next_row,
            "shards": _get([h.snapshot.remote() for h in self._shards]),
        }

    @classmethod
    def restore(cls, d: dict, *, actor_options: dict | None = None, **kwargs) -> "RayStore":
        if d.get("format") != SNAPSHOT_FORMAT or d.get("backend") != "ray":
            raise StoreError("not a RayStore snapshot")
        store = cls(len(d["shards"]), d["lease_s"], d["chunk"], actor_options=actor_options, **kwargs)
        _get([h.restore.remote(sd) for h, sd in zip(store._shards, d["shards"])])
        _get(store._shards[0].next_row.remote(d["next_row"]))
        return store
