"""The in-process sample store (asyncflow/runtime/store/local.py); rule numbers cite its docstring."""
from __future__ import annotations

import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from asyncflow.engines.batching import balance_micro_batches, token_sums
from asyncflow.runtime.store import Lease, SampleStore, StoreError


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def grpo_store(groups=2, size=4, lease_s=10.0, clock=None):
    s = SampleStore(lease_s=lease_s, **({"clock": clock} if clock else {}))
    s.register_task("generate", ["prompt"])
    s.register_task("reward", ["response"])
    s.register_task("train", ["response", "reward"])
    rows = s.add_rows({"prompt": [f"p{i // size}" for i in range(groups * size)]}, [i // size for i in range(groups * size)])
    return s, rows


# --------------------------------------------------------------------------- basics
def test_add_rows_returns_ascending_indices_and_bookkeeping_columns():
    s, rows = grpo_store()
    assert rows == list(range(8))
    assert s.add_rows({"prompt": ["x"]}, [9], versions=[3]) == [8]
    lease = s.get("generate", 100)
    assert isinstance(lease, Lease) and lease.rows == list(range(9))
    assert lease.columns["_row"] == lease.rows
    assert lease.columns["_group"] == [0, 0, 0, 0, 1, 1, 1, 1, 9]
    assert lease.columns["_version"] == [None] * 8 + [3]
    assert set(lease.columns) == {"prompt", "_row", "_group", "_version"}


def test_variable_length_values_are_stored_unpadded():  # rule 1
    s, rows = grpo_store(groups=1, size=3)
    toks = [[1], [2, 3, 4], []]
    s.write(rows, {"response": toks})
    assert s.get("reward", 3).columns["response"] == toks


def test_field_written_twice_is_an_error_but_version_may_be_rewritten():  # rule 1
    s, rows = grpo_store(groups=1, size=2)
    s.write(rows, {"response": ["a", "b"], "_version": [0, 0]})
    with pytest.raises(StoreError, match="written twice"):
        s.write([1], {"response": ["c"]})
    with pytest.raises(StoreError):
        s.write([0], {"_row": [5]})
    s.write(rows, {"_version": [1, 2]})
    assert s.get("reward", 2).columns["_version"] == [1, 2]


def test_write_validates_before_mutating():
    s, rows = grpo_store(groups=1, size=2)
    s.write([0], {"response": ["a"]})
    with pytest.raises(StoreError):
        s.write([0, 1], {"reward": [1.0, 2.0], "response": ["x", "y"]})
    assert s.pending("train") == 0 and s.pending("reward") == 1


def test_unknown_task_and_rows():
    s, _ = grpo_store()
    with pytest.raises(StoreError, match="unknown task"):
        s.get("nope", 1)
    with pytest.raises(StoreError, match="unknown row"):
        s.write([99], {"response": ["x"]})
    with pytest.raises(StoreError, match="already registered"):
        s.register_task("train", ["x"])
    s.register_task("train", ["response", "reward"])  # same inputs: fine


def test_get_needs_all_inputs_ready_and_lowest_rows_first():  # rule 2
    s, rows = grpo_store()
    s.write([5, 2, 7], {"response": ["a", "b", "c"]})
    assert s.pending("reward") == 3 and s.pending("train") == 0
    lease = s.get("reward", 2)
    assert lease.rows == [2, 5] and lease.columns["response"] == ["b", "a"]
    assert s.get("reward", 5).rows == [7]
    assert s.get("reward", 5) is None


def test_leases_are_exclusive_per_task_and_independent_across_tasks():  # rule 3
    s, rows = grpo_store()
    a = s.get("generate", 3)
    b = s.get("generate", 3)
    assert set(a.rows).isdisjoint(b.rows)
    s.add_rows({"response": ["r"] * 2}, [7, 7])
    other = s.get("reward", 10)
    assert other.rows == [8, 9]


def test_ack_consumes_release_returns():
    s, rows = grpo_store()
    a = s.get("generate", 3)
    assert s.release(a.id)
    assert s.get("generate", 3).rows == a.rows
    b = s.get("generate", 100)
    assert s.ack(b.id)
    assert s.get("generate", 100) is None
    assert sorted(s.consumed("generate")) == b.rows
    assert s.stats()["tasks"]["generate"] == {"consumed": 5, "leased": 3, "ready": 0}


def test_ack_with_columns_writes_outputs_atomically():  # rule 4
    s, rows = grpo_store(groups=1, size=2)
    lease = s.get("generate", 2)
    assert s.ack(lease.id, {"response": ["x", "y"]})
    assert s.get("reward", 2).columns["response"] == ["x", "y"]


def test_whole_groups_and_max_row():  # rule 2
    s, rows = grpo_store(groups=3, size=2)
    s.write([0, 1, 2, 4, 5], {"response": list("abcde"), "reward": [1.0] * 5})
    lease = s.get("train", 10, whole_groups=True, group_size=2)
    assert lease.rows == [0, 1, 4, 5]  # group 1 (rows 2, 3) is incomplete
    s.release(lease.id)
    assert s.get("train", 10, whole_groups=True, group_size=2, max_row=4).rows == [0, 1]
    assert s.get("train", 3, whole_groups=True, group_size=2).rows == [4, 5]  # n rounds down to groups
    assert s.get("train", 10, whole_groups=True, group_size=2) is None


def test_whole_groups_interleaved_rows_take_groups_by_lowest_row():
    s = SampleStore()
    s.register_task("t", ["x"])
    s.add_rows({"x": list(range(6))}, [1, 0, 1, 0, 2, 2])
    lease = s.get("t", 4, whole_groups=True, group_size=2)
    assert lease.rows == [0, 1, 2, 3] and lease.columns["_group"] == [1, 0, 1, 0]


def test_min_rows_waits_for_enough_rows_then_times_out():
    s, rows = grpo_store()
    s.write([0], {"response": ["a"]})
    t0 = time.monotonic()
    assert s.get("reward", 4, min_rows=2, timeout=0.05) is None
    assert time.monotonic() - t0 >= 0.04

    def later():
        time.sleep(0.05)
        s.write([1, 2], {"response": ["b", "c"]})

    threading.Thread(target=later).start()
    lease = s.get("reward", 4, min_rows=3, timeout=5.0)
    assert lease.rows == [0, 1, 2]


def test_filter_fn_and_min_version():
    s = SampleStore()
    s.register_task("t", ["x"])
    s.add_rows({"x": list(range(6))}, list(range(6)), versions=[0, 1, 2, 0, 1, 2])
    assert s.get("t", 10, min_version=2).rows == [2, 5]
    assert s.get("t", 10, filter_fn=lambda r: r["_version"] == 1).rows == [1, 4]


def test_expired_lease_is_reissued_once_and_stale_ack_is_ignored():  # rule 4
    clock = Clock()
    s, rows = grpo_store(lease_s=1.0, clock=clock)
    a = s.get("generate", 3)
    clock.now = 2.0
    assert s.expire() == 1
    assert s.expire() == 0  # exactly once
    b = s.get("generate", 3)
    assert b.rows == a.rows
    assert not s.ack(a.id)  # stale: ignored
    assert s.write(a.rows, {"response": ["x"] * 3}, lease_id=a.id) is False
    assert s.ack(b.id)
    assert s.consumed("generate") == a.rows
    st_ = s.stats()
    assert (st_["leases_reissued"], st_["rows_reissued"], st_["stale_acks"], st_["stale_writes"]) == (1, 3, 1, 1)


def test_renew_keeps_lease_alive():
    clock = Clock()
    s, rows = grpo_store(lease_s=1.0, clock=clock)
    a = s.get("generate", 3)
    clock.now = 0.9
    assert s.renew(a.id)
    clock.now = 1.5
    assert s.expire() == 0
    clock.now = 2.0
    assert s.expire() == 1


def test_get_expires_leases_itself():
    clock = Clock()
    s, rows = grpo_store(lease_s=1.0, clock=clock)
    a = s.get("generate", 100)
    assert s.get("generate", 100) is None
    clock.now = 5.0
    assert s.get("generate", 100).rows == a.rows


def test_drop_counts_per_reason_and_hides_rows():  # rule 5
    s, rows = grpo_store()
    assert s.drop([0, 1], "stale") == 2
    assert s.drop([1, 2], "stale") == 1
    s.drop([3], "bad")
    assert s.get("generate", 100).rows == [4, 5, 6, 7]
    assert s.stats()["drops"] == {"stale": 3, "bad": 1}


def test_gc_frees_values_once_every_task_consumed():
    s = SampleStore()
    s.register_task("a", ["x"])
    s.register_task("b", ["x"])
    s.add_rows({"x": [[1] * 100] * 4}, [0, 0, 1, 1])
    s.ack(s.get("a", 4).id)
    assert s.gc() == 0
    lb = s.get("b", 2)
    s.ack(lb.id)
    assert s.gc() == 2
    assert s.gc() == 0
    assert s.stats()["freed"] == 2
    assert s.get("b", 4).columns["x"] == [[1] * 100] * 2


def test_snapshot_restore_roundtrip_with_leases_in_flight():  # rule 6
    s, rows = grpo_store()
    s.write([0, 1, 2, 3], {"response": list("abcd"), "_version": [1, 1, 2, 2]})
    s.ack(s.get("reward", 2).id, {"reward": [0.5, 1.5]})
    inflight = s.get("reward", 2)
    s.drop([7], "stale")
    snap = s.snapshot()
    import json

    json.dumps(snap)  # plain data (values here are JSON-able)
    r = SampleStore.restore(snap)
    assert r.consumed("reward") == [0, 1]
    assert r.stats()["leases_restored"] == 1
    lease = r.get("reward", 10)
    assert lease.rows == inflight.rows  # the in-flight rows come back
    assert lease.columns["_version"] == [2, 2]
    assert r.get("train", 10).columns["reward"] == [0.5, 1.5]
    assert r.add_rows({"prompt": ["z"]}, [5]) == [8]
    assert r.stats()["drops"] == {"stale": 1}


def test_explicit_row_indices_out_of_order():
    s = SampleStore()
    s.register_task("t", ["x"])
    s.add_rows({"x": ["c", "d"]}, [1, 1], rows=[20, 21])
    s.add_rows({"x": ["a", "b"]}, [0, 0], rows=[3, 4])
    with pytest.raises(StoreError):
        s.add_rows({"x": ["z"]}, [0], rows=[3])
    lease = s.get("t", 3)
    assert lease.rows == [3, 4, 20] and lease.columns["x"] == ["a", "b", "c"]
    assert s.get("t", 3, max_row=21) is None
    s.write([21], {"y": [1]})
    assert s.get("t", 3).rows == [21]


def test_concurrent_replicas_threads_exactly_once():
    s = SampleStore()
    s.register_task("t", ["x"])
    n = 2000
    got: list[list[int]] = [[] for _ in range(4)]

    def producer():
        for i in range(0, n, 50):
            s.add_rows({"x": list(range(i, i + 50))}, list(range(i, i + 50)))

    def consumer(k):
        while sum(map(len, got)) < n:
            lease = s.get("t", 37, timeout=0.05)
            if lease:
                got[k].extend(lease.rows)
                s.ack(lease.id)

    threads = [threading.Thread(target=producer)] + [threading.Thread(target=consumer, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    allrows = sorted(r for g in got for r in g)
    assert allrows == list(range(n))
    assert sorted(s.consumed("t")) == list(range(n))


# --------------------------------------------------------------------------- micro-batches
def test_balance_micro_batches():
    lengths = [100, 1, 1, 1, 50, 50, 2, 3]
    mbs = balance_micro_batches(lengths, 2)
    assert sorted(i for mb in mbs for i in mb) == list(range(8))
    assert all(len(mb) == 2 for mb in mbs)
    assert mbs == [[0, 3], [1, 4], [2, 5], [6, 7]]  # the longest row gets a shortest partner
    assert token_sums(lengths, mbs) == [101, 51, 51, 5]
    with pytest.raises(ValueError):
        balance_micro_batches([1, 2, 3], 2)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=64), st.integers(1, 8))
def test_balance_micro_batches_property(lengths, micro_batch):
    lengths = lengths[: len(lengths) - len(lengths) % micro_batch] or [0] * micro_batch
    mbs = balance_micro_batches(lengths, micro_batch)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
    assert all(len(mb) == micro_batch for mb in mbs)
    sums = token_sums(lengths, mbs)
    # greedy bound: the heaviest micro-batch exceeds the mean by at most one row's length
    assert max(sums) <= sum(lengths) / len(mbs) + max(lengths)


# --------------------------------------------------------------------------- properties
class StoreMachine(RuleBasedStateMachine):
    """Random interleavings of add/write/get/ack/release/expire/drop by 3 replicas of 2 tasks.

    Invariants: no row is held by two live leases of one task; in the end every row that became
    ready (and was not dropped) reached each task exactly once.
    """

    TASKS = {"score": ["resp"], "train": ["resp", "rew"]}

    @initialize()
    def setup(self):
        self.clock = Clock()
        self.s = SampleStore(lease_s=5.0, clock=self.clock)
        for t, inputs in self.TASKS.items():
            self.s.register_task(t, inputs)
        self.n = 0
        self.written: dict[str, set[int]] = {"resp": set(), "rew": set()}
        self.live: dict[int, Lease] = {}  # lease id -> lease, as the holders believe
        self.dead: list[Lease] = []  # expired or released leases a slow holder may still ack
        self.dropped: set[int] = set()
        self.consumed: dict[str, list[int]] = {t: [] for t in self.TASKS}

    @rule(groups=st.integers(1, 3), size=st.integers(1, 3), with_resp=st.booleans())
    def add(self, groups, size, with_resp):
        k = groups * size
        cols = {"resp": [f"r{self.n + i}" for i in range(k)]} if with_resp else {}
        rows = self.s.add_rows(cols, [self.n + i // size for i in range(k)])
        assert rows == list(range(self.n, self.n + k))
        if with_resp:
            self.written["resp"].update(rows)
        self.n += k

    @precondition(lambda self: self.n > 0)
    @rule(field=st.sampled_from(["resp", "rew"]), data=st.data())
    def write(self, field, data):
        missing = sorted(set(range(self.n)) - self.written[field])
        if not missing:
            return
        rows = data.draw(st.lists(st.sampled_from(missing), min_size=1, max_size=4, unique=True))
        self.s.write(rows, {field: [0] * len(rows)})
        self.written[field].update(rows)

    @rule(task=st.sampled_from(sorted(TASKS)), n=st.integers(1, 5), groups=st.booleans())
    def get(self, task, n, groups):
        lease = self.s.get(task, n, whole_groups=groups, group_size=1)
        if lease is None:
            return
        assert lease.rows == sorted(lease.rows) and len(lease.rows) <= n
        ready = set.intersection(*(self.written[f] for f in self.TASKS[task]))
        assert set(lease.rows) <= ready - self.dropped - set(self.consumed[task])
        self.live[lease.id] = lease

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def ack(self, data):
        lid = data.draw(st.sampled_from(sorted(self.live)))
        lease = self.live.pop(lid)
        assert self.s.ack(lid)
        self.consumed[lease.task].extend(lease.rows)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        lid = data.draw(st.sampled_from(sorted(self.live)))
        self.dead.append(self.live.pop(lid))
        assert self.s.release(lid)

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def stale_ack(self, data):
        lease = data.draw(st.sampled_from(self.dead))
        assert not self.s.ack(lease.id)

    @rule(dt=st.floats(0.5, 8.0))
    def tick(self, dt):
        self.clock.now += dt
        expired = [lid for lid, l in self.live.items() if l.deadline <= self.clock.now]
        assert self.s.expire() == len(expired)
        for lid in expired:
            self.dead.append(self.live.pop(lid))

    @precondition(lambda self: self.n > 0)
    @rule(data=st.data())
    def drop(self, data):
        rows = data.draw(st.lists(st.integers(0, self.n - 1), max_size=3))
        self.s.drop(rows, "stale")
        self.dropped.update(rows)

    @invariant()
    def exclusive(self):
        if not hasattr(self, "s"):
            return
        for task in self.TASKS:
            held = [r for l in self.live.values() if l.task == task for r in l.rows]
            assert len(held) == len(set(held))
            assert not set(held) & set(self.consumed[task])
            assert self.s.stats()["tasks"][task]["leased"] == len(held)

    def teardown(self):
        if not hasattr(self, "s"):
            return
        # finish every write, let leases lapse, drain every task
        for field, done in self.written.items():
            missing = sorted(set(range(self.n)) - done)
            if missing:
                self.s.write(missing, {field: [0] * len(missing)})
        self.clock.now += 100.0
        for task in self.TASKS:
            while (lease := self.s.get(task, 7)) is not None:
                assert self.s.ack(lease.id)
                self.consumed[task].extend(lease.rows)
            want = sorted(set(range(self.n)) - self.dropped)
            got = self.s.consumed(task)
            assert len(got) == len(set(got)), "a row was consumed twice"
            assert sorted(set(got) - self.dropped) == want, "a row was lost"
            assert sorted(got) == sorted(self.consumed[task])


StoreMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestStoreMachine = StoreMachine.TestCase
