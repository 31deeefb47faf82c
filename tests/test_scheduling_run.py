"""The scheduling keys at run time (docs/language.md, "Scheduling keys"): consume: first_ready,
redundancy, refill, on_update, stream, schedule -- what each train step took, what was dropped
and why, and that no sample is lost or trained twice.

Every run reads ``train_rows.jsonl`` (the rows of each train step) and the store's counters:

- a row is trained at most once, and a dropped row never;
- every step trains exactly ``prompts_per_step`` whole groups where the keys promise it
  (first_ready, redundancy, refill);
- staleness never exceeds alpha;
- every drop is counted, by reason, equally in the store and in the run's result.
"""
from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow.compiler.pipeline import compile_file
from asyncflow.runtime.driver import Driver
from asyncflow.runtime.windows import Windows

HERE = os.path.dirname(os.path.abspath(__file__))
LONGTAIL = os.path.join(HERE, "..", "pipelines", "sim_longtail.yaml")

# a small long-tailed sim run: 4 prompts x 2 samples a step, one rollout replica
SMALL = ["tasks.generate.replicas=1", "pools.rollout.devices=1", "step.prompts_per_step=4",
         "step.samples_per_prompt=2", "tasks.generate.args.slots=6",
         "tasks.generate.args.time_scale=0.2", "tasks.update.args.time_scale=0.2",
         "tasks.update.args.micro_batch=4", "tasks.update.args.seconds_per_sample=0.01"]


@pytest.fixture(scope="module")
def module_ray():
    """One local Ray for this module's Ray runs (a run joins a Ray already up, and leaves it
    up: :func:`asyncflow.runtime.ray_connect.ensure_ray`), started as a run starts its own;
    stopped after the module. Each run still has its own actors, store and placement groups."""
    pytest.importorskip("ray")
    from asyncflow.runtime.ray_connect import ensure_ray

    ray, started = ensure_ray()
    yield ray
    if started:
        ray.shutdown()


def _latency(seed: int, sigma: float = 1.5, most: float = 1.0) -> str:
    return ("tasks.generate.args.latency={dist: lognormal, median: 0.05, sigma: %s, max: %s, "
            "seed: %d}" % (sigma, most, seed))


def _run(tmp_path, sets, backend="local", steps=6, path=LONGTAIL, name="run"):
    plan = compile_file(path, sets=list(sets) + [f"step.steps={steps}"])
    out = str(tmp_path / name)
    driver = Driver(plan, backend, out_dir=out)
    result = driver.run()
    with open(os.path.join(out, "train_rows.jsonl")) as f:
        steps_rows = [json.loads(line) for line in f]
    return plan, driver, result, steps_rows


def _check_invariants(plan, result, steps_rows, whole_steps: bool):
    st_ = plan.step
    spp, pps = st_.samples_per_prompt, st_.prompts_per_step
    alpha = plan.sync[0].max_staleness
    trained = [r for s in steps_rows for r in s["rows"]]
    assert len(trained) == len(set(trained)), "a row was trained twice"
    assert [s["step"] for s in steps_rows] == list(range(st_.steps))
    for s in steps_rows:
        groups = {r // spp for r in s["rows"]}
        assert all(r // spp in groups for r in s["rows"])
        if whole_steps:
            assert len(s["rows"]) == pps * spp, (s["step"], len(s["rows"]))
            assert sorted(s["rows"]) == sorted(g * spp + i for g in groups for i in range(spp))
    assert all(m["staleness_max"] is None or m["staleness_max"] <= alpha for m in result.metrics)
    # every drop is counted, the same in the store and in the run's result
    store_drops = dict(result.stats.get("drops", {}))
    for reason in ("staleness", "redundant"):
        assert store_drops.get(reason, 0) == result.dropped.get(reason, 0), (store_drops,
                                                                               result.dropped)
    return trained


def test_windows_in_order_without_keys_are_the_steps():
    w = Windows(samples_per_prompt=4, launch_groups=8)
    assert w.window(0) == (8, list(range(32)))
    assert w.window(8) == (16, list(range(32, 64)))


def test_windows_skip_replaced_groups_and_keep_the_rest():
    w = Windows(samples_per_prompt=2, launch_groups=3, replace=["filter"])
    w.note([2, 3], "filter")  # group 1 filtered out: replaced
    w.note([9], "regenerated")  # not a replaced reason: the row is simply not there
    g_end, rows = w.window(0)
    assert g_end == 4 and rows == [0, 1, 4, 5, 6, 7]
    assert w.window(4) == (7, [8, 10, 11, 12, 13])
    assert w.replaced_rows == 2


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(alpha=st.sampled_from([0, 1, 2]), seed=st.integers(0, 10_000),
       on_update=st.sampled_from(["finish", "continue", "abort"]))
def test_first_ready_trains_each_sample_once_within_alpha(tmp_path_factory, alpha, seed,
                                                          on_update):
    tmp = tmp_path_factory.mktemp("fr")
    plan, driver, result, steps_rows = _run(tmp, SMALL + [
        _latency(seed), f"sync.0.max_staleness={alpha}", "tasks.update.consume=first_ready",
        f"tasks.generate.on_update={on_update}"])
    assert plan.task("update").consume == "first_ready" and "staleness" in plan.step.replace
    trained = _check_invariants(plan, result, steps_rows, whole_steps=True)
    dropped = set(driver.store.snapshot()["dropped"])
    assert not dropped & set(trained), "a dropped row was trained"
    # what the trainer dropped is exactly what the store dropped as stale: each drop counted
    assert len(dropped) == sum(driver.store.snapshot()["drops"].values())


@pytest.mark.ray
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(alpha=st.sampled_from([1, 2]), seed=st.integers(0, 10_000))
def test_first_ready_on_ray(module_ray, tmp_path_factory, alpha, seed):
    tmp = tmp_path_factory.mktemp("fr_ray")
    plan, driver, result, steps_rows = _run(tmp, SMALL + [
        _latency(seed), f"sync.0.max_staleness={alpha}", "tasks.update.consume=first_ready",
        "tasks.generate.on_update=continue"], backend="ray", steps=5)
    trained = _check_invariants(plan, result, steps_rows, whole_steps=True)
    assert len(trained) == 5 * plan.step.samples_per_step


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_redundancy_trains_the_first_finished_groups_and_cancels_the_rest(request, tmp_path,
                                                                         backend):
    if backend == "ray":
        request.getfixturevalue("module_ray")
    plan, driver, result, steps_rows = _run(tmp_path, SMALL + [
        # a heavy tail (some samples 60x the median): the groups left behind are still in the
        # engine when a step's first groups finish, however late the cancel reaches it (Ray)
        _latency(7, sigma=2.5, most=3.0), "sync.0.max_staleness=1", "tasks.generate.redundancy=1.5",
        "tasks.generate.on_update=continue"], backend=backend)
    st_ = plan.step
    assert st_.launch_groups == 6
    _check_invariants(plan, result, steps_rows, whole_steps=True)
    # a step's groups come from its own window of 6 launched groups
    for s in steps_rows:
        assert {r // st_.samples_per_prompt // 6 for r in s["rows"]} == {s["step"]}
    cancelled = result.dropped.get("redundant", 0)
    # every step but possibly the last cancelled the 2 extra groups it did not need
    assert cancelled >= (st_.steps - 1) * 2 * st_.samples_per_prompt
    assert result.metrics[-1]["cancelled"] == cancelled
    # some cancelled samples were still in the engine: they left it without finishing
    gen = [w for w in result.workers.values() if w.get("task") == "generate"]
    assert sum(w.get("cancelled", 0) for w in gen) > 0, gen


FILTER = '''
def every_third_out(reward, groups):
    """Drops every third prompt's group (whatever the rewards)."""
    return [g % 3 != 0 for g in groups]
'''


def _filtered_pipeline(tmp_path, refill: bool) -> str:
    (tmp_path / "myfilters.py").write_text(FILTER)
    task = ("  keep:\n    kind: filter\n    fn: myfilters:every_third_out\n    batched: true\n"
            f"    refill: {str(refill).lower()}\n    inputs: [reward]\n    outputs: [kept]\n")
    text = open(LONGTAIL).read().replace("  advantage:\n", task + "  advantage:\n", 1)
    text = text.replace("    inputs: [reward]\n    outputs: [advantages]",
                        "    inputs: [reward, kept]\n    outputs: [advantages]", 1)
    path = tmp_path / "filtered.yaml"
    path.write_text(text)
    return str(path)


def test_refill_trains_prompts_per_step_groups_every_step(tmp_path):
    path = _filtered_pipeline(tmp_path, refill=True)
    plan, driver, result, steps_rows = _run(tmp_path, SMALL + [_latency(1),
                                                              "sync.0.max_staleness=1"],
                                            path=path)
    assert plan.task("keep").refill and plan.step.replace == ["filter"]
    trained = _check_invariants(plan, result, steps_rows, whole_steps=True)
    spp = plan.step.samples_per_prompt
    assert all((r // spp) % 3 != 0 for r in trained), "a filtered group was trained"
    last = result.metrics[-1]
    assert last["filtered"] > 0 and last["refilled"] > 0
    assert last["refilled"] * spp <= last["filtered"]


def test_without_refill_steps_train_fewer(tmp_path):
    path = _filtered_pipeline(tmp_path, refill=False)
    plan, driver, result, steps_rows = _run(tmp_path, SMALL + [_latency(1),
                                                              "sync.0.max_staleness=1"],
                                            path=path, steps=4)
    assert plan.step.replace == []
    spp, pps = plan.step.samples_per_prompt, plan.step.prompts_per_step
    for s in steps_rows:  # step n trains the groups of its own rows that were not filtered
        groups = range(s["step"] * pps, (s["step"] + 1) * pps)
        assert sorted(s["rows"]) == [g * spp + i for g in groups if g % 3 for i in range(spp)]
    assert result.metrics[-1]["refilled"] == 0


@pytest.mark.parametrize("on_update", ["finish", "continue", "abort"])
def test_on_update_what_happens_to_samples_in_flight(tmp_path, on_update):
    plan, driver, result, steps_rows = _run(tmp_path, SMALL + [
        _latency(11, sigma=1.0), "sync.0.max_staleness=2",
        f"tasks.generate.on_update={on_update}"], steps=5)
    _check_invariants(plan, result, steps_rows, whole_steps=True)
    gen = next(w for w in driver.backend.workers.values() if w.task.name == "generate")
    eng = gen.engine
    if on_update == "finish":  # new weights only when nothing is in flight
        assert eng.flight_at_update and not any(eng.flight_at_update), eng.flight_at_update
        assert eng.aborted == 0
    elif on_update == "continue":  # taken at once, the samples in flight keep their version
        assert any(eng.flight_at_update) and eng.aborted == 0
    else:  # taken at once, the samples in flight start again with the new version
        assert any(eng.flight_at_update) and eng.aborted == sum(eng.flight_at_update)
        assert result.metrics[-1]["aborted"] == eng.aborted


def test_schedule_batch_runs_whole_batches(tmp_path):
    plan, driver, result, steps_rows = _run(tmp_path, SMALL + [
        _latency(2), "sync.0.max_staleness=1", "tasks.generate.schedule=batch"], steps=4)
    _check_invariants(plan, result, steps_rows, whole_steps=True)
    with open(os.path.join(str(tmp_path / "run"), "trace.json")) as f:
        trace = json.load(f)
    gen = [e for e in trace["traceEvents"] if e.get("ph") == "X"
           and str(e.get("tid", "")).startswith("generate/") and e["name"] == "COMPUTE"]
    # one engine call per READ, not a continuous-batching loop's overlapping lanes
    assert gen and all("#" not in str(e["tid"]) for e in gen)


@pytest.mark.engine
def test_streaming_trainer_at_alpha0_matches_the_whole_step(tmp_path):
    """stream: true at alpha 0, in_order: the same rows, the same step, up to the summation
    order of the gradients (the trainer's engine test bounds that at 1e-6 per parameter after
    a step; two steps here, each on the rollouts of the weights before it)."""
    torch = pytest.importorskip("torch")
    sync = os.path.join(HERE, "..", "pipelines", "grpo_digits_sync.yaml")
    out = {}
    for stream in ("false", "true"):
        plan, driver, result, steps_rows = _run(
            tmp_path, [f"tasks.update.stream={stream}", "step.prompts_per_step=4"], steps=2,
            path=sync, name=f"stream_{stream}")
        assert plan.task("update").stream == (stream == "true")
        upd = next(w for w in driver.backend.workers.values() if w.task.name == "update")
        out[stream] = (result.metrics, steps_rows, upd.engine.export_weights())
    (m0, rows0, w0), (m1, rows1, w1) = out["false"], out["true"]
    assert rows0 == rows1  # the same rows in the same steps
    for a, b in zip(m0, m1):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    worst = max(float((w0[k] - w1[k]).abs().max()) for k in w0)
    assert worst <= 1e-5, worst


def test_redundant_environments_take_the_first_finished_episodes(tmp_path):
    """Env-level async with redundancy (ROLL Flash's redundant environments): more episodes
    are launched than a step needs; the step trains the first finished groups and the episodes
    still running are cancelled in their engine."""
    agentic = os.path.join(HERE, "..", "pipelines", "agentic_sim.yaml")
    plan, driver, result, steps_rows = _run(tmp_path, [
        "step.prompts_per_step=4", "step.samples_per_prompt=2", "tasks.generate.replicas=1",
        "pools.rollout.devices=1", "tasks.generate.args.time_scale=0.2",
        "tasks.update.args.micro_batch=4",
        "tasks.generate.redundancy=1.5", "tasks.generate.on_update=continue"], steps=4,
        path=agentic)
    assert plan.task("generate").env and plan.step.launch_groups == 6
    _check_invariants(plan, result, steps_rows, whole_steps=True)
    assert result.dropped.get("redundant", 0) >= 3 * 2 * 2
    gen = [w for w in result.workers.values() if w.get("task") == "generate"]
    assert sum(w.get("cancelled", 0) for w in gen) > 0, gen


def test_a_refilling_filter_that_drops_everything_is_af635_not_a_hang(tmp_path):
    path = _filtered_pipeline(tmp_path, refill=True)
    (tmp_path / "dropall.py").write_text(  # its own module: myfilters is imported already
        "def nothing_passes(reward, groups):\n    return [False for _ in groups]\n")
    text = open(path).read().replace("myfilters:every_third_out", "dropall:nothing_passes")
    open(path, "w").write(text)
    from asyncflow.runtime.driver import RunError

    with pytest.raises(RunError) as e:
        _run(tmp_path, SMALL + [_latency(1), "sync.0.max_staleness=1"], path=path)
    assert str(e.value).startswith("AF635") and "'keep' (" in str(e.value), str(e.value)


@pytest.mark.parametrize("consume,stream,extra,ahead", [
    ("first_ready", "true", [], 4),  # one micro-batch
    ("first_ready", "false", [], 0),
    ("in_order", "true", [], 8),  # its first read: micro_batch x per_read (the step's 2)
    ("in_order", "false", [], 0),
    ("in_order", "true", ["sync.0.max_staleness=0"], 0),  # nothing of step n + 1 is ready
    ("in_order", "true", ["tasks.generate.redundancy=1.5"], 0),  # its window is chosen
])
def test_the_plan_says_how_many_rows_a_streaming_trainer_reads_ahead(consume, stream, extra,
                                                                     ahead):
    plan = compile_file(LONGTAIL, sets=SMALL + [f"tasks.update.consume={consume}",
                                                f"tasks.update.stream={stream}"] + extra)
    reads = [o for w in plan.workers if w.task == "update" for o in w.ops if o.kind == "READ"]
    assert reads and {o.ahead for o in reads} == {ahead}


@pytest.mark.parametrize("consume,backend", [
    ("first_ready", "local"), ("in_order", "local"),
    pytest.param("in_order", "ray", marks=pytest.mark.ray)])  # on Ray: the reader thread
def test_a_streaming_trainer_leases_the_next_step_while_the_last_computes(tmp_path, consume,
                                                                          backend):
    """op.ahead: step n + 1's first rows are leased before step n publishes (while the
    device computes step n's last micro-batch), and trained in step n + 1, within alpha."""
    # trainer-bound (8 samples x 20 ms a step; rollouts of ~5 ms): by the time a step hands
    # over its last micro-batch, the next step's rows have long been generated, even on a
    # loaded machine
    plan, driver, result, steps_rows = _run(tmp_path, SMALL + [
        "tasks.generate.args.latency={dist: lognormal, median: 0.005, sigma: 0.5, max: 0.05, "
        "seed: 3}", "tasks.update.args.seconds_per_sample=0.02",
        "tasks.update.args.time_scale=1.0", "sync.0.max_staleness=1",
        f"tasks.update.consume={consume}"], steps=5, backend=backend)
    trained = _check_invariants(plan, result, steps_rows, whole_steps=True)
    assert len(trained) == 5 * plan.step.samples_per_step
    with open(tmp_path / "run" / "trace.json") as f:
        spans = [e for e in json.load(f)["traceEvents"]
                 if e.get("ph") == "X" and e["cat"] == "update"]
    publish = {e["args"]["step"]: e["ts"] for e in spans if e["name"] == "PUBLISH"}
    first_read = {}
    for e in spans:
        if e["name"] == "READ":
            s = e["args"]["step"]
            first_read[s] = min(first_read.get(s, e["ts"]), e["ts"])
    early = [n for n in range(plan.step.steps - 1) if first_read[n + 1] < publish[n]]
    assert len(early) >= 3, (first_read, publish)
