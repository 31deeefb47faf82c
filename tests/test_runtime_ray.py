"""The runtime on a local Ray (one actor per worker, RayStore, placement groups), sim engine."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from asyncflow.runtime.driver import Driver  # noqa: E402

from test_runtime_props import SPS, check_exactly_once, check_train_steps, make_plan  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    if not ray.is_initialized():
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
