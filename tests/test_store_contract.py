"""The :class:`~asyncflow.runtime.store.protocol.Store` contract, one suite run against every store.

Every test takes the ``store`` fixture: an in-process :class:`SampleStore` ("local"), the
simulator's event-indexed :class:`~asyncflow.simulate.vstore.VStore` ("vstore": the same rules
without the numpy scans; ``tests/test_vstore_props.py`` also drives it and a SampleStore with one
random history) and a
:class:`RayStore` with 2 shards and a chunk of 8 rows ("ray": a test's rows 0-7 live on shard 0,
8-15 on shard 1, 16-23 on shard 0 again...), and uses only the protocol's methods (rules: the
module docstring of :mod:`asyncflow.runtime.store`). A difference between the two stores found
here would be left asserting the contract and marked ``xfail(strict=True)`` for the store that
breaks it; none is left (a sharded lease is one lease: its parts on several shards answer, end and
count as one).
The Ray tests share two shard actors, reset to empty before each test (``ray_shards``).

The last test applies one random sequence of operations to both stores and compares answers.
"""
from __future__ import annotations

import inspect
import itertools
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow.runtime.store import SampleStore, StoreError
from asyncflow.runtime.store import Store
from asyncflow.simulate.vstore import VStore

try:
    import ray

    from asyncflow.runtime.store.ray import RayStore
except ImportError:  # the "ray" params skip
    ray = RayStore = None

CHUNK = 8  # RayStore rows per chunk: groups of 2 or 4 fill chunks exactly, so numbering is dense
LEASE_S = 30.0
NO_RAY = pytest.mark.skipif(ray is None, reason="ray is not importable")
KINDS = ["local", "vstore", pytest.param("ray", marks=[NO_RAY, pytest.mark.ray])]
STATS_KEYS = {"rows", "freed", "tasks", "drops", "leases_live", "leases_reissued", "rows_reissued",
              "stale_acks", "stale_writes", "leases_restored", "leases_revoked"}  # fmt: skip
TASK_KEYS = {"consumed", "leased", "ready"}


# ---------------------------------------------------------------------- fixtures and helpers
from shared_runs import ray_session  # noqa: E402,F401  (a fixture: Ray for this module)


def _new(kind: str, lease_s: float = LEASE_S):
    if kind == "vstore":
        return VStore(lease_s=lease_s)
    return SampleStore(lease_s=lease_s) if kind == "local" else RayStore(shards=2, lease_s=lease_s, chunk=CHUNK)


def _close(s) -> None:
    if RayStore is not None and isinstance(s, RayStore):
        s.shutdown()


@pytest.fixture(scope="module")
def ray_shards(ray_session):
    """The shard actors every "ray" test's store runs on. Starting 2 actors costs 1-5 s on a
    loaded 2-core machine, so they are started once; each test gets a new handle on them after
    every shard is reset to an empty store (the shard's own restore of an empty snapshot)."""
    first = _new("ray")
    yield first._shards
    first.shutdown()


def _fresh_ray(handles) -> "RayStore":
    empty = SampleStore(lease_s=LEASE_S).snapshot()
    ray.get([h.restore.remote(empty) for h in handles])
    s = RayStore(shards=2, lease_s=LEASE_S, chunk=CHUNK, _handles=handles)
    # the row allocator only moves up: start the test's rows at a multiple of 2 chunks, so its
    # first 8 rows are on shard 0 and the next 8 on shard 1, as in a new store
    span = 2 * CHUNK
    s.start_rows_at(-(-ray.get(handles[0].next_row.remote()) // span) * span)
    st_ = s.stats()
    assert st_["rows"] == st_["leases_live"] == 0 and st_["tasks"] == {}
    return s


@pytest.fixture(params=KINDS)
def store(request):
    s = _fresh_ray(request.getfixturevalue("ray_shards")) if request.param == "ray" else _new(request.param)
    s.register_task("reward", ["response"])
    s.register_task("train", ["response", "reward"])
    return s


_groups = itertools.count(1)


def add(s, n_groups: int, size: int = 2, ready: bool = True, versions=None) -> list[int]:
    """``n_groups`` new groups of ``size`` rows; with ``ready`` their ``response`` (the reward
    task's input) is written too, its value ``"r<row index within this call>"``."""
    k = n_groups * size
    gids = [next(_groups) for _ in range(n_groups)]
    cols = {"prompt": [f"p{i}" for i in range(k)]}
    if ready:
        cols["response"] = [f"r{i}" for i in range(k)]
    return s.add_rows(cols, [gids[i // size] for i in range(k)], versions)


def restored(s, snap):
    return type(s).restore(snap)


# ---------------------------------------------------------------------- the protocol itself
PROTOCOL_METHODS = sorted(n for n, v in vars(Store).items() if inspect.isfunction(v) and not n.startswith("_"))


def test_protocol_lists_the_store_methods():
    # a method added to the protocol needs its contract here too
    assert PROTOCOL_METHODS == sorted([
        "register_task", "add_rows", "write", "start_rows_at", "get", "get_split", "ack", "ack_many", "ack_rows",
        "release",
        "release_rows", "renew", "renew_many", "revoke", "expire", "drop", "consumed", "pending",
        "stats", "gc", "snapshot", "stop_waits"])  # fmt: skip


@pytest.mark.parametrize("cls_name", ["SampleStore", "VStore", pytest.param("RayStore", marks=NO_RAY)])
@pytest.mark.parametrize("name", PROTOCOL_METHODS)
def test_every_protocol_method_has_a_compatible_signature(cls_name, name):
    cls = {"SampleStore": SampleStore, "VStore": VStore}.get(cls_name, RayStore)
    impl = getattr(cls, name, None)
    assert callable(impl), f"{cls_name} has no {name}"
    want = inspect.signature(getattr(Store, name)).parameters
    have = inspect.signature(impl).parameters
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    want_pos = [p for p in want if want[p].kind in positional]
    have_pos = [p for p in have if have[p].kind in positional]
    assert have_pos[: len(want_pos)] == want_pos, f"{cls_name}.{name}: positional parameters"
    for p, w in want.items():
        assert p in have, f"{cls_name}.{name} lacks parameter {p!r}"
        h = have[p]
        assert h.kind == w.kind, f"{cls_name}.{name}({p}): {h.kind} vs the protocol's {w.kind}"
        if w.default is not inspect.Parameter.empty:
            assert h.default == w.default, f"{cls_name}.{name}({p}) default {h.default!r} != {w.default!r}"
    for p, h in have.items():  # anything extra must be optional
        if p not in want:
            assert h.default is not inspect.Parameter.empty or h.kind in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD), f"{cls_name}.{name}: required {p!r}"


def test_both_stores_are_a_store(store):
    assert isinstance(store, Store)
    assert not isinstance(object(), Store)


# ---------------------------------------------------------------------- rows
def test_add_rows_numbering(store):
    a = add(store, 4, 2)
    assert a == list(range(a[0], a[0] + 8))  # ascending and contiguous: equal-size groups
    b = add(store, 3, 4)
    assert b == list(range(b[0], b[0] + 12)) and b[0] > a[-1]  # a later call: higher rows
    c = add(store, 3, 1)
    assert c == sorted(c) and len(set(c)) == 3 and c[0] > b[-1]
    assert store.add_rows({}, []) == []
    assert store.stats()["rows"] == 23


def test_start_rows_at(store):
    a = add(store, 1, 2)
    store.start_rows_at(a[0] + 100)
    b = add(store, 2, 2)
    assert b[0] >= a[0] + 100 and b == sorted(b)
    store.start_rows_at(a[0])  # never backwards
    c = add(store, 1, 2)
    assert c[0] > b[-1] > a[-1]


# ---------------------------------------------------------------------- get
def test_get_returns_the_lowest_eligible_rows_in_row_order(store):
    rows = add(store, 12, 2)  # 24 rows over both shards
    a = store.get("reward", 5)
    assert a.rows == rows[:5] and a.task == "reward" and len(a) == 5
    assert a.columns["_row"] == a.rows and a.columns["response"] == [f"r{i}" for i in range(5)]
    b = store.get("reward", 10)  # crosses from shard 0 into shard 1
    assert b.rows == rows[5:15]
    assert b.columns["_group"] == sorted(b.columns["_group"]) and len(set(b.columns["_group"])) == 6
    assert store.release(a)
    c = store.get("reward", 7)  # the lowest again: a's rows and then above b
    assert c.rows == rows[:5] + rows[15:17]
    assert c.columns["response"] == [f"r{i}" for i in [0, 1, 2, 3, 4, 15, 16]]
    assert set(c.rows).isdisjoint(b.rows)  # rule 3: exclusive per task


def _split_contract(store):
    """get_split: one call, several leases of ``split`` rows, in row order (the trainer's
    micro-batches; module docstring of asyncflow.runtime.store)."""
    rows = add(store, 10, 4)  # 40 rows, every one ready for "reward"
    got = store.get_split("reward", 40, 16)
    assert [x.rows for x in got] == [rows[:16], rows[16:32], rows[32:]]  # all ready: all n
    assert len({x.id for x in got}) == 3
    for x in got:
        assert x.columns["_row"] == x.rows
        assert x.columns["response"] == [f"r{rows.index(r)}" for r in x.rows]
    assert store.get("reward", 1) is None  # rule 3: exclusive per task
    assert all(store.release(x) for x in got)
    two = store.get_split("reward", 64, 16, min_rows=16)  # 40 of 64 ready: whole splits only
    assert [x.rows for x in two] == [rows[:16], rows[16:32]]
    assert store.get_split("reward", 64, 16, min_rows=16) == []  # 8 left: fewer than 16
    end = store.get_split("reward", 8, 16, min_rows=8)  # a window's end: the 8 there are
    assert [x.rows for x in end] == [rows[32:]]
    assert store.ack(two[1]) and store.ack(end[0])  # each lease ends on its own
    assert store.release(two[0])
    capped = store.get_split("reward", 16, 8, max_row=rows[12])  # 12 eligible of 16: one split
    assert [x.rows for x in capped] == [rows[:8]]


def test_get_split_leases_micro_batches_in_one_call(store):
    _split_contract(store)


def _one_ray_shard(ray_shards) -> "RayStore":
    """A RayStore on the first shard alone, reset to empty, its rows from a chunk boundary."""
    handles = ray_shards[:1]
    ray.get(handles[0].restore.remote(SampleStore(lease_s=LEASE_S).snapshot()))
    s = RayStore(shards=1, lease_s=LEASE_S, chunk=CHUNK, _handles=handles)
    s.register_task("reward", ["response"])
    s.register_task("train", ["response", "reward"])
    s.start_rows_at(-(-ray.get(handles[0].next_row.remote()) // CHUNK) * CHUNK)
    return s


def _spy_calls(s: "RayStore") -> list[str]:
    """The names of the actor methods ``s`` calls on its one shard from now on, in order."""
    calls: list[str] = []
    real = s._shards[0]

    class Spy:
        def __getattr__(self, name):
            method = getattr(real, name)

            class Method:
                def remote(self, *a, **k):
                    calls.append(name)
                    return method.remote(*a, **k)
            return Method()

    s._shards[0] = Spy()
    return calls


@pytest.mark.ray
@NO_RAY
def test_get_split_on_one_ray_shard_is_one_actor_call(ray_shards):
    s = _one_ray_shard(ray_shards)
    calls = _spy_calls(s)
    _split_contract(s)
    assert calls.count("get_split") == 5  # one actor call per get_split


@pytest.mark.ray
@NO_RAY
def test_a_read_carries_the_acks_of_earlier_leases_in_its_one_actor_call(ray_shards):
    # a batches loop's ack goes with its next read: one round trip a lease, not two; the
    # acks are applied before the read leases anything (a stale one is still counted once)
    s = _one_ray_shard(ray_shards)
    rows = add(s, 4, 2)
    a = s.get("reward", 4)
    b = s.get("reward", 2)
    gone = s.get("reward", 2)
    s.release(gone)
    calls = _spy_calls(s)
    c = s.get("reward", 4, acks=[(a, {"reward": [1.0] * 4}), (b, {"reward": [2.0] * 2})])
    assert calls == ["get"]
    assert c.rows == rows[6:]  # the released rows: a and b were consumed first
    assert s.consumed("reward") == a.rows + b.rows
    train = s.get("train", 8)
    assert train.rows == a.rows + b.rows and train.columns["reward"] == [1.0] * 4 + [2.0] * 2
    before = s.stats()["stale_acks"]
    assert s.get("reward", 4, acks=[(a, {"reward": [9.0] * 4}), (c, None)]) is None
    assert s.stats()["stale_acks"] == before + 1  # a's second ack is stale, once
    assert s.consumed("reward") == a.rows + b.rows + c.rows


@pytest.mark.parametrize("kind", [pytest.param("ray", marks=[NO_RAY, pytest.mark.ray])])
def test_carried_acks_over_several_shards_are_plain_acks_first(kind, ray_shards):
    s = _fresh_ray(ray_shards)
    s.register_task("reward", ["response"])
    s.register_task("train", ["response", "reward"])
    rows = add(s, 8, 2)  # on both shards
    a = s.get("reward", 12)
    c = s.get("reward", 8, acks=[(a, {"reward": [float(r) for r in a.rows]})])
    assert c.rows == rows[12:]
    assert sorted(s.consumed("reward")) == a.rows  # (a lease over shards: acked part by part)
    assert s.get("train", 16).columns["reward"] == [float(r) for r in a.rows]


def test_inputs_not_ready_are_not_eligible_until_written(store):
    rows = add(store, 8, 2, ready=False)
    assert store.get("reward", 10) is None
    assert store.pending("reward") == 0
    some = [rows[3], rows[9], rows[12]]
    assert store.write(some, {"response": ["x", "y", "z"]})
    assert store.pending("reward") == 3
    lease = store.get("reward", 10)
    assert lease.rows == some and lease.columns["response"] == ["x", "y", "z"]
    assert store.pending("train") == 0  # train needs reward as well
    # stats()'s ready counts are pending()'s, every task in one call (the driver's queue_depth)
    store.write(rows[:2], {"response": ["a", "b"]})
    ready = store.stats()["tasks"]
    assert {t: ready[t]["ready"] for t in ("reward", "train")} == {
        "reward": store.pending("reward"), "train": store.pending("train")} == {
        "reward": 2, "train": 0}


def test_max_row(store):
    rows = add(store, 12, 2)
    a = store.get("reward", 100, max_row=rows[10])
    assert a.rows == rows[:10]
    assert store.get("reward", 100, max_row=rows[10]) is None
    assert store.get("reward", 100).rows == rows[10:]


def test_min_version(store):
    vs = [i // 4 for i in range(16)]  # versions 0..3, four rows each
    rows = add(store, 8, 2, versions=vs)
    a = store.get("reward", 100, min_version=2)
    assert a.rows == rows[8:] and a.columns["_version"] == vs[8:]
    b = store.get("reward", 100)
    assert b.rows == rows[:8] and b.columns["_version"] == vs[:8]


def test_whole_groups_returns_complete_groups_only(store):
    rows = add(store, 12, 2, ready=False)
    half = [r for i, r in enumerate(rows) if i != 3]  # group 1 (rows 2, 3) lacks one response
    store.write(half, {"response": ["x"] * len(half)})
    a = store.get("reward", 5, whole_groups=True, group_size=2)  # 5 rows: 2 whole groups
    assert a.rows == [rows[0], rows[1], rows[4], rows[5]]
    assert len(set(a.columns["_group"])) == 2
    b = store.get("reward", 100, whole_groups=True, group_size=2)
    assert b.rows == rows[6:] and b.rows == sorted(b.rows)
    assert store.get("reward", 100, whole_groups=True, group_size=2) is None  # row 2 alone
    assert store.get("reward", 1, whole_groups=True, group_size=2) is None  # n < group_size
    assert store.get("reward", 100).rows == [rows[2]]


def test_min_rows_with_timeout_zero(store):
    rows = add(store, 2, 2)  # 4 eligible
    t0 = time.monotonic()
    assert store.get("reward", 10, min_rows=5, timeout=0) is None
    assert time.monotonic() - t0 < 2.0
    assert store.pending("reward") == 4  # the failed get holds nothing
    assert store.get("reward", 10, min_rows=4, timeout=0).rows == rows


def test_stop_waits_ends_a_waiting_read_and_later_reads_do_not_wait(store):
    # the run is stopping: a worker blocked in a long read hears of it at once
    import threading

    got = {}

    def read():
        t = time.monotonic()
        got["lease"] = store.get("reward", 4, timeout=20.0)
        got["s"] = time.monotonic() - t

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.3)  # the read is waiting: nothing is eligible
    store.stop_waits()
    reader.join(10.0)
    assert not reader.is_alive() and got["lease"] is None and got["s"] < 10.0
    t = time.monotonic()
    assert store.get("reward", 4, min_rows=1, timeout=20.0) is None  # no wait any more
    assert time.monotonic() - t < 10.0
    rows = add(store, 2, 2)
    assert store.get("reward", 4).rows == rows  # what is eligible is still leased


def test_fields(store):
    rows = add(store, 4, 2)
    a = store.get("reward", 2)
    assert set(a.columns) == {"response", "_row", "_group", "_version"}  # default: the inputs
    b = store.get("reward", 8, fields=["prompt"])
    assert set(b.columns) == {"prompt", "_row", "_group", "_version"}
    assert b.rows == rows[2:] and b.columns["prompt"] == [f"p{i}" for i in range(2, 8)]


# ---------------------------------------------------------------------- ack, release
def test_ack_consumes_in_ack_order_and_writes_outputs(store):
    rows = add(store, 8, 2)  # 0-7 on one shard, 8-15 on the other (ray)
    a = store.get("reward", 8)
    b = store.get("reward", 4)
    assert (a.rows, b.rows) == (rows[:8], rows[8:12])
    assert store.ack(b, {"reward": [float(r) for r in b.rows]})
    assert store.ack(a, {"reward": [float(r) for r in a.rows]})
    assert store.consumed("reward") == b.rows + a.rows  # ack order
    assert not store.ack(a)  # acked: stale
    c = store.get("reward", 100)
    assert c.rows == rows[12:]  # consumed rows are not leased again
    train = store.get("train", 100)
    assert train.rows == rows[:12]
    assert train.columns["reward"] == [float(r) for r in rows[:12]]
    assert store.consumed("train") == []


def test_ack_of_a_lease_across_shards_consumes_all_its_rows(store):
    rows = add(store, 8, 2)
    a = store.get("reward", 16)
    assert store.ack(a, {"reward": list(range(16))})
    assert sorted(store.consumed("reward")) == rows
    assert store.get("train", 16).columns["reward"] == list(range(16))


def test_ack_many_is_each_ack_in_turn(store):
    """ack_many: every lease acked (no columns); a stale one answers False and is counted, as
    its own ack would be; one of the leases spans both Ray shards. The order in which the leases
    of one call are consumed among themselves is not defined (Ray sends them at once)."""
    rows = add(store, 8, 2)  # 0-7 on one shard, 8-15 on the other (ray)
    a = store.get("reward", 4)
    b = store.get("reward", 8)  # rows 4-11: across the shards on ray
    c = store.get("reward", 2)
    assert store.release(c)
    stale0 = store.stats()["stale_acks"]
    assert store.ack_many([b.id, a, c.id]) == [True, True, False]
    assert sorted(store.consumed("reward")) == sorted(a.rows + b.rows) == rows[:12]
    assert store.stats()["stale_acks"] == stale0 + 1
    assert store.stats()["leases_live"] == 0
    assert store.ack_many([a.id, b]) == [False, False]
    assert store.stats()["stale_acks"] == stale0 + 3
    assert store.ack_many([]) == []
    assert store.get("reward", 100).rows == rows[12:]  # c's rows were given back


def test_ack_rows_partial(store):
    rows = add(store, 8, 2)
    lease = store.get("reward", 16)
    assert store.ack_rows(lease, [rows[2], rows[1]], {"reward": [2.0, 1.0]})
    assert store.consumed("reward") == [rows[2], rows[1]]
    assert store.get("reward", 100) is None  # the rest stays leased
    assert store.stats()["tasks"]["reward"] == {"consumed": 2, "leased": 14, "ready": 0}
    t = store.get("train", 100)
    assert t.rows == [rows[1], rows[2]] and t.columns["reward"] == [1.0, 2.0]
    rest = [r for r in rows if r not in (rows[1], rows[2])]
    assert store.ack_rows(lease, rest[:3])
    assert store.ack_rows(lease, rest[3:])
    assert sorted(store.consumed("reward")) == rows
    assert not store.ack(lease)  # the lease ended with its last row
    assert not store.release(lease)


@pytest.mark.parametrize("part", ["ack_rows", "release_rows"])
def test_a_lease_stays_live_until_its_last_row(store, part):
    rows = add(store, 8, 2)
    lease = store.get("reward", 16)
    first = rows[:8]  # every row of the lease on one shard (ray)
    if part == "ack_rows":
        assert store.ack_rows(lease, first)
    else:
        assert store.release_rows(lease, first)
    assert store.renew(lease)
    assert store.ack(lease)
    assert sorted(store.consumed("reward")) == (rows if part == "ack_rows" else rows[8:])


@pytest.mark.parametrize("where", ["same_shard", "other_shard"])
@pytest.mark.parametrize("method", ["ack_rows", "release_rows"])
def test_rows_the_lease_does_not_hold_are_an_error(store, method, where):
    rows = add(store, 8, 2)
    lease = store.get("reward", 4)  # rows 0-3: shard 0
    other = rows[5] if where == "same_shard" else rows[9]
    with pytest.raises(StoreError):
        getattr(store, method)(lease, [other])
    assert store.consumed("reward") == [] and store.pending("reward") == 12
    assert store.ack(lease)


def test_release_gives_rows_back(store):
    rows = add(store, 8, 2)
    a = store.get("reward", 12)
    assert a.rows == rows[:12]
    assert store.release(a)
    assert not store.release(a)
    assert store.consumed("reward") == []
    assert store.get("reward", 12).rows == a.rows  # leased again by the next get


def test_release_rows_partial(store):
    rows = add(store, 8, 2)
    lease = store.get("reward", 12)
    back = [rows[1], rows[9]]
    assert store.release_rows(lease, back)
    assert store.pending("reward") == 6  # 2 back + the 4 never leased
    again = store.get("reward", 2)
    assert again.rows == back
    assert store.ack(lease)  # the rest were still leased
    assert sorted(store.consumed("reward")) == sorted(set(rows[:12]) - set(back))
    assert store.release_rows(again, [rows[1]]) and store.release_rows(again, [rows[9]])
    assert not store.release(again)  # ended with its last row
    assert store.get("reward", 100).rows == back + rows[12:]


# ---------------------------------------------------------------------- staleness, leases
def test_a_stale_ack_after_release_changes_nothing(store):
    rows = add(store, 8, 2)
    old = store.get("reward", 12)
    assert store.release(old)
    assert not store.ack(old, {"reward": [-1.0] * 12})
    assert store.pending("reward") == 16
    assert store.consumed("reward") == [] and store.pending("train") == 0
    new = store.get("reward", 12)
    assert new.rows == old.rows == rows[:12]
    assert store.ack(new, {"reward": [1.0] * 12})  # would be "written twice" had the stale ack written
    assert store.get("train", 100).columns["reward"] == [1.0] * 12
    assert store.stats()["stale_acks"] >= 1


def test_expire_reissues_rows_of_a_lease_that_ran_out(store):
    rows = add(store, 8, 2)
    old = store.get("reward", 12, lease_s=0.2)
    keep = store.get("reward", 4)  # a long lease: not expired
    time.sleep(0.35)
    assert store.expire() >= 1
    assert store.expire() == 0  # once per expiry
    assert store.stats()["rows_reissued"] == 12
    new = store.get("reward", 100)
    assert new.rows == old.rows
    assert not store.ack(old, {"reward": [-1.0] * 12})  # stale: the later holder wins
    assert not store.write(old.rows, {"reward": [-1.0] * 12}, lease_id=old.id)
    assert store.consumed("reward") == [] and store.pending("train") == 0
    assert store.ack(new, {"reward": [1.0] * 12}) and store.ack(keep)
    assert store.get("train", 100).rows == rows[:12]
    assert sorted(store.consumed("reward")) == rows


def test_renew_and_renew_many_keep_a_lease_alive(store):
    add(store, 8, 2)
    a = store.get("reward", 10, lease_s=0.4)
    b = store.get("reward", 3, lease_s=0.4)
    c = store.get("reward", 3, lease_s=0.4)
    time.sleep(0.2)
    assert store.renew(a, 5.0)
    assert store.renew_many([b.id, c.id], 5.0) >= 2
    time.sleep(0.35)  # past the first deadlines
    assert store.expire() == 0
    assert store.get("reward", 100) is None
    assert store.ack(a) and store.ack(b) and store.ack(c)
    assert store.renew(a, 1.0) is False and store.renew_many([a.id], 1.0) == 0


def test_revoke_gives_back_every_lease_of_an_owner(store):
    rows = add(store, 8, 2)
    a = store.get("reward", 3, owner="w1")
    b = store.get("reward", 3, owner="w2")
    c = store.get("reward", 8, owner="w1")  # across both shards
    assert store.revoke("w1") >= 2
    assert store.revoke("w1") == 0
    assert store.pending("reward") == 13
    again = store.get("reward", 100)
    assert again.rows == a.rows + c.rows + rows[14:]
    assert not store.ack(a) and not store.ack(c)
    assert store.ack(b)
    assert store.stats()["leases_revoked"] >= 2


def test_lease_counts_are_per_lease(store):
    add(store, 8, 2)
    a = store.get("reward", 16, lease_s=0.2)  # one lease over both shards
    assert store.stats()["leases_live"] == 1
    assert store.renew_many([a.id], 0.2) == 1
    time.sleep(0.3)
    assert store.expire() == 1
    assert not store.ack(a)
    b = store.get("reward", 16, owner="w")
    assert store.revoke("w") == 1
    assert not store.ack(b)
    st_ = store.stats()
    assert (st_["leases_reissued"], st_["leases_revoked"], st_["stale_acks"]) == (2, 1, 2)


def test_rows_a_lease_already_acked_are_not_its_rows(store):
    rows = add(store, 8, 2)
    lease = store.get("reward", 16)  # ray: half on each shard
    assert store.ack_rows(lease, rows[:8])
    with pytest.raises(StoreError):  # acked: no longer the lease's (ray: that part had ended)
        store.ack_rows(lease, [rows[0]])
    assert store.renew_many([lease.id]) == 1
    assert store.ack_rows(lease, rows[8:])  # the last rows: the lease ends
    assert not store.ack(lease) and not store.renew(lease) and not store.release(lease)
    assert store.renew_many([lease.id]) == 0
    st_ = store.stats()
    assert (st_["leases_live"], st_["stale_acks"]) == (0, 1)
    assert sorted(store.consumed("reward")) == rows


def test_a_stale_ack_rows_is_counted_once(store):
    rows = add(store, 8, 2)
    lease = store.get("reward", 16, lease_s=0.1)
    time.sleep(0.2)
    assert store.expire() == 1
    assert not store.ack_rows(lease, [rows[9]])  # ray: only the second shard's part is asked
    assert not store.ack_rows(lease, [rows[0], rows[9]])
    assert store.stats()["stale_acks"] == 2


def test_leases_restored_counts_leases(store):
    add(store, 8, 2)
    store.get("reward", 16)
    r = restored(store, store.snapshot())
    try:
        assert r.stats()["leases_restored"] == 1
    finally:
        _close(r)


# ---------------------------------------------------------------------- drops, pending, stats
def test_drop_makes_rows_ineligible_for_every_task(store):
    rows = add(store, 8, 2)
    assert store.drop([rows[1], rows[9]], "stale") == 2
    assert store.drop([rows[2]], "bad") == 1
    assert store.drop([rows[1]], "stale") == 0  # already dropped: not counted again
    assert store.stats()["drops"] == {"stale": 2, "bad": 1}
    assert store.pending("reward") == 13
    a = store.get("reward", 100)
    assert a.rows == [r for r in rows if r not in (rows[1], rows[2], rows[9])]
    assert store.ack(a, {"reward": [0.0] * len(a.rows)})
    store.write([rows[1], rows[2], rows[9]], {"reward": [0.0] * 3})  # ready for train, but dropped
    assert store.pending("train") == 13
    assert set(store.get("train", 100).rows).isdisjoint({rows[1], rows[2], rows[9]})


def test_pending_counts_rows_eligible_now(store):
    rows = add(store, 4, 2, ready=False)
    assert store.pending("reward") == 0
    store.write(rows[:6], {"response": ["x"] * 6})
    assert store.pending("reward") == 6
    a = store.get("reward", 2)
    assert store.pending("reward") == 4  # leased
    store.drop([rows[5]], "bad")
    assert store.pending("reward") == 3  # dropped
    assert store.ack(a)
    assert store.pending("reward") == 3  # consumed: not back
    b = store.get("reward", 3)
    assert store.release(b)
    assert store.pending("reward") == 3  # released: back
    with pytest.raises(StoreError):
        store.pending("nope")


def test_stats_common_keys_and_task_counts(store):
    rows = add(store, 4, 2)
    a = store.get("reward", 3)
    store.ack(a, {"reward": [0.0] * 3})
    store.get("reward", 2)
    store.drop([rows[7]], "bad")
    s = store.stats()
    assert STATS_KEYS <= set(s)
    assert s["rows"] == 8 and s["freed"] == 0 and s["drops"] == {"bad": 1}
    assert {t: set(d) for t, d in s["tasks"].items()} == {"reward": TASK_KEYS, "train": TASK_KEYS}
    assert s["tasks"]["reward"] == {"consumed": 3, "leased": 2, "ready": 2}
    assert s["tasks"]["train"] == {"consumed": 0, "leased": 0, "ready": 3}
    assert s["leases_live"] == 1  # rows 3-4: one shard (ray)
    assert s["stale_acks"] == s["stale_writes"] == s["leases_restored"] == s["leases_revoked"] == 0
    assert s["leases_reissued"] == s["rows_reissued"] == 0


# ---------------------------------------------------------------------- gc
def test_gc_frees_rows_every_task_consumed(store):
    rows = add(store, 8, 2)
    assert store.gc() == 0
    a = store.get("reward", 12)
    store.ack(a, {"reward": [1.0] * 12})
    assert store.gc() == 0  # train has consumed nothing
    t = store.get("train", 6)  # rows 0-5
    u = store.get("train", 4)  # rows 6-9, still leased
    assert store.ack(t)
    store.drop([rows[13]], "bad")  # dropped and no lease holds it: freed too
    store.drop([rows[6]], "bad")  # dropped, but u still holds it: not yet
    assert store.gc() == 7
    assert store.gc() == 0
    assert store.stats()["freed"] == 7
    assert store.release(u)
    assert store.gc() == 1
    assert store.stats()["freed"] == 8
    assert store.get("train", 100).rows == rows[7:12]  # freed rows are never returned again
    assert store.get("reward", 100).rows == [rows[12], rows[14], rows[15]]
    assert store.stats()["rows"] == 16


# ---------------------------------------------------------------------- snapshot, restore
def test_snapshot_is_plain_data_and_restores(store):
    rows = add(store, 8, 2)
    store.start_rows_at(rows[0] + 40)
    more = add(store, 2, 2)
    assert more[0] >= rows[0] + 40
    a = store.get("reward", 4)  # shard 0
    b = store.get("reward", 4)  # shard 0
    c = store.get("reward", 4)  # shard 1
    store.ack(c, {"reward": [3.0] * 4})
    store.ack(a, {"reward": [1.0] * 4})
    store.drop([rows[15], more[0]], "stale")
    inflight = b.rows
    snap = store.snapshot()
    plain = json.loads(json.dumps(snap))  # plain data
    before = store.stats()
    r = restored(store, plain)
    try:
        assert isinstance(r, Store) and type(r) is type(store)
        assert r.consumed("reward") == c.rows + a.rows
        assert r.consumed("train") == []
        s = r.stats()
        assert (s["rows"], s["drops"]) == (before["rows"], {"stale": 2})
        assert s["tasks"]["reward"] == {"consumed": 8, "leased": 0, "ready": 10}  # b came back
        assert s["leases_restored"] == 1
        got = r.get("reward", 100)
        assert got.rows == inflight + rows[12:15] + more[1:]
        assert got.columns["response"] == [f"r{i}" for i in (4, 5, 6, 7, 12, 13, 14)] + ["r1", "r2", "r3"]
        t = r.get("train", 100)
        assert t.rows == rows[:4] + rows[8:12] and t.columns["reward"] == [1.0] * 4 + [3.0] * 4
        assert add(r, 1, 2)[0] > more[-1]
        assert not r.ack(b)  # the in-flight holder is gone
    finally:
        _close(r)


def test_snapshot_of_numpy_values_is_json_after_converting_numpy(store):
    # the in-process store keeps the written values (numpy scalars here), the Ray store converts
    # them to Python; either way converting numpy leaves JSON, and restore gives the values back
    import numpy as np

    rows = store.add_rows({"response": np.arange(4, dtype=np.float32) / 2}, [1, 1, 2, 2])
    snap = store.snapshot()
    text = json.dumps(snap, default=lambda o: o.tolist() if isinstance(o, (np.ndarray, np.generic)) else None)
    r = restored(store, json.loads(text))
    try:
        lease = r.get("reward", 4)
        assert lease.rows == rows and [float(x) for x in lease.columns["response"]] == [0.0, 0.5, 1.0, 1.5]
    finally:
        _close(r)


# ---------------------------------------------------------------------- both stores, one history
@pytest.fixture(scope="module")
def pair(request):
    if ray is None:
        pytest.skip("ray is not importable")
    request.getfixturevalue("ray_session")
    stores = [_new("local"), _new("ray")]
    yield stores
    for s in stores:
        _close(s)


_examples = itertools.count()

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 3), st.sampled_from([1, 2, 4]), st.booleans()),
        st.tuples(st.just("write"), st.integers(0, 9)),
        st.tuples(st.just("get"), st.integers(0, 1), st.integers(1, 8), st.integers(1, 8), st.booleans(),
                  st.one_of(st.none(), st.integers(0, 40))),
        st.tuples(st.just("ack"), st.integers(0, 9)),
        st.tuples(st.just("release"), st.integers(0, 9)),
        st.tuples(st.just("drop"), st.lists(st.integers(0, 40), min_size=1, max_size=3),
                  st.sampled_from(["stale", "bad"])),
    ),
    min_size=1, max_size=30,
)  # fmt: skip


@pytest.mark.ray
@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_both_stores_give_the_same_answers(pair, ops):
    """One random history of add_rows / write / get / ack / release / drop on both stores: the
    same leases (rows and values), ack/release answers, pending counts, consumption and drops.
    Rows are compared by their index within the history (the stores may number them apart).
    Each history uses its own tasks and fields, so the stores are shared between examples."""
    ex = next(_examples)
    f_in, f_out, t0, t1 = f"in{ex}", f"out{ex}", f"t{ex}", f"u{ex}"
    tasks = (t0, t1)
    for s in pair:
        s.register_task(t0, [f_in])
        s.register_task(t1, [f_in, f_out])
    rows: list[list[int]] = [[], []]  # history index -> row, per store
    index: list[dict[int, int]] = [{}, {}]  # row -> history index, per store
    unready: list[list[int]] = []  # batches (history indices) added without f_in
    leases: list[tuple] = []  # (task, lease per store)
    acks = {t0: [], t1: []}  # history indices per successful ack, in ack order
    drops0 = pair[0].stats()["drops"], pair[1].stats()["drops"]
    for s in pair:  # the history's first 4 rows on one shard, the next 8 on the other (ray)
        last = s.add_rows({}, [-1])[0]  # a row no task is given (no fields): where rows are now
        s.start_rows_at(-(-last // (2 * CHUNK)) * 2 * CHUNK + 2 * CHUNK + 4)
    ops = [("add", 3, 4, True), *ops]  # rows over both shards from the start

    def local(i, s_rows):
        return [index[i][r] for r in s_rows]

    for op in ops:
        kind = op[0]
        if kind == "add":
            _, n_groups, size, ready = op
            k = n_groups * size
            first, gid = len(rows[0]), next(_groups)
            groups = [gid + j // size for j in range(k)]
            for _ in range(n_groups - 1):
                next(_groups)
            vals = list(range(first, first + k))
            for i, s in enumerate(pair):
                got = s.add_rows({f_in: vals} if ready else {"x": vals}, groups)
                assert got == sorted(got) and (not rows[i] or got[0] > rows[i][-1])
                rows[i] += got
                index[i].update({r: first + j for j, r in enumerate(got)})
            if not ready:
                unready.append(vals)
        elif kind == "write":
            if not unready:
                continue
            vals = unready.pop(op[1] % len(unready))
            for i, s in enumerate(pair):
                assert s.write([rows[i][h] for h in vals], {f_in: vals})
        elif kind == "get":
            _, task, n, min_rows, whole, cut = op
            task = tasks[task]
            got = []
            for i, s in enumerate(pair):
                max_row = rows[i][cut] if cut is not None and cut < len(rows[i]) else None
                got.append(s.get(task, n, min_rows=min_rows, whole_groups=whole, group_size=2,
                                 max_row=max_row, timeout=0))
            assert (got[0] is None) == (got[1] is None), (op, got)
            if got[0] is None:
                continue
            assert local(0, got[0].rows) == local(1, got[1].rows), op
            assert got[0].columns[f_in] == got[1].columns[f_in] == local(0, got[0].rows)
            if task == t1:
                assert got[0].columns[f_out] == got[1].columns[f_out]
            leases.append((task, got))
        elif kind in ("ack", "release"):
            if not leases:
                continue
            task, got = leases[op[1] % len(leases)]
            answers = []
            for i, s in enumerate(pair):
                if kind == "release":
                    answers.append(s.release(got[i]))
                elif task == t0:  # the first task's output: the second task's input
                    answers.append(s.ack(got[i], {f_out: [-h for h in local(i, got[i].rows)]}))
                else:
                    answers.append(s.ack(got[i]))
            assert answers[0] == answers[1], op
            if kind == "ack" and answers[0]:
                acks[task].append(local(0, got[0].rows))
        elif kind == "drop":
            if not rows[0]:
                continue
            hs = sorted({h % len(rows[0]) for h in op[1]})
            counts = [s.drop([rows[i][h] for h in hs], op[2]) for i, s in enumerate(pair)]
            assert counts[0] == counts[1], op
        for t in tasks:
            assert pair[0].pending(t) == pair[1].pending(t), (op, t)

    for t in tasks:
        order = acks[t]
        want = [h for seg in order for h in seg]
        assert local(0, pair[0].consumed(t)) == want  # the in-process store: lease order in an ack
        got = local(1, pair[1].consumed(t))
        assert sorted(got) == sorted(want)
        at = 0
        for seg in order:  # the Ray store: acks in order (an ack's rows in any order)
            assert sorted(got[at:at + len(seg)]) == sorted(seg)
            at += len(seg)
    s0, s1 = pair[0].stats(), pair[1].stats()
    for t in tasks:
        assert s0["tasks"][t] == s1["tasks"][t], t
    assert {k: v - drops0[0].get(k, 0) for k, v in s0["drops"].items()} == \
        {k: v - drops0[1].get(k, 0) for k, v in s1["drops"].items()}
