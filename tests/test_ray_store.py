"""RayStore (asyncflow/runtime/store/ray.py): the store's core behaviours with 2 shards."""
from __future__ import annotations

import pickle
import threading
import time

import numpy as np
import pytest

from asyncflow.runtime.ray_connect import local_worker_priority

ray = pytest.importorskip("ray")

from asyncflow.runtime.store.ray import RayStore  # noqa: E402
from asyncflow.runtime.store import StoreError  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    with local_worker_priority():  # the workers' niceness, as asyncflow's own
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def store():
    s = RayStore(shards=2, lease_s=30.0, chunk=4)
    s.register_task("reward", ["response"])
    s.register_task("train", ["response", "reward"])
    yield s
    s.shutdown()


def add_groups(s, groups, size, first=0):
    return s.add_rows({"prompt": [f"p{first + i // size}" for i in range(groups * size)]},
                      [first + i // size for i in range(groups * size)])  # fmt: skip


def test_groups_never_straddle_shards_and_indices_ascend(store):
    rows = add_groups(store, 3, 3)
    assert rows == [0, 1, 2, 4, 5, 6, 8, 9, 10]  # 3 rows never cross a chunk of 4
    assert add_groups(store, 1, 2, first=3) == [12, 13]
    with pytest.raises(StoreError, match="adjacent"):
        store.add_rows({}, [7, 8, 7])


def test_get_merges_shards_lowest_rows_first(store):
    rows = add_groups(store, 4, 2)  # 0..7: shard 0 holds 0-3, shard 1 holds 4-7
    store.write(rows, {"response": [[i] * i for i in range(8)]})
    lease = store.get("reward", 5)
    assert lease.rows == [0, 1, 2, 3, 4]
    assert lease.columns["response"] == [[i] * i for i in range(5)]
    assert lease.columns["_row"] == lease.rows and lease.columns["_group"] == [0, 0, 1, 1, 2]
    rest = store.get("reward", 10)
    assert rest.rows == [5, 6, 7]
    assert store.get("reward", 10) is None


def test_ack_with_columns_across_shards_then_whole_groups_max_row(store):
    rows = add_groups(store, 4, 2)
    store.write(rows, {"response": list("abcdefgh")})
    lease = store.get("reward", 8)
    assert store.ack(lease.id, {"reward": [float(r) for r in lease.rows]})  # the issuing handle
    assert not store.ack(lease.id)  # second ack: stale, ignored
    train = store.get("train", 8, whole_groups=True, group_size=2, max_row=6)
    assert train.rows == [0, 1, 2, 3, 4, 5] and train.columns["reward"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert store.stats()["stale_acks"] == 1  # a lease over two shards counts once


def test_exclusive_leases_release_and_drop(store):
    rows = add_groups(store, 4, 2)
    store.write(rows, {"response": list("abcdefgh")})
    a = store.get("reward", 3)
    b = store.get("reward", 3)
    assert set(a.rows).isdisjoint(b.rows)
    assert store.release(a)
    assert store.get("reward", 3).rows == a.rows
    assert store.drop([6, 7], "stale") == 2
    assert store.pending("reward") == 0
    assert store.stats()["drops"] == {"stale": 2}


def test_expired_lease_reissued_and_stale_ack_ignored(store):
    rows = add_groups(store, 2, 2)
    store.write(rows, {"response": list("abcd")})
    old = store.get("reward", 4, lease_s=0.2)
    time.sleep(0.3)
    new = store.get("reward", 4)
    assert new.rows == old.rows
    assert not store.ack(old.id)
    assert store.ack(new.id)
    assert store.consumed("reward") == rows
    st = store.stats()
    assert (st["leases_reissued"], st["rows_reissued"], st["stale_acks"]) == (1, 4, 1)  # rows 0-3: one shard


def test_blocking_get_wakes_on_a_write_to_any_shard(store):
    rows = add_groups(store, 4, 2)
    store.write([0], {"response": ["a"]})

    def later():
        time.sleep(0.2)
        store.write([5, 6], {"response": ["f", "g"]})

    threading.Thread(target=later).start()
    t0 = time.monotonic()
    lease = store.get("reward", 8, min_rows=3, timeout=10.0)
    assert lease.rows == [0, 5, 6]
    assert time.monotonic() - t0 < 5.0
    t0 = time.monotonic()
    assert store.get("reward", 8, timeout=0.2) is None
    assert 0.15 < time.monotonic() - t0 < 2.0


def test_handle_pickles_and_works_inside_an_actor(store):
    rows = add_groups(store, 4, 2)
    assert pickle.loads(pickle.dumps(store)).pending("reward") == 0

    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self, s):
            self.s = s

        def run(self, rows):
            self.s.write(rows, {"response": [f"r{r}" for r in rows]})
            got = []
            while (lease := self.s.get("reward", 3)) is not None:
                got += lease.rows
                self.s.ack(lease, {"reward": [1.0] * len(lease.rows)})
            return got

    w = Worker.remote(store)
    assert sorted(ray.get(w.run.remote(rows))) == rows
    assert store.pending("train") == 8
    ray.kill(w)


def test_two_replicas_exactly_once(store):
    n_groups = 60
    rows = add_groups(store, n_groups, 2)
    got: list[list[int]] = [[], []]

    def replica(k):
        h = pickle.loads(pickle.dumps(store))
        while True:
            lease = h.get("reward", 7, timeout=0.5)
            if lease is None:
                return
            got[k] += lease.rows
            h.ack(lease.id)

    ths = [threading.Thread(target=replica, args=(k,)) for k in range(2)]
    for t in ths:
        t.start()
    for i in range(0, len(rows), 10):
        store.write(rows[i : i + 10], {"response": ["x"] * len(rows[i : i + 10])})
    for t in ths:
        t.join(60)
    assert sorted(got[0] + got[1]) == rows
    assert sorted(store.consumed("reward")) == rows


def test_snapshot_restore_gc(store):
    rows = add_groups(store, 4, 2)
    store.write(rows, {"response": list("abcdefgh")})
    done = store.get("reward", 4)
    store.ack(done, {"reward": [1.0] * 4})
    inflight = store.get("reward", 2)
    snap = store.snapshot()
    r = RayStore.restore(snap)
    try:
        assert sorted(r.consumed("reward")) == done.rows
        assert r.stats()["leases_restored"] == 1
        assert r.get("reward", 8).rows == inflight.rows + [r_ for r_ in rows if r_ not in done.rows + inflight.rows]
        assert r.add_rows({}, [99])[0] > max(rows)
        assert r.gc() == 0  # train has consumed nothing
        lease = r.get("train", 8)
        r.ack(lease.id)
        assert r.gc() == 4
    finally:
        r.shutdown()


# ---------------------------------------------------------------------- the data path (chunks)
def test_numpy_and_ragged_columns_round_trip_across_shards(store):
    from asyncflow.runtime.store.ray import Ragged

    toks = [[i] * (i % 3 + 1) for i in range(8)]
    rows = store.add_rows({"prompt": Ragged.from_lists(toks, np.int32), "score": np.arange(8, dtype=np.float32)},
                          [i // 2 for i in range(8)])  # fmt: skip
    store.register_task("look", ["prompt", "score"])
    lease = store.get("look", 8)
    assert lease.rows == rows == list(range(8))
    p = lease.columns["prompt"]
    assert isinstance(p, Ragged) and p.tolist() == toks and p == toks
    assert isinstance(lease.columns["score"], np.ndarray) and lease.columns["score"].tolist() == list(range(8))
    # a lease out of the middle of a chunk, across both shards, in row order
    store.release(lease)
    store.drop([0, 1], "test")
    mid = store.get("look", 4)
    assert mid.rows == [2, 3, 4, 5] and mid.columns["prompt"].tolist() == toks[2:6]


def test_big_chunks_go_through_the_object_store_and_gc_drops_them(store):
    n = 64
    rows = store.add_rows({"prompt": [list(range(300)) for _ in range(n)]}, list(range(n)))  # > inline_bytes
    store.write(rows, {"response": np.arange(n * 2000).reshape(n, 2000)})
    assert sum(ray.get([h.chunk_count.remote() for h in store._shards])) >= 3
    lease = store.get("reward", n)
    assert lease.columns["response"].shape == (n, 2000) and lease.columns["response"][5, 0] == 10000
    store.ack(lease, {"reward": [1.0] * n})
    snap = store.snapshot()  # plain data, chunks fetched
    vals = [v for sd in snap["shards"] for v in sd["fields"].get("response", {}).get("values", [])]
    assert len(vals) == n and isinstance(vals[0], list) and len(vals[0]) == 2000
    t = store.get("train", n, fields=["prompt", "response", "reward"])
    assert t.columns["prompt"][3] == list(range(300))
    store.ack(t)
    assert store.gc() == n
    assert sum(ray.get([h.chunk_count.remote() for h in store._shards])) == 0
    r = RayStore.restore(snap)
    try:
        got = r.get("train", n)
        assert got.rows == rows and got.columns["response"][7] == list(range(14000, 16000))
    finally:
        r.shutdown()


def test_rows_stay_readable_after_the_producer_dies(store):
    from asyncflow.runtime.store.ray import Ragged

    @ray.remote(num_cpus=0)
    class Producer:
        def put(self, s, n):
            toks = Ragged.from_lists([list(range(r, r + 500)) for r in range(n)], np.int32)
            rows = s.add_rows({"prompt": toks}, list(range(n)))
            s.write(rows, {"response": [[r] * 300 for r in rows]})
            return rows

    p = Producer.remote()
    rows = ray.get(p.put.remote(store, 100))
    ray.kill(p)
    time.sleep(0.5)
    lease = store.get("reward", 100)
    assert lease.rows == rows
    assert lease.columns["response"][99] == [rows[99]] * 300
    store.register_task("look", ["prompt"])
    assert store.get("look", 100).columns["prompt"][42].tolist() == list(range(42, 542))


def test_whole_groups_surplus_is_given_back(store):
    rows = add_groups(store, 6, 2)  # groups 0..5 over both shards
    store.write(rows, {"response": list(range(len(rows)))})
    a = store.get("reward", 4, whole_groups=True, group_size=2)
    assert a.columns["_group"] == [0, 0, 1, 1]
    b = store.get("reward", 100, whole_groups=True, group_size=2)
    assert sorted(set(b.columns["_group"])) == [2, 3, 4, 5] and b.rows == sorted(b.rows)
    assert store.stats()["tasks"]["reward"]["leased"] == len(rows)
