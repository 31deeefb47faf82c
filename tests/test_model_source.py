"""Where a model comes from (asyncflow.modelsrc): one rule for check, compile and run; dtype; a
thread-safe load; user modules that never shadow installed ones; the DSL's quoted-path hint.
A hub id is served from a temporary, pre-filled Hugging Face cache: nothing downloads."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncflow import modelsrc
from asyncflow.diagnostics import Diagnostics
from asyncflow.check import check_file

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "asyncflow.cli"]

PIPELINE = """\
pipeline: src
models:
  actor: {{init: {init}{dtype}}}
  anchor: {{copy_of: actor, frozen: true}}
data:
  train: {{source: asyncflow.datasets:digits, args: {{n: 64}}, fields: [prompt, answer]}}
pools:
  gen: {{devices: 1}}
step: {{prompts_per_step: 2, samples_per_prompt: 2, steps: 2}}
tasks:
  sampler: {{kind: rollout, engine: hf, model: actor, pool: gen, inputs: [prompt],
             outputs: [response, lp]}}
  judge: {{kind: reward, fn: asyncflow.rewards:digits_match, inputs: [prompt, answer, response],
           outputs: [score]}}
  ref: {{kind: logprob, engine: hf, model: anchor, pool: gen, inputs: [prompt, response],
         outputs: [ref_lp]}}
  adv: {{kind: advantage, estimator: grpo, inputs: [score], outputs: [advantages]}}
  learner: {{kind: train, engine: hf, model: actor, pool: gen, loss: grpo,
             inputs: [prompt, response, lp, ref_lp, advantages]}}
sync:
  - {{from: learner, to: sampler, max_staleness: 0}}
"""


def _pipeline(where: Path, init: str, dtype: str = "") -> Path:
    where.mkdir(parents=True, exist_ok=True)
    p = where / "pipeline.yaml"
    p.write_text(PIPELINE.format(init=init, dtype=f", dtype: {dtype}" if dtype else ""))
    return p


def _fake_model_dir(d: Path, template: bool = True) -> Path:
    """A model directory as check sees it (check never reads weights)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text('{"model_type": "qwen2"}')
    (d / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    if template:
        (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    return d


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _codes(path: Path) -> list:
    d = Diagnostics()
    check_file(str(path), diags=d)
    return [(x.code, x.loc.line if x.loc else None) for x in d.errors]


# -- the rule --------------------------------------------------------------------------------------
def test_locate_each_kind(tmp_path, hf_cache, monkeypatch):
    import tiny_hf

    pipe_dir, cwd = tmp_path / "project", tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    m = _fake_model_dir(pipe_dir / "ckpt" / "tiny-chat")
    _fake_model_dir(cwd / "cwd-model")
    paths = [str(pipe_dir), str(cwd)]
    assert modelsrc.locate("asyncflow.models:tiny_decoder", paths) == modelsrc.Source(
        "factory", "asyncflow.models:tiny_decoder")
    src = modelsrc.locate("ckpt/tiny-chat", paths)  # beside the pipeline, not in the CWD
    assert (src.kind, src.path) == ("directory", str(m.resolve()))
    assert modelsrc.locate("cwd-model", paths).path == str((cwd / "cwd-model").resolve())
    assert modelsrc.locate(str(m), []).path == str(m.resolve())  # absolute
    snap = tiny_hf.hub_cache(hf_cache, "acme/tiny-chat", m, refs=("main", "v1"))
    for ref in ("acme/tiny-chat", "acme/tiny-chat@v1"):
        src = modelsrc.locate(ref, paths)
        assert (src.kind, src.ref, Path(src.path)) == ("hub", ref, snap.resolve())
    with pytest.raises(modelsrc.SourceError) as e:  # offline and not cached
        modelsrc.locate("acme/other", paths)
    assert e.value.code == "AF345" and e.value.fields["cache"] == str(hf_cache)
    monkeypatch.delenv("HF_HUB_OFFLINE")  # online: resolved now, downloaded at start-up
    assert modelsrc.locate("acme/other", paths) == modelsrc.Source("hub", "acme/other", "")
    for bad, code in (("ckpt/missing", "AF342"), ("./nowhere", "AF342"),
                      (str(m / "config.json"), "AF347"), ("not a model!", "AF344")):
        with pytest.raises(modelsrc.SourceError) as e:
            modelsrc.locate(bad, paths)
        assert e.value.code == code, bad


def test_check_and_compile_agree_from_another_directory(tmp_path, hf_cache):
    """init relative to the pipeline passes check and compiles to the absolute directory, from
    any working directory; check prints where each model comes from."""
    from asyncflow.compiler import compile_file

    proj, cwd = tmp_path / "project", tmp_path / "elsewhere"
    cwd.mkdir()
    m = _fake_model_dir(proj / "ckpt" / "tiny-chat")
    p = _pipeline(proj, "ckpt/tiny-chat", dtype="bfloat16")
    r = subprocess.run([*CLI, "check", str(p)], cwd=cwd, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"model actor: directory {m.resolve()}, bfloat16" in r.stdout
    assert "model anchor: a copy of actor" in r.stdout
    old = os.getcwd()
    os.chdir(cwd)
    try:
        plan = compile_file(str(p))
    finally:
        os.chdir(old)
    actor, anchor = plan.models
    assert (actor.source_kind, actor.path, actor.dtype) == ("directory", str(m.resolve()), "bfloat16")
    assert (anchor.source_kind, anchor.path, anchor.dtype) == ("directory", str(m.resolve()), "bfloat16")
    assert actor.loc.endswith(":3:17")  # `  actor: {init: ` is 16 characters
    r = subprocess.run([*CLI, "compile", str(p)], cwd=cwd, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    assert r.returncode == 0 and "models" in r.stdout and "bfloat16" in r.stdout, r.stdout + r.stderr


def test_check_reports_an_uncached_hub_id_offline(tmp_path, hf_cache):
    p = _pipeline(tmp_path, "acme/not-cached")
    assert ("AF345", 3) in _codes(p)
    import tiny_hf

    tiny_hf.hub_cache(hf_cache, "acme/not-cached", _fake_model_dir(tmp_path / "m"))
    assert _codes(p) == []


def test_check_reports_chat_data_for_a_tokenizer_without_template(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(
        '{"msgs": [{"role": "user", "content": "2+3?"}], "answer": "5"}\n')
    _fake_model_dir(tmp_path / "ckpt" / "plain", template=False)
    _fake_model_dir(tmp_path / "ckpt" / "chat", template=True)
    text = PIPELINE.format(init="ckpt/plain", dtype="").replace(
        "{source: asyncflow.datasets:digits, args: {n: 64}, fields: [prompt, answer]}",
        "{source: data/train.jsonl, fields: [msgs, answer]}").replace("[prompt", "[msgs")
    text = text.replace("asyncflow.rewards:digits_match", "asyncflow.rewards:digits_match")
    p = tmp_path / "pipeline.yaml"
    p.write_text(text)
    assert ("AF346", 6) in _codes(p)
    p.write_text(text.replace("ckpt/plain", "ckpt/chat"))
    assert not [c for c in _codes(p) if c[0] == "AF346"]


# -- user modules never shadow installed ones -------------------------------------------------------
def test_user_modules_beside_the_pipeline_do_not_shadow_installed_ones(tmp_path):
    proj, cwd = tmp_path / "project", tmp_path / "elsewhere"
    cwd.mkdir()
    p = _pipeline(proj, "asyncflow.models:tiny_decoder")
    p.write_text(p.read_text().replace("asyncflow.rewards:digits_match", "myreward:score"))
    (proj / "myreward.py").write_text("import json\n\ndef score(prompt, answer, response):\n"
                                      "    return float(json.loads('1.0'))\n")
    for name in ("json", "tokenizers"):
        (proj / f"{name}.py").write_text("raise ImportError('the user module shadowed an installed one')\n")
    code = textwrap.dedent(f"""
        import sys
        from asyncflow.check import check_file
        from asyncflow.refs import resolve, search_path
        check_file({str(p)!r})
        paths = search_path({str(p)!r})
        fn = resolve('myreward:score', paths)
        import json, tokenizers
        assert fn('1+1', '2', '2') == 1.0
        assert 'project' not in (json.__file__ + tokenizers.__file__)
        print('ok')
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


# -- dtype, thread-safe loading, saving --------------------------------------------------------------
@pytest.mark.engine
def test_load_in_dtype_and_save_as_hf_directory(tmp_path):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import tiny_hf
    from asyncflow import models

    d = tiny_hf.model_dir(tmp_path / "m")
    m, tok = models.load_model({"init": str(d), "source_kind": "directory", "source": str(d),
                                "path": str(d), "dtype": "bfloat16"})
    assert next(m.parameters()).dtype == torch.bfloat16 and tok.chat_template
    models.save((m, tok), str(tmp_path / "out"))
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16
    assert AutoTokenizer.from_pretrained(str(tmp_path / "out")).chat_template == tiny_hf.CHAT_TEMPLATE
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).config.vocab_size == len(tok.tok)
    # the character tokenizer saves as a transformers tokenizer with the same ids
    model, char = models.tiny_decoder(layers=1, hidden=32, heads=2)
    models.save((model, char), str(tmp_path / "char"))
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "char"))
    text = "What is 12+30?\n(a) 'x' = \"y\" {z}"
    assert hf.encode(text, add_special_tokens=False) == char.encode(text)
    assert hf.encode(text) == char.encode_prompt(text)[0]  # <bos> first, as the engines see it
    assert hf.decode(char.encode(text)) == text
    assert isinstance(models.from_directory(str(tmp_path / "char")).tokenizer, models.CharTokenizer)


@pytest.mark.engine
def test_loading_from_a_directory_on_several_threads_at_once(tmp_path):
    """Colocated workers load at once; transformers' lazy imports raced without the lock
    (ImportError: cannot import name 'AutoModelForCausalLM'). A fresh process: nothing imported."""
    import tiny_hf

    d = tiny_hf.model_dir(tmp_path / "m")
    code = textwrap.dedent(f"""
        import threading
        from asyncflow import models
        errors, done = [], []
        def load():
            try:
                done.append(models.load({str(d)!r}))
            except BaseException as e:
                errors.append(repr(e))
        ts = [threading.Thread(target=load) for _ in range(4)]
        [t.start() for t in ts]; [t.join() for t in ts]
        assert not errors, errors
        assert len(done) == 4 and all(l.tokenizer.chat_template for l in done)
        print('ok')
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


# -- the DSL --------------------------------------------------------------------------------------
def test_dsl_hint_shows_the_quoted_path(tmp_path):
    p = tmp_path / "p.af"
    p.write_text("pipeline p\nmodel actor = ckpt/tiny-chat\n")
    d = Diagnostics()
    check_file(str(p), diags=d)
    (e,) = [x for x in d.errors if x.code == "AF110"]
    assert 'model actor = "ckpt/tiny-chat"' in e.hint
