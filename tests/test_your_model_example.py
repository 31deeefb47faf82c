"""examples/your_model, as a user runs it: ``make_model.py`` builds a model directory (a BPE
tokenizer trained with ``tokenizers``, a chat template, a tiny Qwen2) and chat-form jsonl data
offline; the pipeline finds them, and its grader, relative to itself; ``check``, then 3 steps on
each backend from another working directory; the export loads with transformers and samples
from a chat prompt as the run rendered it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "your_model"
CLI = [sys.executable, "-m", "asyncflow.cli"]


def _run(args, cwd, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_DEDUP_LOGS": "0"}
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """A copy of the example with its model and data built (what `python make_model.py` does)."""
    here = tmp_path_factory.mktemp("ex") / "your_model"
    shutil.copytree(EXAMPLE, here, ignore=shutil.ignore_patterns("ckpt", "data", "__pycache__"))
    r = _run([sys.executable, "make_model.py"], cwd=here)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (here / "ckpt" / "tiny-chat" / "tokenizer.json").exists()
    assert (here / "ckpt" / "tiny-chat" / "chat_template.jinja").exists()
    return here


@pytest.mark.engine
def test_example_checks_from_another_directory(example, tmp_path):
    r = _run([*CLI, "check", str(example / "pipeline.yaml")], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"model actor: directory {example / 'ckpt' / 'tiny-chat'}" in r.stdout


@pytest.mark.engine
@pytest.mark.ray
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_example_runs_and_its_export_loads(example, tmp_path, backend):
    out = tmp_path / "run"
    r = _run([*CLI, "run", str(example / "pipeline.yaml"), "--backend", backend, "--steps", "3",
              "--out", str(out), "--quiet", "--log-samples", "1"], cwd=tmp_path, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    steps = [x for x in rows if "reward_mean" in x]
    assert [x["step"] for x in steps] == [0, 1, 2]
    evals = [x for x in rows if "eval/score" in x]
    assert [x["eval/version"] for x in evals] == [0, 3]  # step 0 and the end: every 10 > 3 steps
    assert all(x["eval/n"] == 64 for x in evals)

    samples = [json.loads(x) for x in open(out / "samples.jsonl")]
    assert {s["step"] for s in samples} == {0, 1, 2}
    s = samples[0]  # the prompt as the model saw it: the chat template and the generation prompt
    assert s["rendered"] and s["prompt"].startswith("<|im_start|>system\nAnswer with the number")
    assert s["prompt"].endswith("<|im_start|>assistant\n")

    final = str(out / "final" / "actor")  # loads and samples with transformers alone
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final)
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, do_sample=True, max_new_tokens=4, pad_token_id=tok.pad_token_id)
    n = int(gen.shape[1] - ids["input_ids"].shape[1])
    assert isinstance(tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True), str)
    assert tok.chat_template is not None and model.dtype == torch.float32 and 1 <= n <= 4
