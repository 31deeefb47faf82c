"""The runtime on a local Ray (one actor per worker, RayStore, placement groups), sim engine."""
from __future__ import annotations

import pytest

from asyncflow.runtime.ray_connect import local_worker_priority

ray = pytest.importorskip("ray")

from asyncflow.runtime.driver import Driver  # noqa: E402

from test_runtime_props import SPS, check_exactly_once, check_train_steps, make_plan  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    if not ray.is_initialized():
        with local_worker_priority():  # the workers' niceness, as asyncflow's own
            ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("alpha,replicas", [(0, 2), (1, 2), (2, 3)])
def test_ray_exactly_once_and_staleness(alpha, replicas, tmp_path):
    r = Driver(make_plan(alpha, replicas, 11), "ray", out_dir=str(tmp_path)).run()
    assert len(r.metrics) == 4
    check_exactly_once(r, 4 * SPS)
    check_train_steps(r, alpha)
    if alpha == 0:
        assert all(m["staleness_max"] == 0 for m in r.metrics)
    assert (tmp_path / "trace.json").exists() and (tmp_path / "metrics.jsonl").exists()


def test_ray_alpha0_matches_local():
    keys = ("step", "version", "samples", "reward_mean", "reward_std", "loss")
    a = Driver(make_plan(0, 2, 3), "ray").run()
    b = Driver(make_plan(0, 1, 3), "local").run()
    sps = a.metrics[0]["samples"]  # each step the same rows (acked in the order they were ready)
    per = [sorted(x.consumed["update"][n * sps:(n + 1) * sps]) for x in (a, b)
           for n in range(len(x.metrics))]
    assert per[:len(a.metrics)] == per[len(a.metrics):]
    assert [{k: m[k] for k in keys} for m in a.metrics] == [{k: m[k] for k in keys} for m in b.metrics]


def test_ray_killing_a_rollout_actor_loses_nothing():
    plan = make_plan(2, 2, 7, steps=5)
    d = Driver(plan, "ray", lease_s=0.5)
    d.on_step = lambda m: d.kill("generate/0") if m["step"] == 0 else None
    r = d.run()
    assert r.workers["generate/0"]["status"] == "crashed"
    assert len(r.metrics) == 5
    check_exactly_once(r, 5 * SPS)
    check_train_steps(r, 2)


def test_ray_workers_of_one_process_share_it_and_die_together():
    """Placement rule 6 on Ray: score/0 and advantage/0 (pool-less) run in one process, cpu:0;
    killing score/0 kills that process, so both restart (into one new process) and nothing is
    lost; the other workers are untouched."""
    plan = make_plan(1, 1, 7, steps=5)
    procs = {w.id: w.process for w in plan.workers}
    assert procs["score/0"] == procs["advantage/0"] == "cpu:0"
    assert len({procs["generate/0"], procs["update/0"], "cpu:0"}) == 3
    d = Driver(plan, "ray", lease_s=0.5, max_restarts=3)
    d.on_step = lambda m: d.kill("score/0") if m["step"] == 0 else None
    r = d.run()
    w = r.workers
    assert w["score/0"]["restarts"] == 1 and w["advantage/0"]["restarts"] == 1
    assert w["generate/0"]["restarts"] == 0 and w["update/0"]["restarts"] == 0
    assert w["score/0"]["pid"] == w["advantage/0"]["pid"]
    assert len({w["score/0"]["pid"], w["generate/0"]["pid"], w["update/0"]["pid"]}) == 3
    assert len(r.metrics) == 5
    check_exactly_once(r, 5 * SPS)
    check_train_steps(r, 1)


def test_ray_share_process_false_gives_each_worker_a_process():
    """Two tasks time-sharing the train pool's device: one process by default, two with the
    pool's ``share_process: false``."""
    from test_runtime_props import PIPELINE, PPS, SPP

    from asyncflow.compiler import compile_text

    text = PIPELINE.format(alpha=1, replicas=1, seed=3, pps=PPS, spp=SPP, steps=3,
                           score_replicas=1)
    text = text.replace("    fn: asyncflow.rewards:digits_match\n",
                        "    fn: asyncflow.rewards:digits_match\n    pool: train\n")
    pids = {}
    for share in (True, False):
        t = text.replace("train: {devices: 1}",
                         f"train: {{devices: 1, share_process: {str(share).lower()}}}")
        plan = compile_text(t, "share.yaml")
        r = Driver(plan, "ray").run()
        assert len(r.metrics) == 3
        check_exactly_once(r, 3 * SPS)
        pids[share] = (r.workers["score/0"]["pid"], r.workers["update/0"]["pid"])
    assert pids[True][0] == pids[True][1]
    assert pids[False][0] != pids[False][1]


def test_ray_a_thread_death_restarts_beside_live_workers_and_fresh_when_alone():
    """A worker whose thread dies (MemoryError) while its process lives: score/0 restarts in
    cpu:0 beside advantage/0 (same pid); generate/0, alone in rollout:0, gets a new process."""
    plan = make_plan(1, 1, 9, steps=6)
    d = Driver(plan, "ray", lease_s=0.5, max_restarts=3,
               inject=["oom@step3:score/0", "oom@step3:generate/0"])
    pids0: dict = {}
    d.on_step = lambda m: pids0.update(
        {w: b["where"]["pid"] for w, b in d.control.beats().items() if b.get("where")}
    ) if m["step"] == 0 else None
    r = d.run()
    w = r.workers
    assert w["score/0"]["restarts"] == 1 and w["generate/0"]["restarts"] == 1
    assert w["advantage/0"]["restarts"] == 0 and w["update/0"]["restarts"] == 0
    assert pids0["score/0"] == pids0["advantage/0"] == w["score/0"]["pid"] == w["advantage/0"]["pid"]
    assert w["generate/0"]["pid"] != pids0["generate/0"]
    assert len(r.metrics) == 6
    check_exactly_once(r, 6 * SPS)
    check_train_steps(r, 1)
