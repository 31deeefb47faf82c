"""The sim engine (docs/language.md, "The sim engine"): deterministic latencies, slot makespan,
streaming in completion order, distributions, well-formed outputs, versions and weights."""
import statistics
import threading
import time

import pytest

from asyncflow.engines.base import EngineSpec, Rollout, Scorer, Trainer, load_engine_class
from asyncflow.engines.sim import SimEngine, slot_schedule
from asyncflow.tokens import Text

SCALE = 0.02  # a modelled second lasts 20 ms


def spec(kind="rollout", outputs=("response", "logprobs"), seed=0, **args):
    return EngineSpec(task="t", kind=kind, model={"name": "policy"}, args=args,
                      inputs=("prompt",), outputs=tuple(outputs), seed=seed)


def batch(rows, **cols):
    return {"prompt": [f"{r}+1=" for r in rows], "_row": list(rows), **cols}


def timed(fn, *a):
    t = time.monotonic()
    out = fn(*a)
    return out, time.monotonic() - t


def test_registered_and_implements_the_protocols():
    assert load_engine_class("sim") is SimEngine
    e = SimEngine(spec())
    assert isinstance(e, Rollout) and isinstance(e, Scorer) and isinstance(e, Trainer)


def test_slot_schedule_makespan():
    assert slot_schedule([1, 1, 1, 1], 2)[-1][0] == 2
    assert slot_schedule([1, 1, 1, 1], 4)[-1][0] == 1
    assert slot_schedule([1, 1, 1, 1], 1)[-1][0] == 4
    # a freed slot takes the next row at once: 3 then (1, 1, 1) on the other slot
    assert slot_schedule([3, 1, 1, 1], 2)[-1][0] == 3
    assert slot_schedule([3, 1, 2], 2) == [(1, 1), (3, 0), (3, 2)]  # ties: batch order
    assert slot_schedule([], 4) == []


def test_generate_sleeps_the_makespan():
    e = SimEngine(spec(slots=2, latency=1.0, time_scale=SCALE))
    _, dt = timed(e.generate, batch(range(4)))
    assert 2 * SCALE * 0.9 <= dt < 2 * SCALE + 0.2  # loose: a busy CI machine
    e = SimEngine(spec(slots=4, latency=1.0, time_scale=0.1))
    _, dt = timed(e.generate, batch(range(4)))
    assert 0.09 <= dt < 0.18  # 4 slots: one wave, not two


def test_latency_depends_on_seed_and_row_only():
    lat = {"dist": "lognormal", "median": 1.0, "sigma": 1.0, "seed": 7}
    a = SimEngine(spec(latency=lat))
    b = EngineSpec(task="other", kind="rollout", model={}, args={"latency": lat}, replica=3,
                   replicas=4, seed=99)
    b = SimEngine(b)
    assert [a.latency_of(r) for r in range(20)] == [b.latency_of(r) for r in range(20)]
    # call order and batch composition do not matter
    s1 = dict((i, t) for t, i in a.schedule({"_row": [5]}))
    assert s1[0] == a.latency_of(5)
    c = SimEngine(spec(latency={**lat, "seed": 8}))
    assert [a.latency_of(r) for r in range(20)] != [c.latency_of(r) for r in range(20)]


def test_outputs_deterministic_and_well_formed():
    e = SimEngine(spec(outputs=("response", "logprobs", "values", "score"), latency=0.0))
    out = e.generate(batch([3, 1, 2]))
    again = SimEngine(spec(outputs=("response", "logprobs", "values", "score"), latency=0.0))
    other_order = again.generate(batch([2, 3, 1]))
    assert out["response"][0] == other_order["response"][1]
    assert out["logprobs"][0] == other_order["logprobs"][1]
    for resp, lp, vals, score in zip(out["response"], out["logprobs"], out["values"], out["score"]):
        assert isinstance(resp, Text) and len(resp.ids) == 8 and resp.prompt_ids
        assert str(resp).isdigit() and len(resp) == 8
        assert len(lp) == len(resp.ids) and all(x < 0 for x in lp)
        assert len(vals) == len(resp.ids) and all(-1 <= x <= 1 for x in vals)
        assert isinstance(score, float)


def test_response_tokens_distribution():
    e = SimEngine(spec(latency=0.0, response_tokens={"dist": "uniform", "min": 2, "max": 20}))
    out = e.generate(batch(range(30)))
    lengths = {len(t.ids) for t in out["response"]}
    assert len(lengths) > 3 and min(lengths) >= 2 and max(lengths) <= 20
    assert all(len(lp) == len(t.ids) for t, lp in zip(out["response"], out["logprobs"]))


def test_stream_in_completion_order():
    lat = {"dist": "uniform", "min": 0.1, "max": 1.0, "seed": 3}
    e = SimEngine(spec(slots=3, latency=lat, time_scale=SCALE))
    b = batch(range(8))
    expected = [i for _, i in e.schedule(b)]
    seen, stamps = [], []
    t0 = time.monotonic()
    cols = e.generate_stream(b, lambda i, out: (seen.append(i), stamps.append(time.monotonic())))
    assert seen == expected and sorted(seen) == list(range(8))
    assert stamps == sorted(stamps)
    makespan = e.schedule(b)[-1][0]
    assert stamps[-1] - t0 >= makespan * SCALE * 0.9
    assert cols == SimEngine(spec(slots=3, latency=lat, time_scale=0.0)).generate(b)
    # the iterator form gives the same pairs
    it = [(i, out["response"]) for i, out in e.generate_iter(b)]
    assert [i for i, _ in it] == expected
    assert [r for _, r in it] == [cols["response"][i] for i in expected]


def test_serve_fills_freed_slots():
    e = SimEngine(spec(slots=2, latency=1.0, time_scale=SCALE))
    pending = list(range(6))
    asked, done = [], []

    def pull(k):
        if not pending:
            return None
        take = [pending.pop(0) for _ in range(min(k, len(pending)))]
        asked.append(len(take))
        return {"_row": take, "_group": [r // 2 for r in take], "prompt": ["p"] * len(take)}

    _, dt = timed(e.serve, pull, done.append)
    assert sorted(d["_row"] for d in done) == list(range(6))
    assert max(asked) <= 2
    assert all(d["_version"] == 0 and d["_group"] == d["_row"] // 2 for d in done)
    assert isinstance(done[0]["response"], Text)
    assert 3 * SCALE * 0.9 <= dt < 3 * SCALE + 0.2  # 6 rows, 2 slots, 1 s each


def test_serve_version_is_the_one_at_start():
    e = SimEngine(spec(slots=1, latency=1.0, time_scale=SCALE))
    pending, done = [0, 1], []

    def pull(k):
        if not pending:
            return None
        if pending[0] == 1:
            e.update_weights({"version": 1}, 1)
        return {"_row": [pending.pop(0)]}

    e.serve(pull, done.append)
    assert [d["_version"] for d in done] == [0, 1]


def latencies(spec_, n=4000):
    e = SimEngine(spec(latency=spec_))
    return e, [e.latency_of(r) for r in range(n)]


@pytest.mark.parametrize("spec_, median, mean", [
    ({"dist": "constant", "value": 0.3}, 0.3, 0.3),
    ({"dist": "uniform", "min": 1.0, "max": 3.0}, 2.0, 2.0),
    ({"dist": "lognormal", "median": 0.5, "sigma": 0.5}, 0.5, 0.5 * 2.718281828 ** 0.125),
    ({"dist": "pareto", "scale": 1.0, "alpha": 3.0}, 2 ** (1 / 3), 1.5),
])
def test_distribution_empirical_median_and_mean(spec_, median, mean):
    e, xs = latencies({**spec_, "seed": 1})
    assert statistics.median(xs) == pytest.approx(median, rel=0.05)
    assert statistics.fmean(xs) == pytest.approx(mean, rel=0.06)
    assert e.latency.mean() == pytest.approx(mean, rel=1e-6)


@pytest.mark.parametrize("spec_", [
    {"dist": "lognormal", "median": 1.0, "sigma": 2.0, "max": 4.0},
    {"dist": "pareto", "scale": 1.0, "alpha": 1.1, "max": 4.0},
])
def test_max_clamps(spec_):
    e, xs = latencies(spec_)
    assert max(xs) == 4.0 and sum(x == 4.0 for x in xs) > 50
    assert statistics.fmean(xs) == pytest.approx(e.latency.mean(), rel=0.06)


def test_slow_tail_dominates_a_synchronous_batch():
    # 64 samples through 64 slots: the call lasts the slowest sample, not the mean one
    e, xs = latencies({"dist": "lognormal", "median": 0.05, "sigma": 1.0, "max": 1.0, "seed": 5},
                      64)
    assert e.schedule({"_row": list(range(64))})[-1][0] == max(xs) > 3 * statistics.fmean(xs)


@pytest.mark.parametrize("bad", [
    {"dist": "lognormal", "sigma": 1.0}, {"dist": "gamma", "k": 1}, -1, "fast",
    {"dist": "uniform", "min": 2, "max": 1}, {"dist": "pareto", "scale": 1, "alpha": 0},
])
def test_bad_latency_is_rejected(bad):
    with pytest.raises(ValueError):
        SimEngine(spec(latency=bad))


def test_scorer_logprobs_fit_the_response():
    roll = SimEngine(spec(latency=0.0, response_tokens={"dist": "uniform", "min": 2, "max": 12}))
    gen = roll.generate(batch(range(5)))
    ref = SimEngine(spec(kind="logprob", outputs=("ref_logprobs",), seconds_per_sample=1.0,
                         time_scale=SCALE / 5))
    (out, dt) = timed(ref.logprobs, {**batch(range(5)), "response": gen["response"]})
    assert dt >= SCALE * 0.9
    assert list(out) == ["ref_logprobs"]
    assert [len(x) for x in out["ref_logprobs"]] == [len(t.ids) for t in gen["response"]]
    assert all(x < 0 for lp in out["ref_logprobs"] for x in lp)
    critic = SimEngine(spec(kind="value", outputs=("values",), seconds_per_sample=0.0))
    vals = critic.logprobs({**batch(range(5)), "response": gen["response"]})["values"]
    assert all(-1 <= x <= 1 for v in vals for x in v)


def test_trainer_versions_weights_and_checkpoint(tmp_path):
    tr = SimEngine(spec(kind="train", outputs=(), seconds_per_sample=1.0, time_scale=SCALE / 4))
    metrics, dt = timed(tr.train_step, batch(range(4), advantages=[0.0] * 4))
    assert dt >= SCALE * 0.9
    assert metrics["samples"] == 4 and isinstance(metrics["loss"], float) and tr.version == 1
    w = tr.export_weights()
    assert w["version"] == 1 and isinstance(w["fingerprint"], str)
    tr.train_step(batch(range(2)))
    assert tr.export_weights()["fingerprint"] != w["fingerprint"]
    tr.save(str(tmp_path))
    fresh = SimEngine(spec(kind="train", outputs=()))
    fresh.load(str(tmp_path))
    assert fresh.version == 2 and fresh.export_weights() == tr.export_weights()

    roll = SimEngine(spec(sync_seconds=1.0, time_scale=SCALE))
    _, dt = timed(roll.update_weights, w, 1)
    assert roll.version == 1 and roll.adopted == [1] and roll.weights == w and dt >= SCALE * 0.9


def test_default_train_seconds_per_sample():
    assert SimEngine(spec(kind="train")).seconds_per_sample == 0.005


def test_generate_is_thread_safe():
    e = SimEngine(spec(slots=1, latency=1.0, time_scale=0.1))
    results = {}

    def run(r):
        results[r] = e.generate(batch([r]))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
    t = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert time.monotonic() - t < 0.3  # concurrent calls overlap (serial: 0.4 s)
    assert results[2]["response"][0] == e.generate(batch([2]))["response"][0]
