"""The sharded store's reads (:class:`ShardedReads`, a part of
:class:`~asyncflow.runtime.store.ray.RayStore`): ``get`` across shards with its ordering rule
(lowest rows over all shards, the surplus given back), long polls on the shards' change counters,
and the assembly of a lease's columns from the shards' chunks. The state it uses is the
RayStore's own (this class is one of its bases, not a separate object).
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import ray

from asyncflow.runtime.store.codec import col_concat, col_take, unpack_cols
from asyncflow.runtime.store.common import Lease
from asyncflow.runtime.store.remote import CACHE, POLL_S, pack


class ShardedReads:
    """:class:`~asyncflow.runtime.store.ray.RayStore`'s reading methods."""

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
        acks: list | None = None,
    ) -> Lease | None:
        """As :meth:`SampleStore.get`, across shards (ordering: module docstring). ``acks``:
        ``[(lease, columns), ...]`` acked first (:meth:`RayStore.ack`), in the same call as the
        read where there is one shard (a batches loop's last lease: one round trip, not two)."""
        if acks and len(self._shards) != 1:
            for lease_id, columns in acks:
                self.ack(lease_id, columns)
            acks = None
        deadline = time.monotonic() + timeout
        sel = {"whole_groups": whole_groups, "group_size": group_size, "max_row": max_row,
               "min_version": min_version, "filter_fn": filter_fn}  # fmt: skip
        need = max(int(min_rows), 1)
        unit = group_size if whole_groups else 1
        if len(self._shards) == 1:
            kw = {**sel, "min_rows": min_rows, "timeout": timeout, "fields": fields,
                  "lease_s": lease_s, "owner": owner}
            if acks:
                sent = [self._ack_part(lease_id, columns) for lease_id, columns in acks]
                answers, part = self._get(self._shards[0].get.remote(task, n, kw, sent), timeout)
                for (lid, _), answer in zip(sent, answers):
                    self._acked({0: lid}, [answer])
            else:
                part = self._get(self._shards[0].get.remote(task, n, kw), timeout)
            return None if part is None else self._assemble(task, {0: part}, lease_s)
        kw = {**sel, "min_rows": 1, "timeout": 0.0, "fields": fields, "lease_s": lease_s,
              "owner": owner}
        polls: dict[int, tuple[str, Any]] = {}
        try:
            while True:
                # one round: every shard leases its lowest rows; keep the lowest n over all
                refs = [h.get.remote(task, n, kw) for h in self._shards]
                parts = {s: p for s, p in enumerate(self._get(refs)) if p is not None}
                parts = self._keep_lowest(parts, n // unit, whole_groups)
                if sum(len(p[1]) for p in parts.values()) >= need:
                    return self._assemble(task, parts, lease_s)
                if parts:
                    self._get([self._shards[s].call.remote("release", p[0]) for s, p in parts.items()])
                if time.monotonic() >= deadline:
                    return None
                latest = self._get([h.peek.remote(task, n, sel) for h in self._shards])
                while True:  # wait until the shards together look like enough
                    if any(c == -1 for c, _ in latest):  # the run is stopping: no more waits
                        return None
                    if sum(self._quota(latest, n // unit, unit).values()) >= need:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    for s, h in enumerate(self._shards):
                        if s not in polls:
                            pid = next(self._poll_ids)
                            polls[s] = (pid, h.peek.remote(task, n, sel, latest[s][0], min(left, POLL_S), pid))
                    by_ref = {ref: s for s, (_, ref) in polls.items()}
                    done, _ = ray.wait(list(by_ref), num_returns=1, timeout=left)
                    for ref in done:
                        s = by_ref[ref]
                        latest[s] = self._get(ref)
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
            got = self._get(self._shards[0].get_split.remote(
                task, n, split, {**kw, "min_rows": min_rows, "timeout": timeout}), timeout)
            return [] if got is None else self._assemble_split(task, got, lease_s)
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
            self._get([self._shards[s].uncount.remote([p[0]]) for s, p in parts.items() if s != lead])
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
        self._get(refs)
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
        got = {r: unpack_cols(v) for r, v in zip(miss, self._get(miss))} if miss else {}
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
            while len(self._cache) > CACHE:
                self._cache.popitem(last=False)
        return out

    def _assemble_split(self, task: str, got: tuple, lease_s) -> list[Lease]:
        """One shard's :meth:`Shard.get_split` answer as its leases: the columns of all of them
        assembled at once (one fetch, one gather per field), then cut lease by lease."""
        ids, sizes, *part = got
        deadline = time.monotonic() + (self.lease_s if lease_s is None else lease_s)
        rows, cols = self._columns({0: (0, *part)})
        if len(self._issued) + len(ids) > 10000:
            self._issued.clear()
        out, a = [], 0
        for lid, k in zip(ids, sizes):
            if len(ids) == 1:
                lrows, lcols = rows, cols
            else:
                lrows = rows[a:a + k]  # a list, numpy or Ragged column slices as a view
                lcols = {f: v[a:a + k] for f, v in cols.items()}
            a += k
            lid = pack({0: lid})
            self._issued[lid] = lrows
            out.append(Lease(lid, task, lrows, lcols, deadline))
        return out

    def _assemble(self, task: str, parts: dict[int, tuple], lease_s) -> Lease:
        lid = pack({s: p[0] for s, p in parts.items()})
        deadline = time.monotonic() + (self.lease_s if lease_s is None else lease_s)
        rows, cols = self._columns(parts)
        if len(self._issued) > 10000:
            self._issued.clear()
        self._issued[lid] = rows
        return Lease(lid, task, rows, cols, deadline)

    def _columns(self, parts: dict[int, tuple]) -> tuple[list[int], dict[str, Any]]:
        """The rows and columns of the shards' parts of one read, in row order: the chunks
        they reference fetched at once, each field gathered from them."""
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
        objs = [o if r else unpack_cols(o) for o, r in zip(objs, is_ref)]
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
        return rows, cols

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
            segs.append([None] * (b - a) if c < 0 else col_take(objs[c][f], off[a:b]))
        return col_concat(segs)

