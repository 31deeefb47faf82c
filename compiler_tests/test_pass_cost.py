"""The cost pass (asyncflow/compiler/passes/cost.py) and asyncflow.costmodel; rule numbers from
the cost pass's docstring.

    prompts -> gen (sim, latency, slots) -> score -> adv(grpo) -> train (sim, s/sample)
    train ..sync a..> gen
"""
import math
import random

import pytest
import yaml

from asyncflow.compiler import compile_text
from asyncflow.costmodel import Distribution, SpecError, expected_makespan
from asyncflow.errors import UserError


def sim(alpha=2, latency=None, slots=16, replicas=1, train_s=0.005, cost=None):
    d = {
        "pipeline": "s",
        "models": {"policy": {"init": "asyncflow.models:tiny_decoder"}},
        "data": {"prompts": {"source": "asyncflow.datasets:digits", "fields": ["prompt", "answer"]}},
        "pools": {"rollout": {"devices": replicas}, "train": {"devices": 1}},
        "step": {"prompts_per_step": 8, "samples_per_prompt": 4, "steps": 20},
        "tasks": {
            "gen": {"kind": "rollout", "engine": "sim", "model": "policy", "pool": "rollout",
                    "replicas": replicas, "inputs": ["prompt"], "outputs": ["response", "logprobs"],
                    "args": {"slots": slots, "latency": latency if latency is not None else
                             {"dist": "lognormal", "median": 0.05, "sigma": 1.0, "max": 1.0, "seed": 5}}},
            "score": {"kind": "reward", "fn": "asyncflow.rewards:digits_match",
                      "inputs": ["prompt", "answer", "response"], "outputs": ["reward"]},
            "adv": {"kind": "advantage", "estimator": "grpo", "inputs": ["reward"], "outputs": ["advantages"]},
            "train": {"kind": "train", "engine": "sim", "model": "policy", "pool": "train", "loss": "grpo",
                      "inputs": ["prompt", "response", "logprobs", "advantages"],
                      "args": {"seconds_per_sample": train_s, "micro_batch": 8}},
        },
        "sync": [{"from": "train", "to": "gen", "max_staleness": alpha}],
    }
    if cost is not None:
        d["tasks"]["score"]["cost"] = cost
    return compile_text(yaml.safe_dump(d, sort_keys=False), "s.yaml").estimate


# -- the distributions ---------------------------------------------------------------------
@pytest.mark.parametrize("spec", [
    0.1, {"dist": "constant", "value": 0.1}, {"dist": "uniform", "min": 0.0, "max": 1.0},
    {"dist": "lognormal", "median": 0.05, "sigma": 1.0, "max": 1.0, "seed": 5},
    {"dist": "lognormal", "median": 0.05, "sigma": 0.5},
    {"dist": "pareto", "scale": 0.01, "alpha": 1.5, "max": 2.0},
    {"dist": "pareto", "scale": 0.01, "alpha": 0.8, "max": 2.0},
])
def test_mean_and_expected_max_match_sampling(spec):
    d = Distribution.from_spec(spec)
    rng = random.Random(0)
    xs = [d.sample(rng) for _ in range(40_000)]
    assert math.isclose(d.mean(), sum(xs) / len(xs), rel_tol=0.05, abs_tol=1e-9)
    k = 16
    maxes = [max(d.sample(rng) for _ in range(k)) for _ in range(4000)]
    assert math.isclose(d.expected_max(k), sum(maxes) / len(maxes), rel_tol=0.05, abs_tol=1e-9)
    assert d.expected_max(k) >= d.mean() - 1e-12
    assert d.quantile(0.5) == pytest.approx(sorted(xs)[len(xs) // 2], rel=0.05, abs=1e-9)


def test_sampling_is_seeded():
    d = Distribution.from_spec({"dist": "lognormal", "median": 0.05, "sigma": 1.0, "seed": 7})
    a, b = d.rng(), d.rng()
    assert [d.sample(a) for _ in range(5)] == [d.sample(b) for _ in range(5)]
    assert d.seed == 7 and d.expected_max(8) == d.expected_max(8)


@pytest.mark.parametrize("spec,key", [
    ({"dist": "gamma"}, "dist"), ({"dist": "lognormal", "sigma": 1}, None),
    ({"dist": "pareto", "scale": 1, "alpha": 1}, "alpha"), ({"dist": "uniform", "min": 2, "max": 1}, "min"),
    ({"dist": "constant", "value": 1, "mean": 2}, "mean"), (-1, None), ("fast", None),
])
def test_bad_specs(spec, key):
    with pytest.raises(SpecError) as e:
        Distribution.from_spec(spec)
    assert e.value.key == key


def test_makespan_waves():
    d = Distribution.from_spec({"dist": "uniform", "min": 0, "max": 1})
    assert expected_makespan(d, 32, 16) == pytest.approx(2 * 16 / 17)
    assert expected_makespan(d, 20, 16) == pytest.approx(16 / 17 + 4 / 5)


# -- the estimate ----------------------------------------------------------------------------
def test_constant_latency_sync_equals_async_when_train_bound():
    """Rules 1, 2, 5, 6: constant latency has no tail; the busiest pool bounds both."""
    e = sim(latency=0.01, slots=32, train_s=0.01)
    # 32 samples: rollout 0.01 s (one wave), train 0.32 s
    assert e.step_time == pytest.approx(0.32)
    assert e.step_time_sync == pytest.approx(0.33)  # longest path: gen then train
    assert e.ideal_step_time == pytest.approx(0.32)
    assert e.bottleneck == "pool train"


def test_long_tail_async_beats_sync_rules_5_6_7():
    """A lognormal tail: the synchronous step waits for the slowest sample, the async one not."""
    e = sim(alpha=2)
    assert e.step_time < e.step_time_sync
    assert e.speedup == pytest.approx(e.step_time_sync / e.step_time, rel=1e-5)
    assert e.samples_per_s == pytest.approx(32 / e.step_time, rel=1e-5)
    assert e.per_task["train"] == pytest.approx(0.16)


def test_staleness_zero_plan_is_its_sync_form_rule_6():
    e = sim(alpha=0)
    assert e.step_time == e.step_time_sync and e.speedup == 1.0


def test_smaller_alpha_exposes_more_tail_rule_6():
    lat = {"dist": "pareto", "scale": 0.01, "alpha": 1.1, "max": 5.0, "seed": 1}
    assert sim(alpha=1, latency=lat).step_time > sim(alpha=8, latency=lat).step_time


def test_cost_key_on_a_fn_task_rule_1():
    """`cost:` hints on a per-sample reward fn: one call per row."""
    e = sim(cost={"seconds_per_call": 0.001})
    assert e.per_task["score"] == pytest.approx(0.032)


def test_no_hints_is_zero_with_notes():
    e = compile_text(yaml.safe_dump(yaml.safe_load(
        __import__("asyncflow.diagnostics.examples", fromlist=["BASE"]).BASE)), "b.yaml").estimate
    assert e.step_time == 0 and e.speedup == 1.0 and len(e.notes) == 5


def test_estimate_is_deterministic():
    assert sim() == sim()


def test_bad_hints_are_located_errors():
    with pytest.raises(UserError) as e:
        sim(cost={"latency": {"dist": "gamma", "shape": 2}})  # (args.latency: validate's AF362)
    assert [d.code for d in e.value.diagnostics] == ["AF403"]
    with pytest.raises(UserError) as e:
        sim(cost={"seconds_per_sampel": 1})
    assert [d.code for d in e.value.diagnostics] == ["AF404"]
    assert "seconds_per_sample" in (e.value.diagnostics[0].hint or "")
