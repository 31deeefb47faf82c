"""RUN_DIR/samples.jsonl: what the model wrote, at the first and last step and every
--log-samples K (asyncflow.runtime.samples), in TensorBoard's text tab and the run summary."""
from __future__ import annotations

import json

import pytest
from shared_runs import cli_result

from asyncflow.compiler.pipeline import compile_text
from asyncflow.rewards import digits_match
from asyncflow.runtime import samples
from asyncflow.runtime.data import load_prompts
from asyncflow.runtime.driver import Driver
from asyncflow.tokens import Text

from test_runtime_props import PIPELINE, PPS, SPP, SPS

KEYS = {"step", "row", "prompt", "completion", "reward", "version", "rendered", "from"}


def plan_text(steps=5, alpha=1, trainer_inputs="[prompt, response, logprobs, advantages]"):
    text = PIPELINE.format(alpha=alpha, replicas=1, seed=3, pps=PPS, spp=SPP, steps=steps,
                           score_replicas=1)
    return text.replace("inputs: [prompt, response, logprobs, advantages]",
                        f"inputs: {trainer_inputs}")


def rows_of(path):
    return [json.loads(line) for line in open(path)]


def test_which_steps_and_rows():
    # the first, the last and every K-th step; 0 turns it off
    assert [s for s in range(25) if samples.wanted(s, 10, 25)] == [0, 10, 20, 24]
    assert [s for s in range(7) if samples.wanted(s, 10, 7, first=3)] == [0, 3, 6]
    assert not any(samples.wanted(s, 0, 5) for s in range(5))
    # one row from each of 4 prompts spread over the step (8 prompts of 4 samples)
    assert samples.pick(list(range(32)), 4) == [0, 8, 16, 24]
    # fewer prompts than rows wanted: round-robin over them
    assert samples.pick(list(range(100, 108)), 4) == [0, 4, 1, 5]
    assert samples.pick([5, 6], 4) == [0, 1]


def test_a_run_writes_the_rows_it_trained_on(tmp_path):
    plan = compile_text(plan_text(steps=5), "props.yaml")
    Driver(plan, "local", out_dir=str(tmp_path), options={"log_samples": 2}).run()
    got = rows_of(tmp_path / "samples.jsonl")
    assert sorted({r["step"] for r in got}) == [0, 2, 4]
    prompts = load_prompts(plan, [])
    for r in got:
        assert set(r) >= KEYS
        s, row = r["step"], r["row"]
        assert s * SPS <= row < (s + 1) * SPS  # a row of the step it is logged at
        data = prompts[row // SPP]
        assert r["prompt"] == data["prompt"]  # a string prompt is the text as given
        assert r["completion"] and r["completion"].isdigit()
        # the reward the trainer read is the reward function's on this prompt and completion
        assert r["reward"] == digits_match(r["prompt"], data["answer"], r["completion"])
        assert r["version"] <= s and s - r["version"] <= 1  # staleness alpha 1
        assert r["from"] == {"prompt": "prompts.prompt", "completion": "generate.response",
                             "reward": "score.reward"}
    for s in (0, 2, 4):
        step_rows = [r["row"] for r in got if r["step"] == s]
        assert len(step_rows) == 4 and len({r // SPP for r in step_rows}) == PPS


def test_a_trainer_without_the_prompt_still_logs_it(tmp_path):
    plan = compile_text(plan_text(steps=2, trainer_inputs="[response, logprobs, advantages]"),
                        "props.yaml")
    Driver(plan, "local", out_dir=str(tmp_path)).run()  # the driver's default: every 10
    got = rows_of(tmp_path / "samples.jsonl")
    assert sorted({r["step"] for r in got}) == [0, 1]  # the first and the last
    prompts = load_prompts(plan, [])
    assert all(r["prompt"] == prompts[r["row"] // SPP]["prompt"] for r in got)


def test_off_writes_nothing(tmp_path):
    plan = compile_text(plan_text(steps=2), "props.yaml")
    Driver(plan, "local", out_dir=str(tmp_path), options={"log_samples": 0}).run()
    assert not (tmp_path / "samples.jsonl").exists()


def test_the_rendered_prompt_is_the_text_the_model_saw():
    plan = compile_text(plan_text(steps=3), "props.yaml")
    task = plan.task("update")
    sampler = samples.Sampler(plan, task, every=10, reward="reward")
    chat = [{"role": "user", "content": "2+2="}]
    rendered = "<|user|>2+2=<|assistant|>"
    cols = {"_row": [0, 1], "_version": [0, 0], "prompt": [chat, chat],
            "response": [Text("4", ids=(7,), prompt_text=rendered), "5"],
            "reward": [1.0, 0.0], "advantages": [0.5, -0.5]}
    a, b = sampler.take(0, cols)
    assert a["prompt"] == rendered and a["rendered"] is True and a["completion"] == "4"
    assert b["prompt"] == chat and b["rendered"] is False  # no rendering known: as given
    assert (a["reward"], a["advantage"]) == (1.0, 0.5)
    assert sampler.take(1, cols) == []  # not a logged step


def test_a_resumed_run_keeps_the_earlier_steps(tmp_path):
    log = samples.SamplesLog(str(tmp_path))
    for s in (0, 2, 4):
        log.append(s, [{"row": s, "prompt": "p", "completion": "c"}])
    log.close()
    resumed = samples.SamplesLog(str(tmp_path), keep_before=3)
    resumed.append(3, [{"row": 30, "prompt": "p", "completion": "c"}])
    resumed.close()
    assert [r["step"] for r in rows_of(tmp_path / "samples.jsonl")] == [0, 2, 3]
    assert [r["row"] for r in samples.last(str(tmp_path))] == [30]


def test_samples_in_tensorboard_and_the_summary(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    p = tmp_path / "p.yaml"
    p.write_text(plan_text(steps=3))
    out = tmp_path / "run"
    r = cli_result(capsys, "run", str(p), "--backend", "local", "--out", str(out), "--quiet",
                   "--log-samples", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    last = [x for x in rows_of(out / "samples.jsonl") if x["step"] == 2]
    assert f"sample (step 2, row {last[0]['row']}" in r.stdout
    assert f"completion: {last[0]['completion']}" in r.stdout
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert "samples/text_summary" in acc.Tags()["tensors"]
    events = acc.Tensors("samples/text_summary")
    assert [e.step for e in events] == [0, 1, 2]
    text = events[-1].tensor_proto.string_val[0].decode()
    assert all(x["completion"] in text for x in last)


@pytest.mark.ray
def test_samples_on_ray(tmp_path):
    pytest.importorskip("ray")
    plan = compile_text(plan_text(steps=2), "props.yaml")
    Driver(plan, "ray", out_dir=str(tmp_path)).run()
    got = rows_of(tmp_path / "samples.jsonl")
    assert sorted({r["step"] for r in got}) == [0, 1] and all(set(r) >= KEYS for r in got)
    prompts = load_prompts(plan, [])
    assert all(r["prompt"] == prompts[r["row"] // SPP]["prompt"] for r in got)
