"""Your trained model out (asyncflow.runtime.export, asyncflow export, --keep-checkpoints).

One tiny ``--backend local`` run of pipelines/grpo_digits.yaml (3 steps, a checkpoint every step,
``--keep-checkpoints 1``) is shared by the engine tests: its ``final/policy`` must load with
transformers and hold exactly the weights of the trainer's last published version; ``asyncflow
export`` must write a checkpoint's weights in the model's dtype; the README's lines must run on
the export as written. The error cases of ``asyncflow export`` are AF660-AF664, never a
traceback. One Ray run (the default backend; the shipped pipeline's run that
test_trace_vs_plan.py checks too, tests/shared_runs.py) checks ``final/`` and the summary line.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import shared_runs
from shared_runs import shipped_run

from asyncflow import hfdir
from asyncflow.runtime import checkpoint, export

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
PIPELINE = os.path.join(ROOT, "pipelines", "grpo_digits.yaml")
STEPS = 3
SETS = [
    "step.prompts_per_step=2", "step.samples_per_prompt=4",
    "models.policy.args.layers=1", "models.policy.args.hidden=16",
    "data.prompts.args.n=64", "tasks.generate.args.max_new_tokens=4",
    "tasks.update.args.micro_batch=4",
    # shaped reward: all-zero advantages would leave the weights at their initial values
    "tasks.score.args.partial=true",
]


_cli = shared_runs.cli  # asyncflow ARGS in this process


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished local run: (run dir, the newest published policy state dict, RunResult)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from asyncflow.compiler.pipeline import compile_file
    from asyncflow.runtime.driver import Driver

    out = str(tmp_path_factory.mktemp("export") / "run")
    plan = compile_file(PIPELINE, sets=SETS)
    driver = Driver(plan, "local", out_dir=out, steps=STEPS, checkpoint_every=1,
                    keep_checkpoints=1)
    result = driver.run()
    version, weights = _published(driver)
    assert version == STEPS
    return out, weights, result


def _published(driver) -> tuple[int, dict]:
    """The newest version of the policy on the board, and its weights: in the board's entry
    (via: store) or served by the trainer's collective endpoint (via: collective)."""
    version, box = driver.control.board.newer({"policy": 0})["policy"]
    if "store" in box[0]:
        return version, box[0]["store"]
    trainer = next(w for w in driver.backend.workers.values() if w.publisher is not None)
    served, weights = trainer.publisher.latest("policy")
    assert served == version
    return version, weights


def _weights(directory: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, hfdir.WEIGHTS))


# ------------------------------------------------------------------ the final export
@pytest.mark.engine
def test_final_export_has_the_last_published_weights(run):
    import torch
    from transformers import AutoModelForCausalLM

    out, published, result = run
    final = os.path.join(out, "final", "policy")
    assert result.exports == {"policy": {"dir": final, "dtype": "float32"}}
    info = json.load(open(os.path.join(final, export.INFO)))
    assert (info["model"], info["task"], info["version"], info["dtype"]) == \
        ("policy", "update", STEPS, "float32")
    assert not [n for n in os.listdir(os.path.join(out, "final")) if n.startswith(".")]
    model = AutoModelForCausalLM.from_pretrained(final)
    state = model.state_dict()
    assert set(published) <= set(state)
    for name, t in published.items():
        assert torch.equal(state[name], t), name
    # the training moved the weights: the export is not the initial model
    from asyncflow.models import tiny_decoder

    init = tiny_decoder(layers=1, hidden=16)[0].state_dict()
    assert any(not torch.equal(init[k], published[k]) for k in published)
    # tied embeddings are stored once
    assert "lm_head.weight" not in _weights(final)


@pytest.mark.engine
def test_final_export_tokenizer_loads_and_matches_the_run(run):
    from transformers import AutoTokenizer

    from asyncflow.models import CharTokenizer

    out, _, _ = run
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "final", "policy"))
    char = CharTokenizer()
    text = "12+34="
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    assert [i for i in tok(text)["input_ids"] if i != char.bos_id] == char.encode(text)
    assert tok.eos_token_id == char.eos_id


@pytest.mark.engine
def test_readme_lines_load_and_sample(run, capsys):
    """The README's lines, as written there, on this run's export."""
    out, _, _ = run
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = readme[readme.index("### Your trained model"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "AutoTokenizer.from_pretrained" in code and ".generate(" in code
    final = os.path.join(out, "final", "policy")
    code = code.replace("runs/grpo_digits/final/policy", final)
    assert final in code
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.startswith("12+34=")  # the prompt, then the sampled continuation


# ------------------------------------------------------------------ --keep-checkpoints
@pytest.mark.engine
def test_keep_checkpoints_keeps_the_newest(run):
    out, _, _ = run
    names = sorted(os.listdir(checkpoint.root(out)))
    # checkpoints after steps 1 and 2 (none after the last); step_1 deleted once step_2 closed
    assert names == ["step_2"]
    assert checkpoint.latest(out) is not None


def _fake_ckpt(run_dir: str, n: int, whole: bool = True) -> str:
    d = os.path.join(checkpoint.root(run_dir), f"step_{n}")
    os.makedirs(os.path.join(d, "engines", "update_0"))
    with open(os.path.join(d, "engines", "update_0", "w"), "w") as f:
        f.write("x")
    if whole:
        with open(os.path.join(d, checkpoint.STATE_FILE), "w") as f:
            json.dump({"version": n}, f)
    return d


def test_prune_counts_only_complete_checkpoints(tmp_path):
    run_dir = str(tmp_path)
    for n in (1, 2, 3):
        _fake_ckpt(run_dir, n)
    _fake_ckpt(run_dir, 4, whole=False)  # unreadable: resume would skip it
    gone = checkpoint.prune(run_dir, 2)
    assert [os.path.basename(g) for g in gone] == ["step_1"]
    assert sorted(os.listdir(checkpoint.root(run_dir))) == ["step_2", "step_3", "step_4"]
    checkpoint.prune(run_dir, 1)
    # the newest complete one (what resume takes) stays, and so does the unreadable one
    assert sorted(os.listdir(checkpoint.root(run_dir))) == ["step_3", "step_4"]
    assert checkpoint.latest(run_dir).endswith("step_3")


def test_keep_checkpoints_needs_checkpoint_every(capsys, tmp_path):
    rc, text = _cli(capsys, "run", PIPELINE, "--backend", "local", "--keep-checkpoints", "2",
                    "--out", str(tmp_path / "r"))
    assert rc == 2 and "--keep-checkpoints needs --checkpoint-every" in text
    rc, _ = _cli(capsys, "run", PIPELINE, "--backend", "local", "--checkpoint-every", "1",
                 "--keep-checkpoints", "0", "--out", str(tmp_path / "r"))
    assert rc == 2
    assert not os.path.exists(tmp_path / "r" / "plan.json")


# ------------------------------------------------------------------ asyncflow export
@pytest.mark.engine
def test_export_from_a_checkpoint(run, capsys, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _, _ = run
    dst = str(tmp_path / "e")
    rc, text = _cli(capsys, "export", out, "--step", "2", "-o", dst)
    assert rc == 0, text
    assert f"exported policy (step 2, checkpoint step_2, float32): {dst}/policy" in text
    got = os.path.join(dst, "policy")
    assert not {"engine_state.pt"} & set(os.listdir(got))
    ck_dir = checkpoint.engine_dir(os.path.join(checkpoint.root(out), "step_2"), "update/0")
    saved = torch.load(os.path.join(ck_dir, "engine_state.pt"), weights_only=True)["weights"]
    state = AutoModelForCausalLM.from_pretrained(got).state_dict()
    for name, t in saved.items():
        assert torch.equal(state[name], t), name
    AutoTokenizer.from_pretrained(got)
    assert json.load(open(os.path.join(got, export.INFO)))["checkpoint"] == "step_2"


@pytest.mark.engine
def test_export_default_is_the_final_one_and_never_overwrites(run, capsys):
    import torch

    out, published, _ = run
    rc, text = _cli(capsys, "export", out)
    assert rc == 0, text
    dst = os.path.join(out, "export", f"step_{STEPS}", "policy")
    assert f"(step {STEPS}, final export, float32): {dst}" in text
    w = _weights(dst)
    assert torch.equal(w["model.norm.weight"], published["model.norm.weight"])
    rc, text = _cli(capsys, "export", out)
    assert rc == 2 and "AF663" in text and "--force" in text
    rc, text = _cli(capsys, "export", out, "--force")
    assert rc == 0, text


@pytest.mark.engine
def test_export_casts_to_the_model_dtype(run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out, _, _ = run
    src = checkpoint.engine_dir(os.path.join(checkpoint.root(out), "step_2"), "update/0")
    dst = str(tmp_path / "bf16")
    export.from_checkpoint(src, dst, "bfloat16", {"model": "policy"})
    cfg = json.load(open(os.path.join(dst, "config.json")))
    assert cfg["dtype"] == "bfloat16"
    w32, w16 = _weights(src), _weights(dst)
    assert all(t.dtype == torch.bfloat16 for t in w16.values())
    assert torch.equal(w16["model.norm.weight"], w32["model.norm.weight"].to(torch.bfloat16))
    model = AutoModelForCausalLM.from_pretrained(dst)
    assert model.dtype == torch.bfloat16


@pytest.mark.engine
def test_export_dtype_option_casts_the_final_export_and_a_checkpoint(run, capsys, tmp_path):
    """``asyncflow export --dtype bfloat16``: a model trained in float32 written in bfloat16,
    from the final export and from a checkpoint; the run's own final/ stays float32."""
    import torch
    from transformers import AutoModelForCausalLM

    out, published, _ = run
    for args, where in ((), "final export"), (("--step", "2"), "checkpoint step_2"):
        dst = str(tmp_path / f"bf16{len(args)}")
        rc, text = _cli(capsys, "export", out, "-o", dst, "--dtype", "bfloat16", *args)
        assert rc == 0, text
        assert f"({where}, bfloat16): {dst}/policy" in text.replace(f"step {STEPS}, ", "").replace(
            "step 2, ", "")
        got = os.path.join(dst, "policy")
        assert all(t.dtype == torch.bfloat16 for t in _weights(got).values())
        assert json.load(open(os.path.join(got, "config.json")))["dtype"] == "bfloat16"
        assert json.load(open(os.path.join(got, export.INFO)))["dtype"] == "bfloat16"
        assert AutoModelForCausalLM.from_pretrained(got).dtype == torch.bfloat16
    final = _weights(os.path.join(out, "final", "policy"))
    assert final["model.norm.weight"].dtype == torch.float32
    assert torch.equal(_weights(os.path.join(str(tmp_path / "bf160"), "policy"))["model.norm.weight"],
                       published["model.norm.weight"].to(torch.bfloat16))
    rc, text = _cli(capsys, "export", out, "-o", str(tmp_path / "x"), "--dtype", "fp8")
    assert rc == 2 and "fp8" in text and "Traceback" not in text


@pytest.mark.engine
def test_write_hf_critic_and_dtype(tmp_path):
    """A critic's export: the base model in its dtype plus value_head.safetensors."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from asyncflow.models import tiny_decoder

    model, tok = tiny_decoder(layers=1, hidden=16)
    head = torch.nn.Linear(16, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    d = str(tmp_path / "critic")
    hfdir.write_hf(d, model, tok, "float16", value_head=head)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched
    assert model.dtype == torch.float32
    got = load_file(os.path.join(d, export.VALUE_HEAD_FILE))
    assert got["weight"].shape == (1, 16) and got["weight"].dtype == torch.float16
    loaded = AutoModelForCausalLM.from_pretrained(d)
    assert loaded.dtype == torch.float16
    assert torch.equal(loaded.state_dict()["model.norm.weight"],
                       before["model.norm.weight"].half())
    assert json.load(open(os.path.join(d, export.INFO)))["critic"] is True


@pytest.mark.engine
def test_export_errors(run, capsys, tmp_path):
    out, _, _ = run
    rc, text = _cli(capsys, "export", str(tmp_path / "nowhere"))
    assert rc == 2 and "AF660" in text and "no such directory" in text
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, text = _cli(capsys, "export", str(empty))
    assert rc == 2 and "AF660" in text
    rc, text = _cli(capsys, "export", out, "--step", "1", "-o", str(tmp_path / "x"))
    assert rc == 2 and "AF661" in text and "checkpoint steps there: 2" in text
    assert f"final export is step {STEPS}" in text
    # a checkpoint whose weights do not read back, and one whose state.json is gone
    bad = str(tmp_path / "bad")
    shutil.copytree(out, bad, ignore=shutil.ignore_patterns("final", "export"))
    ck = os.path.join(checkpoint.root(bad), "step_2")
    with open(os.path.join(checkpoint.engine_dir(ck, "update/0"), hfdir.WEIGHTS), "wb") as f:
        f.write(b"not a safetensors file")
    rc, text = _cli(capsys, "export", bad, "--step", "2")
    assert rc == 2 and "AF662" in text and "step_2" in text
    os.remove(os.path.join(ck, checkpoint.STATE_FILE))
    rc, text = _cli(capsys, "export", bad)
    assert rc == 2 and "AF662" in text and "state.json" in text
    assert "Traceback" not in text


SIM_PIPELINE = """
pipeline: simexport
models:
  policy: {init: asyncflow.models:tiny_decoder}
data:
  prompts: {source: asyncflow.datasets:digits, args: {n: 64, seed: 0}, fields: [prompt, answer]}
pools:
  rollout: {devices: 1}
  train: {devices: 1}
step: {prompts_per_step: 2, samples_per_prompt: 2, steps: 2}
tasks:
  generate: {kind: rollout, engine: sim, model: policy, pool: rollout, inputs: [prompt],
             outputs: [response, logprobs], args: {slots: 4, latency: 0.001}}
  score: {kind: reward, fn: asyncflow.rewards:digits_match, inputs: [prompt, answer, response],
          outputs: [reward]}
  advantage: {kind: advantage, estimator: grpo, inputs: [reward], outputs: [advantages]}
  update: {kind: train, engine: sim, model: policy, pool: train, loss: grpo,
           inputs: [prompt, response, logprobs, advantages],
           args: {seconds_per_sample: 0.001, micro_batch: 4}}
sync:
  - {from: update, to: generate, max_staleness: 1}
"""


def test_sim_engine_run_exports_nothing_and_export_says_why(capsys, tmp_path):
    """The sim engine writes no model: the summary says so, ``asyncflow export`` is AF664."""
    pipe = tmp_path / "p.yaml"
    pipe.write_text(SIM_PIPELINE)
    out = str(tmp_path / "run")
    rc, text = _cli(capsys, "run", str(pipe), "--backend", "local", "--steps", "2", "--quiet",
                    "--checkpoint-every", "1", "--out", out)
    assert rc == 0, text
    assert "trained model policy: not exported: engine SimEngine has no export()" in text
    assert not os.path.exists(os.path.join(out, "final", "policy"))
    rc, text = _cli(capsys, "export", out)
    assert rc == 2 and "AF664" in text and "saved no model" in text


# ------------------------------------------------------------------ the Ray backend
@pytest.mark.ray
@pytest.mark.engine
def test_ray_run_writes_final(tmp_path_factory):
    pytest.importorskip("ray")
    pytest.importorskip("transformers")
    # asyncflow run pipelines/grpo_digits.yaml --backend ray --steps 3: the run
    # test_trace_vs_plan.py holds against its plan (tests/shared_runs.py)
    run = shipped_run(tmp_path_factory, "grpo_digits.yaml", "ray").ok()
    final = os.path.join(run.out, "final", "policy")
    assert f"trained model policy: {os.path.abspath(final)} (float32)" in run.stdout
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(final)
    AutoTokenizer.from_pretrained(final)
    assert json.load(open(os.path.join(final, export.INFO)))["version"] == shared_runs.STEPS


@pytest.mark.engine
def test_a_bfloat16_model_is_exported_in_bfloat16(tmp_path):
    """``dtype: bfloat16`` on the model: final/ holds bf16 weights equal to the published ones."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncflow.compiler.pipeline import compile_file
    from asyncflow.runtime.driver import Driver

    plan = compile_file(PIPELINE, sets=SETS + ["models.policy.dtype=bfloat16"])
    driver = Driver(plan, "local", out_dir=str(tmp_path / "run"), steps=1)
    result = driver.run()
    final = result.exports["policy"]["dir"]
    assert result.exports["policy"]["dtype"] == "bfloat16"
    assert json.load(open(os.path.join(final, "config.json")))["dtype"] == "bfloat16"
    _, published = _published(driver)
    w = _weights(final)
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    for name, t in w.items():
        assert torch.equal(t, published[name].to(torch.bfloat16)), name
    assert AutoModelForCausalLM.from_pretrained(final).dtype == torch.bfloat16


@pytest.mark.engine
def test_a_run_that_fails_later_leaves_its_checkpointed_model_in_final(tmp_path):
    """final/ is refreshed at each checkpoint: a run whose reward function fails at step 3 still
    leaves the model of its last checkpoint there, loadable, with that version."""
    from asyncflow.compiler.pipeline import compile_file
    from asyncflow.errors import AsyncflowError
    from asyncflow.runtime.driver import Driver

    out = str(tmp_path / "run")
    plan = compile_file(PIPELINE, sets=SETS + ["sync.0.max_staleness=0"])
    with pytest.raises(AsyncflowError):
        Driver(plan, "local", out_dir=out, steps=5, checkpoint_every=1,
               inject=["raise@step3:score"]).run()
    final = export.finals(out)["policy"]
    info = json.load(open(os.path.join(final, export.INFO)))
    done = sorted(int(n.split("_")[1]) for n in os.listdir(checkpoint.root(out))
                  if n.startswith("step_"))
    assert done and info["version"] >= done[-1] and info["version"] < 5, (done, info["version"])
    ck = _weights(checkpoint.engine_dir(os.path.join(checkpoint.root(out), f"step_{info['version']}"),
                                        "update/0")) if info["version"] in done else None
    got = _weights(final)
    if ck is not None:  # the export holds that checkpoint's weights
        assert set(got) <= set(ck) and all((got[k] == ck[k]).all() for k in got)
