"""Evaluation during training (``eval:``): the language, the plan, and runs on both backends.

The rules cited are :mod:`asyncflow.compiler.passes.evalplan`'s (1: the held-out source feeds
no task; 5: the versions evaluated) and :mod:`asyncflow.runtime.evaluate`'s (1-3: when the
rollout worker evaluates, and that the run ends only after the final version's evaluation)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncflow.compiler.pipeline import compile_file
from asyncflow.diagnostics import Diagnostics
from asyncflow.dsl.load import load_file
from asyncflow.runtime.driver import Driver

HELD = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((1, 2), (2, 2), (3, 1), (0, 0))]

PIPELINE = """\
pipeline: sim_eval
models:
  policy: {{init: asyncflow.models:tiny_decoder, args: {{layers: 1, hidden: 16}}}}
data:
  prompts: {{source: asyncflow.datasets:digits, args: {{n: 200, seed: 0}}, fields: [prompt, answer]}}
  test: {{source: held.jsonl, fields: [prompt, answer]}}
pools:
  rollout: {{devices: 1}}
  train: {{devices: 1}}
step: {{prompts_per_step: 4, samples_per_prompt: 2, steps: {steps}}}
tasks:
  generate: {{kind: rollout, engine: {engine}, model: policy, pool: rollout, inputs: [prompt],
             outputs: [response, logprobs], args: {rargs}}}
  score: {{kind: reward, fn: asyncflow.rewards:digits_match, inputs: [prompt, answer, response],
          outputs: [reward]}}
  advantage: {{kind: advantage, estimator: grpo, inputs: [reward], outputs: [advantages]}}
  update: {{kind: train, engine: {engine}, model: policy, pool: train, loss: grpo,
           inputs: [prompt, response, logprobs, advantages], args: {targs}}}
eval: {eval}
sync:
  - {{from: update, to: generate, max_staleness: 1}}
"""
SIM = {"engine": "sim", "rargs": "{latency: 0.001}", "targs": "{seconds_per_sample: 0.001}"}


def write(tmp_path: Path, eval_: str = "{data: test, every: 2}", steps: int = 5, **kw) -> Path:
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in HELD))
    p = tmp_path / "p.yaml"
    p.write_text(PIPELINE.format(eval=eval_, steps=steps, **{**SIM, **kw}))
    return p


# -- language and plan -------------------------------------------------------------------------
def test_plan_lists_versions_and_holds_the_source_out(tmp_path):
    plan = compile_file(write(tmp_path))
    ev = plan.eval
    assert ev.versions == [0, 2, 4, 5]  # rule 5: 0, every, 2 every, ..., steps
    assert (ev.rollout, ev.worker, ev.metric_task, ev.name) == ("generate", "generate/0", "score", "reward")
    assert ev.inputs == ["prompt", "answer", "response"] and ev.greedy
    assert [d.name for d in plan.data] == ["prompts", "test"]  # the held-out source comes last
    assert all(c.src != "test" for c in plan.channels)  # rule 1: it feeds no task
    again = type(plan).from_json(plan.to_json())
    assert again.eval == ev
    plain = compile_file(write(tmp_path, eval_="{data: test}"))
    assert plain.eval.versions == [0, 5]  # no every: the initial and the final weights


def test_the_graph_draws_the_held_out_source_into_the_rollout(tmp_path):
    """``asyncflow viz PIPELINE``: the held-out source is not left unconnected: a dotted edge to
    the rollout that evaluates, labelled with the metric and when it runs."""
    from asyncflow.viz.graph import to_dot

    plan = compile_file(write(tmp_path))
    edges = [ln for ln in to_dot(plan).splitlines() if ln.strip().startswith(f'"n_{plan.eval.data}" ->')]
    assert len(edges) == 1, edges
    assert f'-> "n_{plan.eval.rollout}"' in edges[0] and "style=dotted" in edges[0]
    assert f"eval/{plan.eval.name}" in edges[0] and "every 2 steps" in edges[0]


def test_compile_prints_the_evaluation(tmp_path, capsys):
    from asyncflow.cli import main

    with pytest.raises(SystemExit) as e:
        main(["compile", str(write(tmp_path))])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "evaluation (eval:)" in out and "0, 2, 4, 5" in out and "generate/0" in out
    assert "eval/reward = mean of asyncflow.rewards:digits_match(prompt, answer, response)" in out


def test_no_eval_plan_reads_as_before(tmp_path):
    text = write(tmp_path).read_text().replace("eval: {data: test, every: 2}\n", "")
    text = text.replace("  test: {source: held.jsonl, fields: [prompt, answer]}\n", "")
    (tmp_path / "q.yaml").write_text(text)
    plan = compile_file(tmp_path / "q.yaml")
    assert plan.eval is None and "eval" not in plan.to_dict()


@pytest.mark.parametrize("to", ["af", "yaml"])
def test_fmt_round_trips_eval(tmp_path, to):
    from asyncflow.dsl.af_emit import emit_af
    from asyncflow.dsl.emit import emit_yaml

    src = write(tmp_path, eval_="{data: test, every: 3, greedy: false, temperature: 0.5, "
                                "samples_per_prompt: 2, max_prompts: 3, name: acc}")
    d = Diagnostics()
    p = load_file(str(src), (), d)
    assert not d.errors and p.eval.every == 3 and p.eval.name == "acc"
    out = tmp_path / f"out.{to}"
    out.write_text(emit_af(p) if to == "af" else emit_yaml(p))
    if to == "af":
        assert "eval { data=test every=3 name=acc greedy=false" in out.read_text()
    d2 = Diagnostics()
    assert load_file(str(out), (), d2) == p and not d2.errors


def test_af_eval_statement_errors_are_located(tmp_path):
    src = write(tmp_path)
    d = Diagnostics()
    p = load_file(str(src), (), d)
    from asyncflow.dsl.af_emit import emit_af

    text = emit_af(p).replace("eval { data=test every=2 }", "eval { data=test evry=2 }")
    bad = tmp_path / "bad.af"
    bad.write_text(text)
    d = Diagnostics()
    load_file(str(bad), (), d)
    [e] = d.errors
    line = text.splitlines().index("eval { data=test evry=2 }") + 1
    assert (e.code, e.loc.line, e.loc.col) == ("AF201", line, 18) and "every" in (e.hint or "")


def test_eval_with_its_own_function_and_inputs(tmp_path):
    (tmp_path / "grader.py").write_text(
        "def exact(answer, response):\n    return float(str(response).strip() == answer)\n")
    plan = compile_file(write(tmp_path, eval_="{data: test, fn: grader:exact, inputs: [answer, response]}"))
    assert (plan.eval.fn, plan.eval.inputs, plan.eval.name, plan.eval.metric_task) == \
        ("grader:exact", ["answer", "response"], "exact", "")


# -- runs --------------------------------------------------------------------------------------
def _eval_lines(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/version" in r]


def _check_run(r, run_dir: Path, steps: int, versions: list[int], sps: int = 8) -> None:
    assert len(r.metrics) == steps  # one row per train step: eval rows are lines of their own
    evals = _eval_lines(run_dir)
    assert evals == r.evals
    targets = [e["eval/target"] for e in evals]
    # every listed version is answered: by its own row, or -- when a weight sync skipped it (a
    # loaded machine) -- by the row of the first later version adopted (evaluate rule 2)
    assert targets == sorted(set(targets)) and set(targets) <= set(versions)
    assert targets[0] == versions[0] and targets[-1] == versions[-1]
    for v in set(versions) - set(targets):
        assert any(e["eval/target"] > v and e["eval/version"] >= e["eval/target"] for e in evals)
    for e in evals:  # each ran on the version it asked for or a later one (evaluate rule 2)
        assert e["eval/version"] >= e["eval/target"] and e["step"] == e["eval/version"]
        assert e["eval/n"] == len(HELD) and 0.0 <= e["eval/reward"] <= 1.0
    assert evals[-1]["eval/version"] == steps  # rule 3: the final weights are evaluated
    assert r.stats["rows"] == steps * sps  # the held-out rows never entered the sample store


def test_sim_run_local_evaluates_listed_versions(tmp_path):
    src = write(tmp_path)
    r = Driver(compile_file(src), "local", out_dir=str(tmp_path / "run")).run()
    _check_run(r, tmp_path / "run", 5, [0, 2, 4, 5])
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    evals = [e for e in trace["traceEvents"] if e.get("name") == "EVAL"]
    assert len(evals) == 4 and all(e["tid"].startswith("generate/0") for e in evals)


def test_steps_override_moves_the_final_evaluation(tmp_path):
    src = write(tmp_path)
    r = Driver(compile_file(src), "local", out_dir=str(tmp_path / "run"), steps=3).run()
    _check_run(r, tmp_path / "run", 3, [0, 2, 3])


def test_metric_that_raises_is_a_located_af610(tmp_path):
    from asyncflow.errors import AsyncflowError

    (tmp_path / "grader.py").write_text("def broken(answer, response):\n    raise ValueError('no')\n")
    src = write(tmp_path, eval_="{data: test, fn: grader:broken, inputs: [answer, response]}")
    with pytest.raises(AsyncflowError) as e:
        Driver(compile_file(src), "local", out_dir=str(tmp_path / "run")).run()
    assert "AF610" in str(e.value) or getattr(e.value, "code", "") == "AF610"


@pytest.mark.ray
def test_sim_run_ray_evaluates_listed_versions(tmp_path):
    src = write(tmp_path, steps=4)
    r = Driver(compile_file(src), "ray", out_dir=str(tmp_path / "run")).run()
    _check_run(r, tmp_path / "run", 4, [0, 2, 4])


@pytest.mark.engine
def test_hf_run_local_greedy_eval(tmp_path):
    src = write(tmp_path, eval_="{data: test, every: 1, max_prompts: 3}", steps=2, engine="hf",
                rargs="{max_new_tokens: 3}", targs="{lr: 1.0e-3}")
    r = Driver(compile_file(src), "local", out_dir=str(tmp_path / "run")).run()
    evals = _eval_lines(tmp_path / "run")
    # every version is listed; a weight sync that skips version 1 (the rollout adopts 2 at once:
    # a loaded machine) answers it with the evaluation of version 2 (evaluate.py, rule 2)
    targets = [e["eval/target"] for e in evals]
    assert targets in ([0, 1, 2], [0, 2]) and evals[-1]["eval/version"] == 2
    assert all(e["eval/version"] >= e["eval/target"] for e in evals)
    assert all(e["eval/n"] == 3 and isinstance(e["eval/reward"], float) for e in evals)
    assert len(r.metrics) == 2


def test_viz_draws_eval_rows_apart_from_steps(tmp_path):
    from asyncflow.viz.metrics import build_panels, eval_keys, load_metrics, render_metrics

    rows = [{"step": 0, "eval/reward": 0.1, "eval/n": 4, "eval/version": 0, "eval/target": 0}]
    for s in range(4):
        rows.append({"step": s, "reward_mean": 0.1 * s, "samples_per_s": 10.0})
    rows.append({"step": 4, "eval/reward": 0.5, "eval/n": 4, "eval/version": 4, "eval/target": 4})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = load_metrics(path)
    assert eval_keys(records) == ["eval/reward"]
    panels = build_panels(records, ("reward_mean", "eval/reward"))
    assert [p.name for p in panels] == ["reward", "eval/reward"]
    svg = render_metrics(records, ("reward_mean", "eval/reward")).to_svg()
    # the step curve is one unbroken line of 4 points, the eval curve one line of 2
    assert svg.count('data-key="reward_mean"') == 1 and svg.count('data-key="eval/reward"') == 1
    assert "4 train steps, 2 evaluations" in svg
