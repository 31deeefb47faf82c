"""A checkpoint that ships its own code (config.json ``auto_map``: a custom architecture, as
many hub models do): ``check`` stops it without ``trust_remote_code: true`` (AF339, at its
init), and with it the model and its tokenizer load through transformers' remote-code path, a
run trains it, and the exported model loads back the same way."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.engine

CONFIG = '''from transformers import Qwen2Config


class MineConfig(Qwen2Config):
    model_type = "mine"
'''
MODELING = '''from transformers import Qwen2ForCausalLM

from .configuration_mine import MineConfig


class MineForCausalLM(Qwen2ForCausalLM):
    config_class = MineConfig

    def mine(self):
        return "mine"
'''

PIPE = """\
pipeline: own_code
models:
  actor: {init: ckpt/mine}
data:
  train: {source: train.jsonl, fields: [question, gold]}
pools:
  gen: {devices: 1}
step: {prompts_per_step: 2, samples_per_prompt: 2, steps: 2}
tasks:
  sampler: {kind: rollout, engine: hf, model: actor, pool: gen, inputs: [question],
            outputs: [completion, lp], args: {max_new_tokens: 4}}
  judge: {kind: reward, fn: "grader:grade", inputs: [question, gold, completion], outputs: [score]}
  baseline: {kind: advantage, estimator: grpo, inputs: [score], outputs: [adv]}
  learner: {kind: train, engine: hf, model: actor, pool: gen, loss: grpo,
            inputs: [question, completion, lp, adv], args: {lr: 1.0e-3}}
sync:
  - {from: learner, to: sampler, max_staleness: 1}
"""


def own_code_checkpoint(tmp: Path) -> Path:
    """A tiny checkpoint of a class transformers does not have, saved with its code."""
    import tiny_hf

    pkg = tmp / "code" / "minepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "configuration_mine.py").write_text(CONFIG)
    (pkg / "modeling_mine.py").write_text(MODELING)
    sys.path.insert(0, str(tmp / "code"))
    try:
        conf = importlib.import_module("minepkg.configuration_mine")
        modeling = importlib.import_module("minepkg.modeling_mine")
        tok = tiny_hf.bpe_tokenizer(chat_template=None)
        conf.MineConfig.register_for_auto_class()
        modeling.MineForCausalLM.register_for_auto_class("AutoModelForCausalLM")
        cfg = conf.MineConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                              max_position_embeddings=128, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        out = tmp / "proj" / "ckpt" / "mine"
        modeling.MineForCausalLM(cfg).save_pretrained(out)
        tok.save_pretrained(out)
    finally:
        sys.path.remove(str(tmp / "code"))
        for m in ("minepkg.modeling_mine", "minepkg.configuration_mine", "minepkg"):
            sys.modules.pop(m, None)
    return out


def test_a_checkpoint_with_its_own_code_needs_trust_remote_code(tmp_path):
    ckpt = own_code_checkpoint(tmp_path)
    assert json.loads((ckpt / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
    assert (ckpt / "modeling_mine.py").is_file()
    proj = tmp_path / "proj"
    rows = [{"question": f"What is {a}+{a}?", "gold": str(2 * a)} for a in range(1, 9)]
    (proj / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (proj / "grader.py").write_text("def grade(question, gold, completion):\n"
                                    "    return float(gold in completion)\n")
    (proj / "pipeline.yaml").write_text(PIPE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules")}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "asyncflow.cli", *args], cwd=proj, env=env,
                              capture_output=True, text=True, timeout=600)

    r = cli("check", "pipeline.yaml")
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "pipeline.yaml:3:17: AF339" in out, out
    assert "AutoModelForCausalLM -> modeling_mine.MineForCausalLM" in out, out
    (proj / "pipeline.yaml").write_text(PIPE.replace("{init: ckpt/mine}",
                                                     "{init: ckpt/mine, trust_remote_code: true}"))
    r = cli("check", "pipeline.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    r = cli("run", "pipeline.yaml", "--backend", "local", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in metrics if "step" in m and "eval/n" not in m]) == 2
    final = tmp_path / "run" / "final" / "actor"
    code = ("import sys; from transformers import AutoModelForCausalLM as A;"
            f"m = A.from_pretrained({str(final)!r}, trust_remote_code=True);"
            "print(type(m).__name__, m.mine())")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "MineForCausalLM mine" in r.stdout, r.stderr[-3000:]
