"""The runtime on the local backend: files it writes, task kinds, CLI, interruption."""
from __future__ import annotations

import json

import pytest

from asyncflow.compiler.pipeline import compile_text
from asyncflow.runtime.driver import Driver
from asyncflow.runtime.gate import Gate
from asyncflow.runtime.trace import METRIC_KEYS

from test_runtime_props import PIPELINE, SPS, check_exactly_once, make_plan


def test_gate_rules():
    g = Gate(alpha=1, samples_per_step=8, steps=10)
    assert g.step_of(15) == 1 and list(g.rows_of(2)) == list(range(16, 24))
    assert g.max_row(0) == 16  # version 0 may start steps 0 and 1
    assert g.max_row(9) == 80  # never past the last step
    assert g.accepts(3, 2) and not g.accepts(3, 1)
    assert g.fresh_enough(16, 1) and not g.fresh_enough(24, 1)
    assert Gate(0, 8, 10).max_row(0) == 8  # alpha 0: one step at a time


def test_run_dir_files(tmp_path):
    r = Driver(make_plan(1, 2, 3), "local", out_dir=str(tmp_path)).run()
    assert (tmp_path / "plan.json").exists()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4
    for line in lines:
        m = json.loads(line)
        assert set(METRIC_KEYS) <= set(m) and "loss" in m
        assert set(m["utilization"]) == {"rollout", "train", "cpu"}
        assert 0.0 <= m["bubble_fraction"] <= 1.0
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = trace["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    meta = [e for e in events if e["ph"] == "M"]
    assert {e["name"] for e in meta} == {"process_name", "thread_name"}
    assert {"READ", "COMPUTE", "WRITE", "PUBLISH"} <= {e["name"] for e in xs}
    for e in xs:
        assert set(e) == {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}
        assert set(e["args"]) == {"rows", "version", "step"} and e["dur"] >= 0
    pids = {e["pid"] for e in xs}
    assert pids <= {"rollout", "train", "cpu"}
    assert r.samples == 4 * SPS


def keep_even_groups(rewards, groups):
    """A filter keeping the groups of even prompts (whole groups, half of every step)."""
    return [g % 2 == 0 for g in groups]


FILTERED = PIPELINE.replace("""  advantage:
    kind: advantage
    estimator: grpo
    inputs: [reward]""", """  keep_varied:
    kind: filter
    fn: test_runtime_local:keep_even_groups
    inputs: [reward]
    outputs: [varied]
  advantage:
    kind: advantage
    estimator: reinforce_pp
    inputs: [reward, varied]""")


def test_filter_drops_groups_and_step_scope_advantage():
    text = FILTERED.format(alpha=1, replicas=2, seed=1, pps=2, spp=4, steps=4, score_replicas=1)
    text = text.replace("    outputs: [varied]\n", "    outputs: [varied]\n    refill: false\n")
    plan = compile_text(text, "filtered.yaml")
    r = Driver(plan, "local").run()
    filtered = r.stats["drops"].get("keep_varied", 0)
    assert filtered == 2 * SPS  # half of every step, whole groups
    assert r.dropped.get("filter", 0) == filtered
    total = 4 * SPS
    for task in ("generate", "score", "keep_varied"):
        assert sorted(r.consumed[task]) == list(range(total))
    kept = sorted(r.consumed["update"])
    assert len(kept) == len(set(kept)) == total - filtered
    assert sum(m["samples"] for m in r.metrics) == total - filtered
    assert all(r % 8 < 4 for r in kept)  # 4 samples per prompt, 2 prompts per step: even ones


def test_refill_replaces_filtered_groups_for_a_step_scope_advantage():
    """refill (the default): every step trains prompts_per_step groups, the filtered ones
    replaced by new prompts; a step-scope estimator (reinforce_pp) normalises over exactly the
    groups its step trains."""
    text = FILTERED.format(alpha=1, replicas=2, seed=1, pps=2, spp=4, steps=4, score_replicas=1)
    plan = compile_text(text, "filtered.yaml")
    assert plan.task("keep_varied").refill and plan.step.replace == ["filter"]
    r = Driver(plan, "local").run()
    kept = sorted(r.consumed["update"])
    assert len(kept) == len(set(kept)) == 4 * SPS  # every step whole
    assert all(row % 8 < 4 for row in kept)  # even prompts only: the odd ones were refilled
    assert [m["samples"] for m in r.metrics] == [SPS] * 4
    assert kept == list(sorted({g * 4 + i for g in range(0, 16, 2) for i in range(4)}))
    assert r.metrics[-1]["refilled"] >= 6  # 2 x 4 steps of odd groups, but the last steps'
    assert r.stats["drops"]["keep_varied"] == r.dropped["filter"]


def test_keyboard_interrupt_writes_partial_files(tmp_path):
    d = Driver(make_plan(1, 2, 3, steps=50), "local", out_dir=str(tmp_path))

    def on_step(m):
        if m["step"] == 1:
            raise KeyboardInterrupt
    d.on_step = on_step
    with pytest.raises(KeyboardInterrupt):
        d.run()
    assert d.result.interrupted
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert all(w["status"] == "stopped" for w in d.result.workers.values())


def _cli(argv):
    from asyncflow.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code


def test_cli_run(tmp_path):
    src = tmp_path / "p.yaml"
    src.write_text(PIPELINE.format(alpha=1, replicas=1, seed=0, pps=2, spp=4, steps=3, score_replicas=1))
    out = tmp_path / "run"
    assert _cli(["run", str(src), "--backend", "local", "--out", str(out), "--quiet",
                 "--set", "sync.0.max_staleness=0"]) in (0, None)
    ms = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(ms) == 3 and all(m["staleness_max"] == 0 for m in ms)


def test_cli_run_user_error_exits_2(tmp_path):
    src = tmp_path / "bad.yaml"
    src.write_text(PIPELINE.format(alpha=1, replicas=1, seed=0, pps=2, spp=4, steps=3,
                                   score_replicas=1).replace("kind: reward", "kind: rewrd"))
    assert _cli(["run", str(src), "--backend", "local"]) == 2
