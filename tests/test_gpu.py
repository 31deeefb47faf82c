"""The GPU tier: what the first GPU machine runs (``pytest -m gpu``; skipped where torch sees no
CUDA). The same code paths run on CPU in CI (tests/test_devices.py on a Ray that declares GPUs,
tests/test_join_cluster.py); here they meet real devices: the main job in bfloat16 on the hf
engine on ``cuda``, workers on the GPU ids Ray gives them, the DeepSpeed trainer on NCCL, LoRA on
the device. Run: ``.venv/bin/python -m pytest -m gpu`` (and ``.venv-vllm/bin/python -m pytest -m
"gpu and vllm"`` for vLLM)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
ROOT = Path(__file__).resolve().parents[1]


def _fit(tmp_path, pipeline: str) -> Path:
    """The shipped pipeline, or on a machine of one GPU a copy with every task on one pool
    (colocated on the one device: the pipelines' two pools need two GPUs, AF609)."""
    src = ROOT / "pipelines" / pipeline
    if torch.cuda.device_count() >= 2:
        return src
    import yaml

    doc = yaml.safe_load(src.read_text())
    doc["pools"] = {"gpu": {"devices": 1}}
    for task in doc["tasks"].values():
        if "pool" in task:
            task["pool"] = "gpu"
    out = tmp_path / pipeline
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def _run(tmp_path, pipeline: str, *args: str, timeout: float = 600):
    cmd = [sys.executable, "-m", "asyncflow.cli", "run", str(_fit(tmp_path, pipeline)),
           "--out", str(tmp_path / "run"), "--quiet", "--device-kind", "gpu", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "torch sees no CUDA device" not in r.stderr  # no fallback to the CPU
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    workers = json.loads((tmp_path / "run" / "workers.json").read_text())
    return r, rows, workers


@pytest.mark.parametrize("backend", ["ray", "local"])
def test_main_job_in_bfloat16_on_the_gpu(tmp_path, backend):
    _, rows, workers = _run(tmp_path, "grpo_digits.yaml", "--backend", backend, "--steps", "20",
                            "--set", "models.policy.dtype=bfloat16")
    assert len([r for r in rows if "reward_mean" in r]) == 20
    for wid in ("generate/0", "ref/0", "update/0"):
        assert str(workers[wid]["device"]).startswith("cuda"), workers[wid]
    if backend == "ray":  # Ray's GPU ids: the colocated generate and ref share one
        assert workers["generate/0"]["gpus"] == workers["ref/0"]["gpus"] and workers["generate/0"]["gpus"]
        if torch.cuda.device_count() == 1:  # and on one GPU, the trainer too
            assert workers["update/0"]["gpus"] == workers["generate/0"]["gpus"]
    final = json.loads((tmp_path / "run" / "final" / "policy" / "asyncflow_export.json").read_text())
    assert final["dtype"] == "bfloat16"
    if backend == "ray":  # the weights went through the collective (gloo: one GPU, or NCCL)
        assert sum(r.get("sync_bytes", 0) for r in rows) > 0


def test_weight_sync_benchmark_on_the_gpu(tmp_path):
    """benchmarks/weight_sync.py with both ends' weights on the GPU: every method leaves the
    rollout's weights equal to the trainer's (exit 0); the table is in the output."""
    out = tmp_path / "ws.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "weight_sync.py"), "--device",
                        "cuda", "--sizes", "1", "10", "--syncs", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert all(row["rollout_equals_trainer"] for row in rows) and len(rows) == 12


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="needs exactly one GPU")
def test_pools_that_need_more_gpus_than_the_machine_has(tmp_path):
    """Two pools of one GPU each on a machine of one, without Ray: AF609 at the pool that runs
    out (not a worker placed on cuda:1 quietly falling back to the CPU)."""
    cmd = [sys.executable, "-m", "asyncflow.cli", "run", str(ROOT / "pipelines" / "grpo_digits.yaml"),
           "--out", str(tmp_path / "run"), "--quiet", "--device-kind", "gpu", "--backend", "local",
           "--steps", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    assert "AF609 the pools need 2 GPU in all, and pool 'train' is where this machine's 1 run out" \
        in r.stderr + r.stdout, r.stderr[-3000:]


def test_lora_on_the_gpu(tmp_path):
    pytest.importorskip("peft")
    _, rows, workers = _run(tmp_path, "grpo_digits.yaml", "--steps", "10",
                            "--set", "models.policy.lora={r: 8}")
    assert str(workers["update/0"]["device"]).startswith("cuda")
    assert (tmp_path / "run" / "final" / "policy" / "adapter" / "adapter_config.json").exists()


@pytest.mark.deepspeed
def test_deepspeed_trainer_on_nccl(tmp_path):
    pytest.importorskip("deepspeed")
    _, rows, workers = _run(tmp_path, "grpo_digits_deepspeed.yaml", "--steps", "10")
    assert str(workers["update/0"]["device"]).startswith("cuda")


@pytest.mark.vllm
def test_vllm_rollout_on_the_gpu(tmp_path):
    pytest.importorskip("vllm")
    _, rows, workers = _run(tmp_path, "grpo_digits_vllm.yaml", "--steps", "10")
    assert len([r for r in rows if "reward_mean" in r]) == 10


def test_your_model_on_the_gpu(tmp_path):
    """examples/your_model on the GPU, as a user brings it: a BPE chat checkpoint and chat data,
    bfloat16, top_k sampling that stops at the template's turn end, LoRA on the learner, eval,
    then ``export --dtype float16`` that loads with transformers on ``cuda`` and samples."""
    import shutil

    import yaml

    pytest.importorskip("peft")
    ex = tmp_path / "your_model"
    shutil.copytree(ROOT / "examples" / "your_model", ex,
                    ignore=shutil.ignore_patterns("ckpt", "data", "__pycache__"))
    r = subprocess.run([sys.executable, "make_model.py"], cwd=ex, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = yaml.safe_load((ex / "pipeline.yaml").read_text())
    if torch.cuda.device_count() < 2:  # its two pools need two GPUs: everything on one
        doc["pools"] = {"gpu": {"devices": 1}}
        for task in doc["tasks"].values():
            if "pool" in task:
                task["pool"] = "gpu"
    doc["models"]["actor"]["dtype"] = "bfloat16"
    doc["models"]["actor"]["lora"] = {"r": 8}
    doc["tasks"]["sampler"]["args"]["top_k"] = 20
    doc["eval"]["every"] = 2
    (ex / "pipeline.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    out = tmp_path / "run"
    cli = [sys.executable, "-m", "asyncflow.cli"]
    r = subprocess.run([*cli, "run", str(ex / "pipeline.yaml"), "--out", str(out), "--quiet",
                        "--device-kind", "gpu", "--steps", "4", "--log-samples", "1"],
                       capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "torch sees no CUDA device" not in r.stderr
    workers = json.loads((out / "workers.json").read_text())
    assert all(str(workers[w]["device"]).startswith("cuda") for w in ("sampler/0", "learner/0"))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len([x for x in rows if "reward_mean" in x]) == 4
    assert [x["eval/version"] for x in rows if "eval/score" in x][:1] == [0]
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and samples[0]["prompt"].endswith("<|im_start|>assistant\n")
    assert all("<|im_end|>" not in s["completion"] for s in samples if isinstance(s.get("completion"), str))
    r = subprocess.run([*cli, "export", str(out), "-o", str(tmp_path / "served"), "--dtype",
                        "float16"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    served = tmp_path / "served" / "actor"
    tok = AutoTokenizer.from_pretrained(served)
    model = AutoModelForCausalLM.from_pretrained(served).to("cuda")
    assert model.dtype == torch.float16
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True).to("cuda")
    with torch.no_grad():
        gen = model.generate(**ids, do_sample=True, top_k=20, max_new_tokens=4,
                             pad_token_id=tok.pad_token_id)
    assert 1 <= gen.shape[1] - ids["input_ids"].shape[1] <= 4
