"""A trainer's reads at fine grain (issue 24): a step of many small micro-batches costs a store
round trip per batch of ready micro-batches, not one per micro-batch.

- the plan says how many micro-batches one read may take (``Op.per_read``, lower rule 1: a
  whole step's) and the runtime's step reads take up to that many in one ``get_split`` (never
  more, never re-derived);
- ``RayStore.get_split`` on one shard is one actor call whose leases' columns (lists, numpy,
  :class:`Ragged`) are assembled once and cut lease by lease;
- ``RayStore.ack_many`` is one actor call per shard holding a part of any of the leases, with
  the answers and the stale-ack count of the in-process store's ``ack_many``.
"""
from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest

from asyncflow.compiler.pipeline import compile_file
from asyncflow.runtime.driver import Driver
from asyncflow.runtime.store import SampleStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONGTAIL = os.path.join(ROOT, "pipelines", "sim_longtail.yaml")
PROMPTS, MICRO = 16, 4  # 64 samples a step: 16 micro-batches


def longtail_plan(steps: int = 2):
    return compile_file(LONGTAIL, [
        f"step.prompts_per_step={PROMPTS}", f"step.steps={steps}",
        "tasks.generate.args.latency=0.001", "tasks.generate.args.slots=64",
        "tasks.update.args.seconds_per_sample=0.0001", f"tasks.update.args.micro_batch={MICRO}"],
        backend="local")


def train_reads(plan):
    return [o for w in plan.workers if w.loop == "train" for o in w.ops if o.kind == "READ"]


# ---------------------------------------------------------------------- the plan's number
def test_plan_says_how_many_micro_batches_a_read_takes():
    plan = longtail_plan()
    sps = plan.step.samples_per_step
    reads = train_reads(plan)
    assert reads and all(o.granularity == "micro_batch" and o.rows == MICRO for o in reads)
    # a whole step's micro-batches: every one that is ready comes in one store read
    assert {o.per_read for o in reads} == {math.ceil(sps / MICRO)}
    others = [o for w in plan.workers if w.loop != "train" for o in w.ops if o.kind == "READ"]
    assert others and {o.per_read for o in others} == {0}  # not a micro-batch read
    step = compile_file(LONGTAIL, ["tasks.update.args.micro_batch=128"], backend="local")
    assert {o.granularity for o in train_reads(step)} == {"step"}
    assert {o.per_read for o in train_reads(step)} == {0}


def with_per_read(plan, k: int):
    """``plan`` with every micro-batch READ's ``per_read`` set to ``k`` (and an in_order
    read-ahead, ``ahead``, to the first read it stands for: ``rows`` x ``k``)."""
    workers = [dataclasses.replace(w, ops=[
        dataclasses.replace(o, per_read=k, ahead=o.rows * k if o.ahead else 0)
        if o.granularity == "micro_batch" else o
        for o in w.ops]) for w in plan.workers]
    return dataclasses.replace(plan, workers=workers)


@pytest.mark.parametrize("per_read", [None, 1, 3])
def test_trainer_reads_as_many_micro_batches_as_the_plan_lets_it(monkeypatch, tmp_path, per_read):
    """The runtime's step reads ask the store for at most ``rows * per_read`` rows a call, as
    micro-batch leases of ``rows``: the plan's number, whatever it is; every row trained once."""
    plan = longtail_plan()
    if per_read is not None:
        plan = with_per_read(plan, per_read)
    k = train_reads(plan)[0].per_read
    calls: list[tuple[int, int, list[int]]] = []  # the trainer's reads: (n, split, leased)
    real_split, real_get = SampleStore.get_split, SampleStore.get

    def get_split(self, task, n, split, **kw):
        got = real_split(self, task, n, split, **kw)
        if task == "update":
            calls.append((n, split, [len(x.rows) for x in got]))
        return got

    def get(self, task, n, **kw):
        got = real_get(self, task, n, **kw)
        if task == "update":
            calls.append((n, n, [len(got.rows)] if got is not None else []))
        return got

    monkeypatch.setattr(SampleStore, "get_split", get_split)
    monkeypatch.setattr(SampleStore, "get", get)
    r = Driver(plan, "local", out_dir=str(tmp_path)).run()
    sps = plan.step.samples_per_step
    assert r.samples == 2 * sps
    assert calls and all(split == MICRO and n <= MICRO * k for n, split, _ in calls)
    leased = [m for _, _, sizes in calls for m in sizes]
    assert sum(leased) == 2 * sps and set(leased) == {MICRO}
    if k == 1:  # one micro-batch a read: a round trip each
        assert sum(1 for *_, sizes in calls if sizes) == 2 * sps // MICRO
    else:  # several in one read when they are ready (the whole step, the plan's default)
        assert max(len(sizes) for *_, sizes in calls) > 1
        assert all(len(sizes) <= k for *_, sizes in calls)


# ---------------------------------------------------------------------- the Ray store
ray = pytest.importorskip("ray")
from asyncflow.runtime.store.codec import Ragged  # noqa: E402
from asyncflow.runtime.store.ray import RayStore  # noqa: E402
from shared_runs import ray_session  # noqa: E402,F401  (a fixture: Ray for this module)


class CallCount:
    """A shard handle that counts its calls by method name (and passes them on)."""

    def __init__(self, handle, counts: dict):
        self.handle, self.counts = handle, counts

    def __getattr__(self, name):
        method = getattr(self.handle, name)
        counts = self.counts

        class Counted:
            def remote(self, *a, **k):
                counts[name] = counts.get(name, 0) + 1
                return method.remote(*a, **k)

        return Counted()


def counted(store: RayStore) -> tuple[RayStore, dict]:
    """A handle on ``store``'s shards whose calls are counted (as the contract suite's spy:
    the proxies replace the handle's list of shard handles, never sent to a shard)."""
    counts: dict = {}
    s = RayStore(shards=store.shards, lease_s=store.lease_s, chunk=store.chunk,
                 _handles=[store.shard_handle(i) for i in range(store.shards)])
    s._shards = [CallCount(h, counts) for h in s._shards]
    return s, counts


def fill(store, groups: int, size: int = 4) -> list[int]:
    n = groups * size
    return store.add_rows({
        "response": [f"r{i}" for i in range(n)],
        "logprobs": np.arange(n, dtype=np.float32) / 2,
        "ids": Ragged.from_lists([[i] * (1 + i % 3) for i in range(n)]),
    }, [i // size for i in range(n)])


@pytest.mark.ray
@pytest.mark.parametrize("shards", [1, 2])
def test_ray_ack_many_is_one_call_per_shard_and_answers_as_the_local_store(ray_session, shards):
    base = RayStore(shards=shards, lease_s=30.0, chunk=8)
    try:
        ray_store, counts = counted(base)
        answers = {}
        for name, s in (("local", SampleStore(lease_s=30.0)), ("ray", ray_store)):
            s.register_task("update", ["response", "logprobs", "ids"])
            fill(s, 8)  # 32 rows: on 2 shards, rows 0-7 and 16-23 on one, 8-15 and 24-31 on the other
            leases = [s.get("update", 4) for _ in range(6)]
            wide = s.get("update", 8)  # a lease with a part on each shard (2 shards)
            assert s.ack(leases[0])
            counts.clear()
            got = s.ack_many([leases[0], *leases[1:], wide])  # the first: already acked
            if name == "ray":
                assert counts == {"ack_each": shards}  # one call a shard, not one a lease
            answers[name] = (got, s.stats()["stale_acks"], s.stats()["tasks"]["update"])
        assert answers["ray"] == answers["local"]
        assert answers["ray"][0] == [False] + [True] * 6 and answers["ray"][1] == 1
    finally:
        base.shutdown()


@pytest.mark.ray
def test_ray_get_split_assembles_columns_once_and_cuts_them_lease_by_lease(ray_session):
    base = RayStore(shards=1, lease_s=30.0, chunk=8)
    try:
        s, counts = counted(base)
        s.register_task("update", ["response", "logprobs", "ids"])
        rows = fill(s, 10)  # 40 rows, numpy and Ragged columns: a chunk in the object store
        local = SampleStore(lease_s=30.0)
        local.register_task("update", ["response", "logprobs", "ids"])
        fill(local, 10)
        counts.clear()
        got = s.get_split("update", 40, 16)
        assert counts == {"get_split": 1}
        want = local.get_split("update", 40, 16)
        assert [x.rows for x in got] == [x.rows for x in want] == [rows[:16], rows[16:32], rows[32:]]
        for g, w in zip(got, want):
            assert g.columns["_row"] == g.rows
            assert g.columns["response"] == w.columns["response"]
            assert isinstance(g.columns["logprobs"], np.ndarray)
            assert np.array_equal(g.columns["logprobs"], np.asarray(w.columns["logprobs"]))
            assert isinstance(g.columns["ids"], Ragged) and g.columns["ids"] == w.columns["ids"]
        assert len({x.id for x in got}) == 3
        assert s.ack(got[1])  # each lease ends on its own
        assert s.ack_many([got[0], got[2]]) == [True, True]
        assert s.stats()["tasks"]["update"]["consumed"] == 40
        assert s.get_split("update", 40, 16) == []
    finally:
        base.shutdown()
