"""The lease bookkeeping of :class:`~asyncflow.simulate.vstore.VStore` (:class:`VLeases`, one of
its bases): how a lease is made, and how its per-task indexes change when a lease's rows are
consumed or given back (a row given back is checked into its task's eligible set again). The
lifecycle itself (ack, partial acks and releases, renewals, revokes, expiry: rule 4 of
:mod:`asyncflow.runtime.store.local`) is :class:`~asyncflow.runtime.store.base.StoreBase`'s,
shared with the in-process store. The state it changes is the VStore's own
(docs/architecture.md, "The simulator")."""
from __future__ import annotations

from heapq import heappush

from asyncflow.runtime.store.common import UNSET, Lease, StoreError
from asyncflow.simulate.vstore_task import VLease, VTask

#: a lease deadline no clock reaches (the simulator's ``lease_s``): kept off the expiry heap
NEVER = 1e17


class VLeases:
    """:class:`~asyncflow.simulate.vstore.VStore`'s lease methods."""

    def _lease_locked(self, t: VTask, rows: list[int], fields, now: float, lease_s,
                      owner: str | None) -> Lease:
        """Lease ``rows`` (a list the caller hands over) to ``t``."""
        lid = self._next_lease
        self._next_lease = lid + 1
        deadline = now + (self.lease_s if lease_s is None else lease_s)
        pos = rows if self._pos is None else [self._pos[r] for r in rows]
        held, group, data = t.held, self._group, self._data
        if t.groups is None:
            t.elig.difference_update(rows)
            for p in pos:
                held[p] = 1
        else:
            for r, p in zip(rows, pos):
                held[p] = 1
                t.remove(r, group[p])
        t.n_held += len(rows)
        self._leases[lid] = VLease(lid, t, pos, rows, deadline, owner)  # never changed in place
        if deadline < NEVER:  # the simulator's leases never expire: not on the expiry heap
            heappush(self._heap, (deadline, lid))
        cols: dict[str, list] = {}
        if len(pos) == 1:  # a serve loop's free slot
            p = pos[0]
            for f in (t.inputs if fields is None else fields):
                col = data.get(f)
                cols[f] = [None if col is None else col[p]]
            v = self._version[p]
            cols["_row"], cols["_group"] = [rows[0]], [group[p]]
            cols["_version"] = [None if v == UNSET else v]
            return Lease(lid, t.name, [rows[0]], cols, deadline)
        for f in (t.inputs if fields is None else fields):
            col = data.get(f)
            cols[f] = [None] * len(pos) if col is None else [col[p] for p in pos]
        cols["_row"] = list(rows)
        cols["_group"] = [group[p] for p in pos]
        ver = self._version
        cols["_version"] = [None if ver[p] == UNSET else ver[p] for p in pos]
        return Lease(lid, t.name, list(rows), cols, deadline)

    def _consume(self, t: VTask, pos: list[int], rows: list[int]) -> None:
        held, consumed, done = t.held, t.consumed, self._done
        ntasks = len(self._tasks)
        for p in pos:
            held[p] = 0
            consumed[p] = 1
            done[p] += 1
            if done[p] >= ntasks:
                self._gc_cand.append(p)
        t.n_held -= len(pos)
        t.n_consumed += len(pos)
        t.order.append((self._clock(), rows))

    def _part(self, rec: VLease, rows) -> tuple[list[int], list[int]]:
        """(positions of ``rows``, in their order; indices of ``rec``'s rows it keeps)."""
        if len(rows) == 1:  # a serve loop settles one sample at a time
            r = int(rows[0])
            try:
                i = rec.rows.index(r)
            except ValueError:
                raise StoreError(f"row {r} is not in lease {rec.id}") from None
            return [rec.pos[i]], [j for j in range(len(rec.rows)) if j != i]
        at = {r: i for i, r in enumerate(rec.rows)}
        try:
            idx = [at[int(r)] for r in rows]
        except KeyError as e:
            raise StoreError(f"row {e.args[0]} is not in lease {rec.id}") from None
        gone = set(idx)
        return [rec.pos[i] for i in idx], [i for i in range(len(rec.rows)) if i not in gone]

    def _shrink(self, rec: VLease, keep: list[int]) -> None:
        if not keep:
            del self._leases[rec.id]
            return
        rec.pos = [rec.pos[i] for i in keep]
        rec.rows = [rec.rows[i] for i in keep]

    def _unhold(self, t: VTask, pos: list[int]) -> None:
        held = t.held
        for p in pos:
            held[p] = 0
        t.n_held -= len(pos)
        self._recheck(t, pos)
        self._changed()


__all__ = ["VLeases"]
