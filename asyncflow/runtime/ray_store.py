"""The sample store sharded across Ray actors: :class:`RayStore`, same methods as
:class:`~asyncflow.runtime.store.SampleStore`.

Layout. Global row indices are handed out by shard 0 (one small call per ``add_rows``), in call
order, so a later ``add_rows`` always gets higher indices. Row ``r`` lives on shard
``(r // chunk) % shards``; the allocator never lets a group straddle a chunk boundary (it skips to
the next chunk, leaving unused indices), so **a group lives on one shard** and whole-group
completeness is a shard-local question. Consequences: the rows of one group must be adjacent in one
``add_rows`` call, and a group may not have more than ``chunk`` rows.

Traffic. Every method is one Ray call per shard it touches, issued to all shards at once; data
moves as column chunks (a ``dict[field, list]`` slice per shard), never one call per sample. Ray
already passes an argument or result above ~100 KB through the object store, so a big column chunk
goes by reference without an explicit ``ray.put``. Shard actors are threaded (``max_concurrency``),
so a waiting ``get`` never blocks writers.

``get`` across shards (the ordering guarantee):

1. *peek*: every shard reports its lowest eligible rows (whole groups: each group's lowest row),
   row indices only, no data;
2. the handle merges them and takes the ``n`` lowest (whole groups: the ``n // group_size`` groups
   with the lowest first rows), giving a quota per shard;
3. *lease*: each shard leases its quota, lowest rows first, and returns the data;
4. the parts are merged into one :class:`Lease`, rows ascending.

So without competing replicas of the same task, ``get`` returns exactly the lowest eligible rows,
as the in-process store does. With competitors, a shard may lease rows other than the ones peeked
(a competitor took those): still its lowest eligible ones, never a duplicate, and still below
``max_row``; if the total falls below ``min_rows`` everything is released and the round repeats
until ``timeout``. Waiting is a long poll on every shard's change counter (no busy polling).

Leases: the handle's lease id packs the shards' own lease ids (``40`` bits each), so any copy of
the handle (it pickles: workers use it) can ack, release or renew it. Expiry is per shard.
"""
from __future__ import annotations

import itertools
import os
import time
import uuid
from operator import itemgetter
from typing import Any

import numpy as np
import ray

from asyncflow.runtime.store import SNAPSHOT_FORMAT, Lease, SampleStore, StoreError, _take

_BITS = 40
_MASK = (1 << _BITS) - 1
_POLL_S = 5.0  # the longest one long poll waits before the handle re-polls


class _Shard:
    """One shard: a SampleStore in a threaded actor; shard 0 also allocates row indices."""

    def __init__(self, index: int, lease_s: float):
        import threading

        self.index = index
        self.store = SampleStore(lease_s)
        self._next_row = 0
        self._alloc_lock = threading.Lock()
        self._cancelled: dict[str, float] = {}

    def ping(self) -> int:
        return self.index

    def alloc(self, lengths: list[int], chunk: int) -> list[int]:
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

    def get(self, task, n, kw):
        lease = self.store.get(task, n, **kw)
        return None if lease is None else (lease.id, lease.rows, lease.columns)

    def restore(self, d: dict) -> None:
        self.store = SampleStore.restore(d)


def _pack(parts: dict[int, int]) -> int:
    return sum(lid << (_BITS * s) for s, lid in parts.items())


def _unpack(lease_id: int, shards: int) -> dict[int, int]:
    return {s: (lease_id >> (_BITS * s)) & _MASK for s in range(shards) if (lease_id >> (_BITS * s)) & _MASK}


class RayStore:
    """A :class:`SampleStore` sharded over ``shards`` Ray actors (module docstring)."""

    def __init__(
        self,
        shards: int = 2,
        lease_s: float = 60.0,
        chunk: int = 1024,
        *,
        actor_options: dict | None = None,
        _handles: list | None = None,
    ):
        self.lease_s = float(lease_s)
        self.chunk = int(chunk)
        if _handles is None:
            opts = {"num_cpus": 0, "max_concurrency": 64, **(actor_options or {})}
            cls = ray.remote(_Shard).options(**opts)
            _handles = [cls.remote(i, lease_s) for i in range(shards)]
            ray.get([h.ping.remote() for h in _handles])
        self._shards = list(_handles)
        self._init_local()

    def _init_local(self) -> None:
        self._poll_ids = (f"{os.getpid()}-{uuid.uuid4().hex[:8]}-{i}" for i in itertools.count())
        self._issued: dict[int, list[int]] = {}  # lease id -> rows, for ack(lease_id, columns)

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
            ray.kill(h)

    # ------------------------------------------------------------------ routing
    def _shard_of(self, rows) -> np.ndarray:
        return (np.asarray(rows, np.int64) // self.chunk) % len(self._shards)

    def _split(self, rows, columns: dict[str, list] | None):
        """{shard: (rows, column chunk)} for rows listed in ``rows`` order."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        if len(self._shards) == 1:
            return {0: (rows.tolist(), columns)}
        sh = self._shard_of(rows)
        out = {}
        for s in np.unique(sh).tolist():
            idx = np.flatnonzero(sh == s)
            cols = None if columns is None else {f: _take(list(v) if not isinstance(v, list) else v, idx) for f, v in columns.items()}
            out[s] = (rows[idx].tolist(), cols)
        return out

    def _all(self, method: str, *args, **kwargs) -> list:
        return ray.get([h.call.remote(method, *args, **kwargs) for h in self._shards])

    # ------------------------------------------------------------------ writing
    def register_task(self, task: str, inputs: list[str]) -> None:
        self._all("register_task", task, list(inputs))

    def add_rows(self, columns: dict[str, list], groups: list[int], versions: list[int] | None = None) -> list[int]:
        """Append rows; a group's rows must be adjacent here (module docstring). Returns indices."""
        k = len(groups)
        for f, v in columns.items():
            if len(v) != k:
                raise StoreError(f"column {f!r} has {len(v)} values for {k} rows")
        if k == 0:
            return []
        g = np.asarray(groups, np.int64)
        starts_of_runs = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        lengths = np.diff(np.r_[starts_of_runs, k])
        run_groups = g[starts_of_runs]
        if len(np.unique(run_groups)) != len(run_groups):
            raise StoreError("add_rows: the rows of a group must be adjacent")
        starts = np.asarray(ray.get(self._shards[0].alloc.remote(lengths.tolist(), self.chunk)), np.int64)
        rows = np.repeat(starts - starts_of_runs, lengths) + np.arange(k)
        cols = dict(columns)
        cols["__groups"] = list(groups)
        if versions is not None:
            cols["__versions"] = list(versions)
        refs = []
        for s, (srows, scols) in self._split(rows, cols).items():
            sg = scols.pop("__groups")
            sv = scols.pop("__versions", None)
            refs.append(self._shards[s].call.remote("add_rows", scols, sg, sv, rows=srows))
        ray.get(refs)
        return rows.tolist()

    def write(self, rows: list[int], columns: dict[str, list], *, lease_id: int | None = None) -> bool:
        parts = None if lease_id is None else _unpack(getattr(lease_id, "id", lease_id), len(self._shards))
        refs = []
        for s, (srows, scols) in self._split(rows, columns).items():
            lid = None if parts is None else parts.get(s, _MASK)  # _MASK: a lease id no shard has
            refs.append(self._shards[s].call.remote("write", srows, scols, lease_id=lid))
        return all(ray.get(refs))

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
    ) -> Lease | None:
        """As :meth:`SampleStore.get`, across shards (ordering: module docstring)."""
        deadline = time.monotonic() + timeout
        sel = {"whole_groups": whole_groups, "group_size": group_size, "max_row": max_row,
               "min_version": min_version, "filter_fn": filter_fn}  # fmt: skip
        need = max(int(min_rows), 1)
        unit = group_size if whole_groups else 1
        if len(self._shards) == 1:
            kw = {**sel, "min_rows": min_rows, "timeout": timeout, "fields": fields, "lease_s": lease_s}
            part = ray.get(self._shards[0].get.remote(task, n, kw))
            return None if part is None else self._merge(task, {0: part}, lease_s)
        latest = ray.get([h.peek.remote(task, n, sel) for h in self._shards])
        polls: dict[int, tuple[str, Any]] = {}
        try:
            while True:
                quota = self._quota(latest, n // unit, unit)
                if sum(quota.values()) >= need:
                    kw = {**sel, "min_rows": 1, "timeout": 0.0, "fields": fields, "lease_s": lease_s}
                    refs = {s: self._shards[s].get.remote(task, q, kw) for s, q in quota.items()}
                    parts = {s: p for s, p in zip(refs, ray.get(list(refs.values()))) if p is not None}
                    if sum(len(p[1]) for p in parts.values()) >= need:
                        return self._merge(task, parts, lease_s)
                    ray.get([self._shards[s].call.remote("release", p[0]) for s, p in parts.items()])
                    latest = ray.get([h.peek.remote(task, n, sel) for h in self._shards])
                    if time.monotonic() < deadline:
                        continue
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
                    latest[s] = ray.get(ref)
                    del polls[s]
        finally:
            for s, (pid, _) in polls.items():
                self._shards[s].cancel_poll.remote(pid)

    @staticmethod
    def _quota(latest, units: int, unit: int) -> dict[int, int]:
        """Rows per shard so that the lowest ``units`` peeked units are taken."""
        keys = [(r, s) for s, (_, rows) in enumerate(latest) for r in rows]
        keys.sort()
        quota: dict[int, int] = {}
        for _, s in keys[:units]:
            quota[s] = quota.get(s, 0) + unit
        return quota

    def _merge(self, task: str, parts: dict[int, tuple], lease_s) -> Lease:
        lid = _pack({s: p[0] for s, p in parts.items()})
        deadline = time.monotonic() + (self.lease_s if lease_s is None else lease_s)
        if len(parts) == 1:
            (_, rows, cols), = parts.values()
        else:
            rows = [r for p in parts.values() for r in p[1]]
            order = np.argsort(np.asarray(rows), kind="stable")
            pick = itemgetter(*order.tolist())
            names = next(iter(parts.values()))[2].keys()
            cols = {f: list(pick([x for p in parts.values() for x in p[2][f]])) for f in names}
            rows = cols["_row"]
        if len(self._issued) > 10000:
            self._issued.clear()
        self._issued[lid] = rows
        return Lease(lid, task, rows, cols, deadline)

    # ------------------------------------------------------------------ lease lifecycle
    def ack(self, lease_id: int | Lease, columns: dict[str, list] | None = None) -> bool:
        """As :meth:`SampleStore.ack`. With ``columns``, pass the Lease (or use the handle that
        got it): the handle must know the lease's rows to route them."""
        lid = getattr(lease_id, "id", lease_id)
        parts = _unpack(lid, len(self._shards))
        rows = getattr(lease_id, "rows", None) or self._issued.get(lid)
        self._issued.pop(lid, None)
        if columns and len(parts) > 1:
            if rows is None:
                raise StoreError("ack with columns needs the Lease (this handle did not issue it)")
            split = self._split(rows, columns)
            refs = [self._shards[s].call.remote("ack", p, split.get(s, (None, None))[1]) for s, p in parts.items()]
        else:
            refs = [self._shards[s].call.remote("ack", p, columns) for s, p in parts.items()]
        if not refs:
            return False
        return all(ray.get(refs))

    def release(self, lease_id: int | Lease) -> bool:
        lid = getattr(lease_id, "id", lease_id)
        self._issued.pop(lid, None)
        refs = [self._shards[s].call.remote("release", p) for s, p in _unpack(lid, len(self._shards)).items()]
        return bool(refs) and all(ray.get(refs))

    def renew(self, lease_id: int | Lease, lease_s: float | None = None) -> bool:
        lid = getattr(lease_id, "id", lease_id)
        refs = [self._shards[s].call.remote("renew", p, lease_s) for s, p in _unpack(lid, len(self._shards)).items()]
        return bool(refs) and all(ray.get(refs))

    def expire(self, now: float | None = None) -> int:
        """Expire leases past deadline on every shard; returns the shard leases expired."""
        return sum(self._all("expire", now))

    def drop(self, rows: list[int], reason: str) -> int:
        refs = [self._shards[s].call.remote("drop", r, reason) for s, (r, _) in self._split(rows, None).items()]
        return sum(ray.get(refs))

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
                  "stale_writes", "leases_restored"):  # fmt: skip
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
        return sum(self._all("gc"))

    # ------------------------------------------------------------------ checkpoint
    def snapshot(self) -> dict:
        next_row = ray.get(self._shards[0].next_row.remote())
        return {
            "format": SNAPSHOT_FORMAT,
            "backend": "ray",
            "lease_s": self.lease_s,
            "chunk": self.chunk,
            "next_row": next_row,
            "shards": self._all("snapshot"),
        }

    @classmethod
    def restore(cls, d: dict, *, actor_options: dict | None = None) -> "RayStore":
        if d.get("format") != SNAPSHOT_FORMAT or d.get("backend") != "ray":
            raise StoreError("not a RayStore snapshot")
        store = cls(len(d["shards"]), d["lease_s"], d["chunk"], actor_options=actor_options)
        ray.get([h.restore.remote(sd) for h, sd in zip(store._shards, d["shards"])])
        ray.get(store._shards[0].next_row.remote(d["next_row"]))
        return store
