"""The simulator's event-indexed store (:class:`asyncflow.simulate.vstore.VStore`) against the
in-process :class:`~asyncflow.runtime.store.local.SampleStore`: one random history of every
operation the simulator and the loops use (adds with and without inputs and versions, writes,
plain / whole-group / filtered / version-bounded / windowed reads, split reads, acks with
outputs, partial acks and releases, drops, expiries on a fake clock, renewals, revokes, gc) is
applied to both, and every answer, lease (rows and values), pending count (below a row too), stats dict,
consumption order and snapshot must be the same. The contract suite
(``tests/test_store_contract.py``) runs its rule-by-rule tests on VStore as well."""
from __future__ import annotations

import itertools

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncflow.runtime.store import SampleStore, StoreError
from asyncflow.simulate.vstore import VStore

OWNERS = ["w0", "w1"]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Even:
    """A row filter (the loops pass picklable objects like this one)."""

    def __call__(self, r: dict) -> bool:
        return r["_row"] % 2 == 0


def lease_view(lease):
    if lease is None:
        return None
    return (lease.id, lease.task, lease.rows, lease.columns, lease.deadline)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 3), st.sampled_from([1, 2, 4]), st.booleans(),
                  st.booleans()),
        st.tuples(st.just("write"), st.integers(0, 9)),
        st.tuples(st.just("get"), st.integers(0, 1), st.integers(1, 9), st.integers(1, 3),
                  st.booleans(), st.sampled_from([1, 2, 4]), st.one_of(st.none(), st.integers(0, 40)),
                  st.sampled_from([None, 0, 1, 2]), st.booleans(), st.integers(0, 1)),
        st.tuples(st.just("split"), st.integers(0, 1), st.integers(1, 12), st.integers(1, 4),
                  st.integers(1, 4), st.one_of(st.none(), st.integers(0, 40))),
        st.tuples(st.just("ack"), st.integers(0, 20), st.booleans()),
        st.tuples(st.just("ack_rows"), st.integers(0, 20), st.integers(1, 3)),
        st.tuples(st.just("release"), st.integers(0, 20)),
        st.tuples(st.just("release_rows"), st.integers(0, 20), st.integers(1, 3)),
        st.tuples(st.just("drop"), st.lists(st.integers(0, 40), min_size=1, max_size=3),
                  st.sampled_from(["stale", "bad"])),
        st.tuples(st.just("tick"), st.sampled_from([0.5, 2.0, 7.0])),
        st.tuples(st.just("renew"), st.integers(0, 20)),
        st.tuples(st.just("revoke"), st.integers(0, 1)),
        st.tuples(st.just("gc")),
    ),
    min_size=1, max_size=60,
)  # fmt: skip


def both(stores, fn):
    """``fn(store)`` on each store: the same answer, or the same kind of StoreError."""
    out = []
    for s in stores:
        try:
            out.append(("ok", fn(s)))
        except StoreError as e:
            out.append(("error", type(e).__name__))
    assert out[0] == out[1]
    return out[0][1] if out[0][0] == "ok" else None


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
# a window ending inside a group: the group is not whole below it
@example(ops=[("add", 2, 2, True, False), ("get", 0, 4, 1, True, 2, 3, None, False, 0)])
# a row of a full group given back below its lowest: the group is found by its new lowest row
@example(ops=[("add", 1, 4, True, False), ("get", 0, 1, 1, False, 1, None, None, False, 0),
              ("get", 0, 2, 1, True, 2, 1, None, False, 0), ("release", 0),
              ("get", 0, 2, 1, True, 2, None, None, False, 0)])
# rows a whole-groups read leased, given back, then read plainly: each once
@example(ops=[("add", 1, 2, True, False), ("get", 0, 2, 1, True, 2, None, None, False, 0),
              ("release", 0), ("get", 0, 4, 1, False, 1, None, None, False, 0)])
# an ack after an ack_rows of some of the lease's rows, with a column for all of them: the same
# StoreError on both stores (found by a loaded run of the suite)
@example(ops=[("add", 1, 2, True, False), ("get", 0, 2, 1, False, 1, None, None, False, 0),
              ("ack_rows", 0, 1), ("ack", 0, True)])
# rows every task consumed are freed
@example(ops=[("add", 1, 2, True, False), ("get", 0, 2, 1, False, 1, None, None, False, 0),
              ("ack", 0, True), ("get", 1, 2, 1, False, 1, None, None, False, 0),
              ("ack", 1, False), ("gc",)])
def test_vstore_gives_the_same_answers_as_the_sample_store(ops):
    clock = Clock()
    stores = [SampleStore(lease_s=5.0, clock=clock), VStore(lease_s=5.0, clock=clock)]
    for s in stores:
        s.register_task("t0", ["x"])
        s.register_task("t1", ["x", "y"])
    groups = itertools.count()
    unready: list[list[int]] = []
    leases: list[list] = []  # [lease per store]
    n_rows = 0
    for op in ops:
        kind = op[0]
        if kind == "add":
            _, n_groups, size, ready, versioned = op
            k = n_groups * size
            gs = [next(groups) for _ in range(n_groups)]
            gids = [gs[j // size] for j in range(k)]
            vals = list(range(n_rows, n_rows + k))
            versions = [j % 3 for j in vals] if versioned else None
            cols = {"x": vals} if ready else {"z": vals}
            both(stores, lambda s: s.add_rows(cols, gids, versions))
            if not ready:
                unready.append(vals)
            n_rows += k
        elif kind == "write" and unready:
            rows = unready.pop(op[1] % len(unready))
            both(stores, lambda s: s.write(rows, {"x": rows}))
        elif kind == "get":
            _, task, n, min_rows, whole, size, max_row, min_version, filt, owner = op
            got = [s.get(f"t{task}", n, min_rows=min_rows, whole_groups=whole, group_size=size,
                         max_row=max_row, min_version=min_version,
                         filter_fn=Even() if filt else None, owner=OWNERS[owner])
                   for s in stores]
            assert lease_view(got[0]) == lease_view(got[1]), op
            if got[0] is not None:
                leases.append(got)
        elif kind == "split":
            _, task, n, split, min_rows, max_row = op
            got = [s.get_split(f"t{task}", n, split, min_rows=min_rows, max_row=max_row)
                   for s in stores]
            assert [lease_view(x) for x in got[0]] == [lease_view(x) for x in got[1]], op
            leases.extend([a, b] for a, b in zip(*got))
        elif kind in ("ack", "release", "renew") and leases:
            pair = leases[op[1] % len(leases)]
            if kind == "ack":
                # the lease's rows as it was read: after an ack_rows of some of them, a column
                # of that length is a StoreError, on both stores alike
                cols = ({"y": [-r for r in pair[0].rows]}
                        if pair[0].task == "t0" and op[2] else None)
                both(stores, lambda s: s.ack(pair[stores.index(s)], cols))
            elif kind == "release":
                both(stores, lambda s: s.release(pair[stores.index(s)]))
            else:
                both(stores, lambda s: s.renew(pair[stores.index(s)]))
        elif kind in ("ack_rows", "release_rows") and leases:
            pair = leases[op[1] % len(leases)]
            rows = pair[0].rows[:op[2]]
            if kind == "ack_rows":
                cols = {"y": [-r for r in rows]} if pair[0].task == "t0" else None
                both(stores, lambda s: s.ack_rows(pair[stores.index(s)], rows, cols))
            else:
                both(stores, lambda s: s.release_rows(pair[stores.index(s)], rows))
        elif kind == "drop" and n_rows:
            rows = sorted({r % n_rows for r in op[1]})
            both(stores, lambda s: s.drop(rows, op[2]))
        elif kind == "tick":
            clock.t += op[1]
            both(stores, lambda s: s.expire())
        elif kind == "revoke":
            both(stores, lambda s: s.revoke(OWNERS[op[1]]))
        elif kind == "gc":
            both(stores, lambda s: s.gc())
        for t in ("t0", "t1"):
            both(stores, lambda s: s.pending(t))
            for below, cap in ((n_rows // 2, 3), (n_rows // 2, 1000), (n_rows + 1, 1000)):
                both(stores, lambda s: s.pending_below(t, below, cap))
        both(stores, lambda s: s.stats())
    # drain: every lease acked (t0's with its output), then t1 reads and acks what it can
    for pair in leases:
        cols = {"y": [-r for r in pair[0].rows]} if pair[0].task == "t0" else None
        both(stores, lambda s: s.ack(pair[stores.index(s)], cols) if s.live(pair[stores.index(s)])
             else None)
    for t in ("t0", "t1"):
        got = [s.get(t, 1000) for s in stores]
        assert lease_view(got[0]) == lease_view(got[1])
        if got[0] is not None:
            cols = {"y": [-r for r in got[0].rows]} if t == "t0" else None
            both(stores, lambda s: s.ack(got[stores.index(s)], cols))
        both(stores, lambda s: s.gc())
        both(stores, lambda s: s.stats())
    for t in ("t0", "t1"):
        both(stores, lambda s: s.consumed(t))
    both(stores, lambda s: s.drop_counts())
    snap = both(stores, lambda s: s.snapshot())
    # a snapshot restores into the other store: the same store again
    back = [VStore.restore(snap, clock=clock), SampleStore.restore(snap, clock=clock)]
    for t in ("t0", "t1"):
        both(back, lambda s: s.pending(t))
        both(back, lambda s: lease_view(s.get(t, 100)))
    both(back, lambda s: s.stats())


def test_a_waiting_read_is_woken_by_a_write_from_another_thread():
    """``get(timeout=...)`` waits on the store's condition; a write (another thread) wakes it
    (VStore notifies only when a read waits)."""
    import threading

    s = VStore(lease_s=5.0)
    s.register_task("t", ["x"])
    rows = s.add_rows({"y": [1, 2]}, [0, 0])
    writer = threading.Timer(0.05, lambda: s.write(rows, {"x": [1, 2]}))
    writer.start()
    try:
        lease = s.get("t", 2, min_rows=2, timeout=60.0)
    finally:
        writer.join()
    assert lease is not None and lease.rows == rows and lease.columns["x"] == [1, 2]
    assert s.get("t", 1, timeout=0.0) is None
