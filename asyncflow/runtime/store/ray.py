"""The sample store sharded across Ray actors: :class:`RayStore`, same methods as
:class:`~asyncflow.runtime.store.local.SampleStore`.

Layout. Global row indices are handed out by shard 0, in call order, so a later ``add_rows``
always gets higher indices (the driver relies on a step owning a contiguous range). Row ``r`` lives
on shard ``(r // chunk) % shards``; the allocator never lets a group straddle a chunk boundary (it
skips to the next chunk, leaving unused indices), so **a group lives on one shard** and whole-group
completeness is a shard-local question. Consequences: the rows of one group must be adjacent in one
``add_rows`` call, and a group may not have more than ``chunk`` rows.

Data path (after TransferQueue). Shards keep the row *bookkeeping* (a
:class:`~asyncflow.runtime.store.local.SampleStore`: ready bits, consumption marks, leases) but not the
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
import logging
import os
import threading
import uuid
from collections import OrderedDict

import numpy as np
import ray

from asyncflow.runtime.options import DEFAULT_CALL_TIMEOUT_S
from asyncflow.runtime.store.codec import Ragged  # noqa: F401 -- re-exported: columns users build
from asyncflow.runtime.store.codec import col_take, pack_cols
from asyncflow.runtime.store.common import SNAPSHOT_FORMAT, Lease, StoreError, check_new_rows
from asyncflow.runtime.store.ray_reads import ShardedReads
from asyncflow.runtime.store.remote import INLINE, MASK, bounded_get, joined, unpack
from asyncflow.runtime.store.shard import Shard

log = logging.getLogger(__name__)


class RayStore(ShardedReads):
    """A :class:`SampleStore` sharded over ``shards`` Ray actors (module docstring)."""

    #: ``get(..., acks=[(lease, columns), ...])`` acks those leases first, in the read's own
    #: call where there is one shard (the worker loop's ``Loop.ack_later``)
    carries_acks = True

    def __init__(
        self,
        shards: int = 2,
        lease_s: float = 60.0,
        chunk: int = 1024,
        *,
        actor_options: dict | None = None,
        inline_bytes: int = INLINE,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        _handles: list | None = None,
    ):
        self.lease_s = float(lease_s)
        self.chunk = int(chunk)
        #: every call to a shard is bounded: one that does not answer within this many seconds
        #: (plus the call's own wait) is lost, and the caller gets StoreLost, never a hang
        self.call_timeout_s = float(call_timeout_s)
        if _handles is None:
            opts = {"num_cpus": 0, "max_concurrency": 64, **(actor_options or {})}
            cls = ray.remote(Shard).options(**opts)
            _handles = [cls.remote(i, lease_s, inline_bytes, self.call_timeout_s)
                        for i in range(shards)]
            self._get([h.ping.remote() for h in _handles])
        self._shards = list(_handles)
        self._get(self._shards[0].set_peers.remote(self._shards))
        self._init_local()

    def _init_local(self) -> None:
        self._poll_ids = (f"{os.getpid()}-{uuid.uuid4().hex[:8]}-{i}" for i in itertools.count())
        self._issued: dict[int, list[int]] = {}  # lease id -> rows, for ack(lease_id, columns)
        self._cache: OrderedDict = OrderedDict()  # ObjectRef -> fetched chunk
        self._cache_lock = threading.Lock()

    def __getstate__(self):
        return {"lease_s": self.lease_s, "chunk": self.chunk, "_shards": self._shards,
                "call_timeout_s": self.call_timeout_s}

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._init_local()

    def _get(self, refs, wait_s: float = 0.0):
        """The shards' answers to ``refs``, bounded by the call timeout plus ``wait_s``."""
        return bounded_get(refs, self.call_timeout_s + float(wait_s or 0.0))

    def shard_handle(self, index: int):
        """Shard ``index``'s actor handle (fault injection kills it)."""
        return self._shards[index]

    @property
    def shards(self) -> int:
        return len(self._shards)

    def shutdown(self) -> None:
        """Kill the shard actors (the store's data goes with them)."""
        for i, h in enumerate(self._shards):
            try:
                ray.kill(h)
            except (ValueError, ray.exceptions.RayError) as e:  # already gone, or Ray is down
                log.info("store shard %d was not killed (%s); it goes with the Ray session", i, e)

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
            cols = None if columns is None else {f: col_take(v, idx) for f, v in columns.items()}
            out[s] = (rows[idx].tolist(), cols)
        return out

    def _all(self, method: str, *args, **kwargs) -> list:
        return self._get([h.call.remote(method, *args, **kwargs) for h in self._shards])

    # ------------------------------------------------------------------ writing
    def register_task(self, task: str, inputs: list[str]) -> None:
        self._all("register_task", task, list(inputs))

    def start_rows_at(self, first_row: int) -> None:
        """Number the next rows from ``first_row`` on (shard 0 allocates them)."""
        self._get(self._shards[0].next_row.remote(int(first_row)))

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
        payload = pack_cols(columns)
        rows = self._get(self._shards[0].add_rows.remote(payload, g, versions, lengths.tolist(), self.chunk))
        return rows.tolist()

    def write(self, rows: list[int], columns: dict, *, lease_id: int | None = None) -> bool:
        parts = None if lease_id is None else unpack(getattr(lease_id, "id", lease_id), len(self._shards))
        refs = []
        for s, (srows, scols) in self._split(rows, columns).items():
            lid = None if parts is None else parts.get(s, MASK)  # MASK: a lease id no shard has
            refs.append(self._shards[s].write.remote(srows, pack_cols(scols), lid))
        return all(self._get(refs))

    # ------------------------------------------------------------------ lease lifecycle
    def ack(self, lease_id: int | Lease, columns: dict | None = None) -> bool:
        """As :meth:`SampleStore.ack`. With ``columns``, pass the Lease (or use the handle that
        got it): the handle must know the lease's rows to route them."""
        parts, refs = self._send_ack(lease_id, columns)
        return self._acked(parts, self._get(refs))

    def ack_many(self, lease_ids: list) -> list[bool]:
        """As :meth:`SampleStore.ack_many`, in one call per shard that holds a part of any of
        the leases (:meth:`Shard.ack_each`), not one per lease: a trainer's step of 1,024
        micro-batch leases is one round trip (the order in which the leases are consumed among
        themselves is not defined)."""
        nsh = len(self._shards)
        parts = []
        per: dict[int, list] = {}
        for lease in lease_ids:
            lid = getattr(lease, "id", lease)
            self._issued.pop(lid, None)
            ps = unpack(lid, nsh)
            parts.append(ps)
            first = min(ps, default=0)
            for s, p in ps.items():
                per.setdefault(s, []).append((p, s == first))
        shards = list(per)
        got = self._get([self._shards[s].ack_each.remote(per[s]) for s in shards])
        answers = {s: iter(a) for s, a in zip(shards, got)}
        # each shard answers its parts in the order they were sent: lease by lease
        return [self._acked(ps, [next(answers[s]) for s in ps]) for ps in parts]

    def _send_ack(self, lease_id: int | Lease, columns: dict | None = None) -> tuple[dict, list]:
        """Send a lease's ack to each shard it has a part on: (its parts, the calls' refs)."""
        lid = getattr(lease_id, "id", lease_id)
        parts = unpack(lid, len(self._shards))
        rows = getattr(lease_id, "rows", None) or self._issued.get(lid)
        self._issued.pop(lid, None)
        first = min(parts, default=0)
        if columns and len(parts) > 1:
            if rows is None:
                raise StoreError("ack with columns needs the Lease (this handle did not issue it)")
            split = self._split(rows, columns)
            refs = [self._shards[s].ack.remote(p, pack_cols(split.get(s, (None, None))[1]), s == first)
                    for s, p in parts.items()]
        else:
            refs = [self._shards[s].ack.remote(p, pack_cols(columns), s == first) for s, p in parts.items()]
        return parts, refs

    def _ack_part(self, lease_id: int | Lease, columns: dict | None) -> tuple[int, dict | None]:
        """One shard's lease ack as it goes with a read (:meth:`get`'s ``acks``): (its part's
        id, the packed columns)."""
        lid = getattr(lease_id, "id", lease_id)
        self._issued.pop(lid, None)
        return unpack(lid, 1).get(0, MASK), pack_cols(columns)

    def _acked(self, parts: dict[int, int], answers: list) -> bool:
        """A lease's ack from its parts' answers: a stale ack (every part had ended) is counted
        once."""
        if answers and all(a is None for a in answers):
            self._stale_ack(parts)
        return joined(answers)

    def _rows_op(self, method: str, lease_id: int | Lease, rows: list[int], columns: dict | None) -> bool:
        """``ack_rows`` or ``release_rows``: each shard does its part of ``rows``. A row on a
        shard where the lease has no part, or only a part that had ended, is not the lease's:
        StoreError, as in the in-process store."""
        lid = getattr(lease_id, "id", lease_id)
        parts = unpack(lid, len(self._shards))
        split = self._split([int(r) for r in rows], columns or {})
        foreign = [r_s[0] for s, (r_s, _) in split.items() if s not in parts and r_s]
        if foreign and parts:
            raise StoreError(f"row {foreign[0]} is not in lease {lid}")
        shards = [s for s in split if s in parts]
        first = min(shards, default=0)  # the one part that counts a stale ack
        if method == "ack_rows":
            refs = [self._shards[s].ack_rows.remote(parts[s], split[s][0], pack_cols(split[s][1]) if columns else None,
                                                    s == first) for s in shards]
        else:
            refs = [self._shards[s].release_rows.remote(parts[s], split[s][0], s == first) for s in shards]
        answers = self._get(refs)
        ended = [split[s][0][0] for s, a in zip(shards, answers) if a is None]
        if ended and not any(answers):  # is the lease live in a part not asked?
            others = [s for s in parts if s not in shards]
            answers += self._get([self._shards[s].call.remote("live", parts[s]) for s in others])
        if ended and any(answers):
            raise StoreError(f"row {ended[0]} is not in lease {lid}")
        if method == "ack_rows" and answers and all(a is None for a in answers):
            self._stale_ack(parts)
        return joined(answers)

    def _stale_ack(self, parts: dict[int, int]) -> None:
        """Every part of the lease had ended: an ack of it is stale, counted once (the ack of
        its first, ended part, which the shard's store counts)."""
        first = min(parts)
        self._get(self._shards[first].call.remote("ack", parts[first]))

    def ack_rows(self, lease_id: int | Lease, rows: list[int], columns: dict | None = None) -> bool:
        """As :meth:`SampleStore.ack_rows`: each shard acks its part of ``rows``."""
        return self._rows_op("ack_rows", lease_id, rows, columns)

    def release_rows(self, lease_id: int | Lease, rows: list[int]) -> bool:
        return self._rows_op("release_rows", lease_id, rows, None)

    def _lease_op(self, method: str, lease_id: int | Lease, *args) -> bool:
        lid = getattr(lease_id, "id", lease_id)
        parts = unpack(lid, len(self._shards))
        first = min(parts, default=0)
        return joined(self._get([self._shards[s].lease_op.remote(method, p, s == first, *args)
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
        parts = [unpack(int(lid), len(self._shards)) for lid in lease_ids]
        for ps in parts:
            for s, p in ps.items():
                per.setdefault(s, []).append(p)
        if not per:
            return 0
        shards = list(per)
        got = dict(zip(shards, self._get([self._shards[s].renew_each.remote(per[s], lease_s) for s in shards])))
        answer = {s: dict(zip(per[s], got[s])) for s in shards}
        return sum(joined(answer[s][p] for s, p in ps.items()) for ps in parts)

    def revoke(self, owner: str) -> int:
        """Give back every live lease of worker ``owner`` on every shard (it died)."""
        return sum(self._all("revoke", owner))

    def expire(self, now: float | None = None) -> int:
        """Expire leases past deadline on every shard; returns the shard leases expired."""
        return sum(self._all("expire", now))

    def stop_waits(self) -> None:
        """As :meth:`SampleStore.stop_waits`, on every shard; not waited for (the driver says
        it as the run stops, and a shard that is gone has no reader to wake)."""
        for h in self._shards:
            h.call.remote("stop_waits")

    def drop(self, rows: list[int], reason: str) -> int:
        refs = [self._shards[s].call.remote("drop", r, reason) for s, (r, _) in self._split(rows, None).items()]
        return sum(self._get(refs))

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
        return sum(self._get([h.gc.remote() for h in self._shards]))

    # ------------------------------------------------------------------ checkpoint
    def snapshot(self) -> dict:
        next_row = self._get(self._shards[0].next_row.remote())
        return {
            "format": SNAPSHOT_FORMAT,
            "backend": "ray",
            "lease_s": self.lease_s,
            "chunk": self.chunk,
            "next_row": next_row,
            "shards": self._get([h.snapshot.remote() for h in self._shards]),
        }

    @classmethod
    def restore(cls, d: dict, *, actor_options: dict | None = None, **kwargs) -> "RayStore":
        if d.get("format") != SNAPSHOT_FORMAT or d.get("backend") != "ray":
            raise StoreError("not a RayStore snapshot")
        store = cls(len(d["shards"]), d["lease_s"], d["chunk"], actor_options=actor_options, **kwargs)
        store._get([h.restore.remote(sd) for h, sd in zip(store._shards, d["shards"])])
        store._get(store._shards[0].next_row.remote(d["next_row"]))
        return store
