"""LoRA (``models.<m>.lora``, asyncflow/lora.py): the trainer trains an adapter only, a sync
sends only the adapter's tensors, the rollout's outputs change once it arrives (and score
exactly as the trainer's), and a run exports the merged model and the adapter."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import shared_runs

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from asyncflow.engines.base import EngineSpec  # noqa: E402
from asyncflow.engines.hf import HFEngine  # noqa: E402

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[1]
LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
MODEL = {"name": "policy", "init": "asyncflow.models:tiny_decoder",
         "args": {"layers": 2, "hidden": 64, "heads": 2, "seed": 0}, "lora": LORA}
PROMPTS = ["3+4=", "12+7=", "copy 417=", "1="]


def engine(kind, args=None, outputs=(), loss=None, model=MODEL):
    return HFEngine(EngineSpec(task=kind, kind=kind, model=model, args={"threads": 1, **(args or {})},
                               outputs=outputs, loss=loss, seed=0))


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def test_trainer_trains_the_adapter_and_a_sync_sends_only_it():
    gen = engine("rollout", {"max_new_tokens": 6}, outputs=("response", "logprobs"))
    plain = engine("rollout", {"max_new_tokens": 6}, outputs=("response", "logprobs"),
                   model={k: v for k, v in MODEL.items() if k != "lora"})
    trainer = engine("train", {"lr": 5e-2, "micro_batch": 4}, loss="grpo")
    # before any sync the adapter is B = 0: the rollout computes what the base model does
    first = gen.generate({"prompt": PROMPTS, "_row": [0, 1, 2, 3]})
    base = plain.logprobs({"prompt": PROMPTS, "response": first["response"]})["logprobs"]
    assert max(abs(a - b) for x, y in zip(base, first["logprobs"]) for a, b in zip(x, y)) < 1e-5
    base_weights = {k: v.clone() for k, v in trainer.model.get_base_model().state_dict().items()
                    if "lora_" not in k and "base_layer" not in k}
    batch = {"prompt": PROMPTS * 2, "response": first["response"] * 2,
             "logprobs": first["logprobs"] * 2, "advantages": [1.0, -1.0, 0.5, -0.5] * 2}
    for _ in range(2):
        trainer.train_step(batch)
    sent = trainer.export_weights()
    assert sent and all("lora_" in k for k in sent)  # the adapter only
    full = sum(p.numel() * p.element_size() for p in plain.model.parameters())
    adapter = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
    assert nbytes(sent) == adapter < full / 4, (nbytes(sent), adapter, full)
    # the base weights did not move (frozen); the adapter did
    after = trainer.model.get_base_model().state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_weights.items())
    assert any(float(t.abs().max()) > 0 for k, t in sent.items() if "lora_B" in k)
    # the adapter arrives: outputs change, and the rollout scores exactly as the trainer does
    gen.update_weights(sent, trainer.version)
    rescored = gen.logprobs({"prompt": PROMPTS, "response": first["response"]})["logprobs"]
    assert max(abs(a - b) for x, y in zip(rescored, base) for a, b in zip(x, y)) > 1e-3
    scorer = engine("logprob", outputs=("lp",))
    scorer.update_weights(trainer.export_weights(), trainer.version)
    assert scorer.logprobs({"prompt": PROMPTS, "response": first["response"]})["lp"] == rescored


PIPELINE = (ROOT / "pipelines" / "grpo_digits.yaml").read_text()


_cli = shared_runs.cli  # asyncflow ARGS in this process


def test_a_lora_run_exports_the_merged_model_and_the_adapter(tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncflow.models import tiny_decoder

    p = tmp_path / "p.yaml"
    p.write_text(PIPELINE)
    # the run in this process, after the test above built LoRA engines here: peft's draws of
    # an adapter's A once interleaved with a colocated engine's seeded initialisation (threads
    # of the local backend), and the merged export was not base + adapter (diff 0.7)
    rc, text = _cli(capsys, "run", str(p), "--backend", "local", "--steps", "3",
                    "--out", str(tmp_path / "run"), "--quiet", "--checkpoint-every", "1",
                    "--set", "models.policy.lora={r: 4, alpha: 16}",
                    "--set", "step.prompts_per_step=4", "--set", "tasks.update.args.lr=0.05")
    assert rc == 0, text[-3000:]
    final = tmp_path / "run" / "final" / "policy"
    cfg = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 16
    # the merged export equals the initial model with the exported adapter applied (peft)
    merged = AutoModelForCausalLM.from_pretrained(str(final))
    tok = AutoTokenizer.from_pretrained(str(final))
    initial = tiny_decoder(layers=2, hidden=64)[0]
    ids = tok("12+34=", return_tensors="pt")
    with torch.no_grad():
        base = initial(**ids).logits
        with_adapter = PeftModel.from_pretrained(initial, str(final / "adapter"))
        a, b = merged(**ids).logits, with_adapter(**ids).logits
    diff, moved = float((a - b).abs().max()), float((a - base).abs().max())
    assert diff < 1e-4 and moved > 1e-3, (diff, moved)  # merged == base + adapter, and it trained
    # an earlier step's export, from its checkpoint, has its adapter too
    rc, text = _cli(capsys, "export", str(tmp_path / "run"), "--step", "2",
                    "-o", str(tmp_path / "step2"))
    assert rc == 0, text[-3000:]
    step2 = tmp_path / "step2" / "policy"
    assert json.loads((step2 / "adapter" / "adapter_config.json").read_text())["r"] == 4
    assert (step2 / "adapter" / "adapter_model.safetensors").read_bytes() != \
        (final / "adapter" / "adapter_model.safetensors").read_bytes()  # step 2's, not the last


def test_an_adapter_the_model_cannot_take_is_af653_naming_its_linear_layers():
    from asyncflow.errors import TaskError

    model = {**MODEL, "lora": {**LORA, "target_modules": ["qkv"]}, "loc": "p.yaml:6:11"}
    with pytest.raises(TaskError) as e:
        engine("train", {"lr": 1e-3}, loss="grpo", model=model)
    assert e.value.code == "AF653" and e.value.loc == "p.yaml:6:11"
    assert "qkv" in e.value.fields["reason"] and "q_proj" in e.value.fields["linear"]
