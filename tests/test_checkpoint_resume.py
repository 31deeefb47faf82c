"""Checkpoint / resume (asyncflow.runtime.checkpoint): SIGKILL a run mid-way, resume it, and
check from the run's records that no prompt was skipped or trained twice."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from asyncflow.runtime import checkpoint

PPS, SPP, STEPS, EVERY = 2, 4, 12, 3
SPS = PPS * SPP

PIPELINE = f"""
pipeline: ckpt
models:
  policy: {{init: asyncflow.models:tiny_decoder, args: {{layers: 1, hidden: 16}}}}
data:
  prompts: {{source: asyncflow.datasets:digits, args: {{n: 64, seed: 0}}, fields: [prompt, answer]}}
pools:
  rollout: {{devices: 2}}
  train: {{devices: 1}}
step: {{prompts_per_step: {PPS}, samples_per_prompt: {SPP}, steps: {STEPS}}}
tasks:
  generate:
    kind: rollout
    engine: sim
    model: policy
    pool: rollout
    replicas: 2
    inputs: [prompt]
    outputs: [response, logprobs]
    args: {{slots: 4, latency: {{dist: lognormal, median: 0.01, sigma: 0.5, max: 0.05, seed: 3}}}}
  score:
    kind: reward
    fn: asyncflow.rewards:digits_match
    inputs: [prompt, answer, response]
    outputs: [reward]
  advantage:
    kind: advantage
    estimator: grpo
    inputs: [reward]
    outputs: [advantages]
  update:
    kind: train
    engine: sim
    model: policy
    pool: train
    loss: grpo
    inputs: [prompt, response, logprobs, advantages]
    args: {{seconds_per_sample: 0.03, micro_batch: 4}}
sync:
  - {{from: update, to: generate, max_staleness: 1}}
"""


def _cli(args, backend="local", **kw):
    cmd = [sys.executable, "-m", "asyncflow.cli", "run", *args, "--backend", backend, "--quiet"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def _jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_checkpoint_layout_is_atomic(tmp_path):
    """Only ``step_N`` directories with a state file count; ``.tmp-`` ones are removed."""
    root = tmp_path / "checkpoints"
    for v in (2, 3):
        (root / f"step_{v}" / "engines" / "update" / "0").mkdir(parents=True)
        (root / f"step_{v}" / "engines" / "update" / "0" / "state.json").write_text("{}")
        (root / f"step_{v}" / "state.json").write_text(json.dumps({"version": v}))
    (root / "step_6").mkdir()  # no state.json: never renamed into place by close()
    (root / ".tmp-step_9").mkdir()
    assert checkpoint.latest(str(tmp_path)) == str(root / "step_3")
    got = checkpoint.prepare_resume(str(tmp_path), SPS)
    assert got["version"] == 3 and not (root / ".tmp-step_9").exists()
    # an unreadable newest checkpoint falls back to the one before it, saying why
    (root / "step_3" / "state.json").write_text("{cut by a crash")
    skipped = []
    assert checkpoint.latest(str(tmp_path), skipped) == str(root / "step_2")
    assert [os.path.basename(d) for d, _ in skipped] == ["step_6", "step_3"]
    shutil.rmtree(root / "step_2" / "engines" / "update" / "0")  # engine state gone
    assert checkpoint.latest(str(tmp_path)) is None
    assert checkpoint.wanted(3, 6, 12) and not checkpoint.wanted(3, 12, 12)
    assert not checkpoint.wanted(None, 3, 12)


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_sigkill_then_resume_trains_every_prompt_once(tmp_path, backend):
    """SIGKILL of the driver (on Ray: the workers, store shards and control actor go with the
    Ray it started), then ``--resume`` on a fresh process (and a fresh Ray)."""
    if backend == "ray":
        pytest.importorskip("ray")
    pipe = tmp_path / "ckpt.yaml"
    pipe.write_text(PIPELINE)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = _cli([str(pipe), "--out", str(run_dir), "--checkpoint-every", str(EVERY)], backend,
             env=env)
    # kill once a checkpoint past the first exists and a step past it was trained (that step's
    # work must be discarded and redone), but the run is not over
    deadline = time.time() + 120
    metrics_path = run_dir / "metrics.jsonl"
    try:
        while time.time() < deadline:
            ck = checkpoint.latest(str(run_dir))
            v = int(os.path.basename(ck).split("_")[1]) if ck else 0
            if v >= 2 * EVERY and len(checkpoint._read_jsonl(str(metrics_path))) > v:
                break
            assert p.poll() is None, p.stdout.read().decode()
            time.sleep(0.02)
        else:
            pytest.fail("no checkpoint within the time limit")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    killed_at = _jsonl(run_dir / "metrics.jsonl")
    assert len(killed_at) < STEPS, "the run ended before it was killed: slow it down"
    ck = checkpoint.latest(str(run_dir))
    version = int(os.path.basename(ck).split("_")[1])

    r = _cli([str(pipe), "--resume", str(run_dir), "--checkpoint-every", str(EVERY)], backend,
             env=env)
    out, _ = r.communicate(timeout=180)
    assert r.returncode == 0, out.decode()

    resumes = _jsonl(run_dir / "resume.jsonl")
    assert len(resumes) == 1 and resumes[0]["version"] == version
    # steps the killed run trained after the checkpoint were discarded and redone
    discarded = [m["step"] for m in killed_at if m["step"] >= version]
    assert discarded and resumes[0]["discarded_steps"] == discarded

    # every step's train batch is exactly that step's rows, once, across the two runs
    trained = _jsonl(run_dir / "train_rows.jsonl")
    assert [t["step"] for t in trained] == list(range(STEPS))
    for t in trained:
        s = t["step"]
        assert sorted(t["rows"]) == list(range(s * SPS, (s + 1) * SPS)), f"step {s}"
    all_rows = [r for t in trained for r in t["rows"]]
    assert len(all_rows) == len(set(all_rows)) == STEPS * SPS  # no prompt skipped or twice

    metrics = _jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert metrics[-1]["version"] == STEPS
    # the trainer resumed from the checkpoint's state: the sim loss is a function of the
    # trainer engine's own version, so a redone step reports the loss the killed run did
    for m in killed_at:
        assert metrics[m["step"]]["loss"] == m["loss"], m["step"]
    assert all(m["staleness_max"] <= 1 for m in metrics)
    # checkpoints of the resumed part exist too, and the newest is complete
    assert checkpoint.latest(str(run_dir)).endswith(f"step_{(STEPS - 1) // EVERY * EVERY}")


def test_resume_with_redundancy_continues_after_the_windows(tmp_path):
    """With the scheduling keys a step's rows are not a fixed range (redundancy: a window of
    launched groups, some cancelled): the checkpoint records where the trainer's next window
    starts, and the resumed run trains every step whole, no row twice."""
    pipe = tmp_path / "ckpt.yaml"
    pipe.write_text(PIPELINE)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    sets = ["--set", "tasks.generate.redundancy=1.5", "--set", "tasks.generate.on_update=continue"]
    p = _cli([str(pipe), "--out", str(run_dir), "--checkpoint-every", str(EVERY), *sets], env=env)
    deadline = time.time() + 120
    try:
        while time.time() < deadline:
            ck = checkpoint.latest(str(run_dir))
            if ck and int(os.path.basename(ck).split("_")[1]) >= 2 * EVERY:
                break
            assert p.poll() is None, p.stdout.read().decode()
            time.sleep(0.02)
        else:
            pytest.fail("no checkpoint within the time limit")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    state = json.loads(open(os.path.join(checkpoint.latest(str(run_dir)), "state.json")).read())
    launch = -(-PPS * 3 // 2) * SPP  # rows launched a step
    assert state["first_row"] == state["version"] * launch  # the next window, not version * SPS
    r = _cli([str(pipe), "--resume", str(run_dir), "--checkpoint-every", str(EVERY), *sets],
             env=env)
    out, _ = r.communicate(timeout=180)
    assert r.returncode == 0, out.decode()
    trained = _jsonl(run_dir / "train_rows.jsonl")
    assert [t["step"] for t in trained] == list(range(STEPS))
    for t in trained:  # each step: PPS whole groups of its own window
        assert len(t["rows"]) == SPS, t
        assert {r // launch for r in t["rows"]} == {t["step"]}, t
    all_rows = [r for t in trained for r in t["rows"]]
    assert len(all_rows) == len(set(all_rows))
