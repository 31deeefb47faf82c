"""Chat prompts and real tokenizers: a list of {role, content} messages is rendered with the
tokenizer's chat template and the generation prompt (no doubled BOS), a string is used as is,
responses end at EOS and decode without special tokens; the text the model saw rides on the
response (Text.prompt_text); a run on a user's checkpoint directory with chat data works from
another working directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow.models import CharTokenizer, PromptError, encode_prompt

ROOT = Path(__file__).resolve().parent.parent
MSGS = [{"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    import tiny_hf

    return tiny_hf.model_dir(tmp_path_factory.mktemp("m") / "tiny-chat")


@pytest.mark.engine
def test_chat_and_string_prompts_encode_as_trl_does(chat_dir, tmp_path):
    import tiny_hf
    from asyncflow import models

    tok = models.from_directory(str(chat_dir)).tokenizer
    ids, text = tok.encode_prompt(MSGS)
    want = tok.tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False)
    assert text == want and text.endswith("<|assistant|>")
    assert ids == tok.tok.encode(want, add_special_tokens=False)
    assert ids[0] == tok.bos_id and ids[1] != tok.bos_id  # the template's BOS, only once
    ids, text = tok.encode_prompt("What is 2+3?")  # a string: the tokenizer's own specials
    assert text == "What is 2+3?" and ids == tok.tok.encode(text) and ids.count(tok.bos_id) == 1
    assert tok.decode(ids + [tok.eos_id]) == "What is 2+3?"
    plain = models.from_directory(str(tiny_hf.model_dir(tmp_path / "plain", chat_template=None)))
    with pytest.raises(PromptError) as e:
        plain.tokenizer.encode_prompt(MSGS)
    assert e.value.code == "AF651"


def test_char_tokenizer_prompts():
    tok = CharTokenizer()
    assert encode_prompt(tok, "1+2=") == ([tok.bos_id] + tok.encode("1+2="), "1+2=")
    for bad, code in ((MSGS, "AF651"), ([{"text": "no role"}], "AF652"), ({"a": 1}, "AF652")):
        with pytest.raises(PromptError) as e:
            encode_prompt(tok, bad)
        assert e.value.code == code


def _spec(model_dir_or_factory: str, kind: str = "rollout", args=None, **extra):
    from asyncflow.engines.base import EngineSpec

    return EngineSpec(task="sampler", kind=kind, model={"name": "actor", "init": model_dir_or_factory,
                                                      "args": {}, "loc": "p.yaml:3:11"},
                      args={"max_new_tokens": 4, **(args or {})}, outputs=("response", "logprobs"),
                      extra={"task_loc": "p.yaml:9:3", **extra})


@pytest.mark.engine
def test_hf_engine_renders_chats_and_keeps_the_text_it_saw(chat_dir):
    from asyncflow.engines.hf import HFEngine
    from asyncflow.runtime.contract import TaskError

    eng = HFEngine(_spec(str(chat_dir)))
    out = eng.generate({"prompt": [MSGS, "What is 4+4?"]})
    r0, r1 = out["response"]
    assert r0.prompt_text.endswith("<|assistant|>") and r0.prompt_text.startswith("<s><|system|>")
    assert r1.prompt_text == "What is 4+4?"
    tok = eng.tokenizer
    for r in (r0, r1):
        assert list(r.prompt_ids) == tok.encode_prompt(MSGS if r is r0 else "What is 4+4?")[0]
        eos = tok.eos_id
        assert eos not in r.ids[:-1]  # a response ends at its first EOS
        assert str(r) == tok.decode([t for t in r.ids if t != eos])
        assert "</s>" not in str(r) and "<s>" not in str(r)
    import pickle

    assert pickle.loads(pickle.dumps(r0)).prompt_text == r0.prompt_text
    # a chat for a tokenizer without a template (here a factory's character tokenizer): AF651
    eng = HFEngine(_spec("asyncflow.models:tiny_decoder"))
    with pytest.raises(TaskError) as e:
        eng.generate({"prompt": [MSGS]})
    assert e.value.code == "AF651" and e.value.loc == "p.yaml:3:11"


PIPE = """\
pipeline: chat_run
models:
  actor: {init: ckpt/tiny-chat}
  anchor: {copy_of: actor, frozen: true}
data:
  train: {source: data/train.jsonl, fields: [messages, gold]}
pools:
  gen: {devices: 1}
step: {prompts_per_step: 2, samples_per_prompt: 2, steps: 2}
tasks:
  sampler: {kind: rollout, engine: hf, model: actor, pool: gen, inputs: [messages],
            outputs: [completion, lp], args: {max_new_tokens: 4}}
  judge: {kind: reward, fn: "grader:grade", inputs: [messages, gold, completion], outputs: [score]}
  anchor_lp: {kind: logprob, engine: hf, model: anchor, pool: gen, inputs: [messages, completion],
              outputs: [frozen_lp]}
  baseline: {kind: advantage, estimator: grpo, inputs: [score], outputs: [adv]}
  learner: {kind: train, engine: hf, model: actor, pool: gen, loss: grpo,
            inputs: [messages, completion, lp, frozen_lp, adv], args: {lr: 1.0e-3}}
sync:
  - {from: learner, to: sampler, max_staleness: 0}
"""

GRADER = """\
import json  # the real one: json.py beside this file must not shadow it


def grade(messages, gold, completion):
    assert isinstance(messages, list) and messages[-1]["role"] == "user", messages
    assert isinstance(completion, str)
    return float(json.loads("1.0") if gold in completion else 0.0)
"""


@pytest.mark.engine
def test_run_a_checkpoint_directory_with_chat_data_from_another_directory(chat_dir, tmp_path):
    import shutil

    proj, cwd = tmp_path / "project", tmp_path / "elsewhere"
    (proj / "data").mkdir(parents=True)
    cwd.mkdir()
    shutil.copytree(chat_dir, proj / "ckpt" / "tiny-chat")
    rows = [{"messages": [{"role": "user", "content": f"What is {a}+{a}?"}], "gold": str(2 * a)}
            for a in range(1, 9)]
    (proj / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (proj / "pipeline.yaml").write_text(PIPE)
    (proj / "grader.py").write_text(GRADER)
    (proj / "json.py").write_text("raise ImportError('shadowed')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "asyncflow.cli", "check", "../project/pipeline.yaml"],
                       cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "model actor: directory" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "asyncflow.cli", "run", "../project/pipeline.yaml",
                        "--backend", "local", "--out", str(tmp_path / "run")],
                       cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in metrics if "step" in m]) >= 2


@pytest.mark.engine
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_chat_data_for_a_factory_model_without_a_template_stops_at_start_up(tmp_path, backend):
    """``check`` cannot read a module:factory model's tokenizer, so the run finds it: every
    engine encodes the data's first prompt once at start-up, and a chat for the character
    tokenizer is AF651 located at the model's init, before any step (nothing in metrics.jsonl)."""
    (tmp_path / "data").mkdir()
    rows = [{"messages": [{"role": "user", "content": f"What is {a}+{a}?"}], "gold": str(2 * a)}
            for a in range(1, 9)]
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "pipeline.yaml").write_text(
        PIPE.replace("{init: ckpt/tiny-chat}", "{init: asyncflow.models:tiny_decoder}"))
    (tmp_path / "grader.py").write_text(GRADER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "asyncflow.cli", "run", "pipeline.yaml", "--backend",
                        backend, "--out", str(tmp_path / "run")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "pipeline.yaml:3:17: AF651" in out and "Traceback" not in out, out[-3000:]
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()


@pytest.mark.engine
def test_check_renders_as_transformers_and_finds_characters_the_tokenizer_cannot_encode(tmp_path):
    """``check`` spells the first prompt back through the tokenizer's files (tokenizers and
    jinja2, no transformers): the text is what transformers' chat template renders, and a
    tokenizer trained without the byte alphabet, which would turn "[user]" into "use" and drop
    "W" from the prompts, is AF348 at the data field -- not a model that silently reads less."""
    import tiny_hf
    from transformers import AutoTokenizer

    from asyncflow.modelsrc import spell_back

    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    good = tiny_hf.model_dir(tmp_path / "proj" / "ckpt" / "good")
    narrow = tiny_hf.model_dir(tmp_path / "proj" / "ckpt" / "tiny-chat", chat_template=template,
                               texts=["what is 2+3? 5", "user assistant"] * 10, full_alphabet=False)
    for d in (good, narrow):
        text, _ = spell_back(str(d), MSGS)
        assert text == AutoTokenizer.from_pretrained(str(d)).apply_chat_template(
            MSGS, add_generation_prompt=True, tokenize=False)
    assert spell_back(str(good), MSGS)[1] == spell_back(str(good), MSGS)[0]
    (tmp_path / "proj" / "data").mkdir()
    rows = [{"messages": [{"role": "user", "content": f"What is {a}+{a}?"}], "gold": str(2 * a)}
            for a in range(1, 9)]
    (tmp_path / "proj" / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "proj" / "pipeline.yaml").write_text(PIPE)
    (tmp_path / "proj" / "grader.py").write_text(GRADER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "asyncflow.cli", "check", "pipeline.yaml"],
                       cwd=tmp_path / "proj", env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "pipeline.yaml:6:46: AF348" in out, out
    assert "'1', 'W', '[', ']'" in out and "Traceback" not in out, out


@pytest.mark.engine
def test_a_factory_tokenizer_that_cannot_encode_the_prompt_stops_the_run_at_start_up(tmp_path):
    """``check`` cannot read a module:factory model's tokenizer: the engine spells the data's
    first prompt back at start-up, and a character the character tokenizer lacks ("é") is
    AF655 at the model's init before any step."""
    rows = [{"question": f"Combien font {a}+{a}? Réponds.", "gold": str(2 * a)}
            for a in range(1, 9)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pipe = (PIPE.replace("{init: ckpt/tiny-chat}", "{init: asyncflow.models:tiny_decoder}")
            .replace("data/train.jsonl, fields: [messages, gold]", "train.jsonl, fields: [question, gold]")
            .replace("[messages", "[question"))
    (tmp_path / "pipeline.yaml").write_text(pipe)
    (tmp_path / "grader.py").write_text("def grade(question, gold, completion):\n    return 0.0\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "asyncflow.cli", "run", "pipeline.yaml", "--backend",
                        "local", "--out", str(tmp_path / "run")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "pipeline.yaml:3:17: AF655" in out, out[-3000:]
    assert "'é'" in out and "Traceback" not in out, out[-3000:]
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()


@pytest.mark.engine
def test_check_reads_a_parquet_first_row_and_finds_a_chat_the_template_refuses(tmp_path):
    """A template that refuses system messages (its raise_exception, as Gemma's does) and
    parquet chat data with a system message first: AF349 at ``check`` on the data field, with
    the template's own words; the same prompt through the engine's tokenizer is AF656."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    import tiny_hf

    from asyncflow import models

    strict = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
              "{{ raise_exception('System role not supported') }}{% endif %}"
              "<|user|>{{ m['content'] }}<|end|>{% endfor %}")
    tiny_hf.model_dir(tmp_path / "ckpt" / "tiny-chat", chat_template=strict)
    (tmp_path / "data").mkdir()
    rows = [{"messages": MSGS, "gold": "5"}] * 4
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data" / "train.parquet")
    (tmp_path / "pipeline.yaml").write_text(PIPE.replace("train.jsonl", "train.parquet"))
    (tmp_path / "grader.py").write_text(GRADER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "asyncflow.cli", "check", "pipeline.yaml"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "pipeline.yaml:6:48: AF349" in out, out
    assert "System role not supported" in out and "Traceback" not in out, out
    tok = models.from_directory(str(tmp_path / "ckpt" / "tiny-chat")).tokenizer
    with pytest.raises(models.PromptError) as e:
        tok.encode_prompt(MSGS)
    assert e.value.code == "AF656" and "System role not supported" in e.value.fields["reason"]
    assert tok.encode_prompt(MSGS[1:])[1].startswith("<s><|user|>What is 2+3?")


@pytest.mark.engine
def test_a_response_ends_at_the_models_own_end_ids_not_only_the_tokenizers_eos(tmp_path,
                                                                               monkeypatch):
    """A chat model's turn often ends with a token that is not its tokenizer's EOS (Qwen2.5's
    <|im_end|>, Llama 3's <|eot_id|>), listed in generation_config.json's eos_token_id: the
    tokenizer's stop_ids hold both, and a response ends at the first -- in both hf schedules
    (batch and queue) -- keeping it in its ids and out of its text."""
    import tiny_hf
    import torch as th

    from asyncflow.engines import hf_serve
    from asyncflow.engines import torch_common as tc
    from asyncflow.engines.hf import HFEngine

    d = tiny_hf.model_dir(tmp_path / "m")
    tok = tiny_hf.bpe_tokenizer()
    eos, end = tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")
    plain = tok.encode("h", add_special_tokens=False)[0]
    cfg = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**cfg, "eos_token_id": [eos, end]}))
    steps = []

    def fake(logits, *a, **k):  # the first token is plain, every later one <|end|>
        n = logits.shape[0]
        steps.append(n)
        t = th.full((n,), plain if len(steps) == 1 else end, dtype=th.long)
        return t, th.zeros(n)

    monkeypatch.setattr(tc, "sample", fake)
    eng = HFEngine(_spec(str(d), args={"max_new_tokens": 6}))
    assert eng.tokenizer.stop_ids == (eos, end)
    out = eng.generate({"prompt": [MSGS, "What is 4+4?"]})
    for r in out["response"]:
        assert list(r.ids) == [plain, end] and str(r) == "h", (r.ids, str(r))
    assert [len(x) for x in out["logprobs"]] == [2, 2] and len(steps) == 2  # stopped at <|end|>
    monkeypatch.setattr(hf_serve, "sample_rows", lambda logits, *a, **k: (
        th.full((logits.shape[0],), end, dtype=th.long), th.zeros(logits.shape[0])))
    eng = HFEngine(_spec(str(d), args={"max_new_tokens": 6}))
    got, fed = [], []

    def pull(k):
        if fed:
            return None
        fed.append(1)
        return {"prompt": [MSGS], "_row": [0]}

    eng.serve(pull, got.append)
    assert [list(r["response"].ids) for r in got] == [[end]] and str(got[0]["response"]) == ""


def test_a_prompt_longer_than_the_model_takes_is_af657_or_keeps_its_last_tokens():
    """A rollout's prompt may have the model's positions less the longest response
    (max_new_tokens: a number, or a distribution's max), or max_prompt_tokens: longer is AF657
    at the task, or with prompt_overflow: left its last tokens (the text what they spell)."""
    from types import SimpleNamespace

    from asyncflow import models
    from asyncflow.engines.hf_serve import length_spec
    from asyncflow.runtime.contract import TaskError

    def engine(positions=None, new=8, **args):
        return SimpleNamespace(spec=_spec("asyncflow.models:tiny_decoder"), args=args,
                               tokenizer=models.CharTokenizer(), max_positions=positions,
                               length_dist=length_spec(new))

    prompt = "What is 12+34?"  # <bos> + 14 characters: 15 ids
    assert len(models.model_prompt(engine(23), prompt)[0]) == 15  # 23 - 8 = 15: fits
    with pytest.raises(TaskError) as e:
        models.model_prompt(engine(22), prompt)
    assert e.value.code == "AF657" and e.value.loc == "p.yaml:9:3"
    assert e.value.fields["n"] == 15 and e.value.fields["limit"] == 14
    assert e.value.fields["why"] == "the model's 22 positions less max_new_tokens 8"
    ids, text = models.model_prompt(engine(22, prompt_overflow="left"), prompt)
    assert len(ids) == 14 and text == prompt  # the <bos> went first
    ids, text = models.model_prompt(engine(100, max_prompt_tokens=5, prompt_overflow="left"), prompt)
    assert text == "2+34?"
    dist = {"dist": "lognormal", "median": 4, "sigma": 1.0, "max": 30}
    with pytest.raises(TaskError):  # the longest response a distribution allows
        models.model_prompt(engine(40, new=dist), prompt)
    assert models.model_prompt(engine(None), prompt)[1] == prompt  # no limit known: as it is
    with pytest.raises(TaskError):
        models.model_prompt(engine(None, max_prompt_tokens=10), prompt)


@pytest.mark.engine
def test_a_token_added_to_the_tokenizer_but_not_to_the_model_is_af658(tmp_path):
    """A special token added to a user's tokenizer after the model was saved, the embeddings
    never resized: a prompt holding it is AF658 at the model (it was an IndexError in the
    embedding lookup)."""
    import tiny_hf
    from transformers import AutoTokenizer

    from asyncflow.engines.hf import HFEngine
    from asyncflow.runtime.contract import TaskError

    d = tiny_hf.model_dir(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(str(d))
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tok.save_pretrained(str(d))
    eng = HFEngine(_spec(str(d)))
    assert eng.generate({"prompt": ["What is 2+3?"]})["response"][0] is not None
    with pytest.raises(TaskError) as e:
        eng.generate({"prompt": ["What is 2+3? <|tool|>"]})
    assert e.value.code == "AF658" and e.value.loc == "p.yaml:3:11"
    assert e.value.fields["rows"] == len(tok) - 1 and e.value.fields["id"] == len(tok) - 1


def test_the_round_trip_names_lost_characters_and_forgives_normalisation():
    from asyncflow.prompts import lost_spans, round_trip_error

    assert lost_spans("<s>[user] Hi", "<s>use Hi") == [("[", ""), ("r]", "")]
    e = round_trip_error("<s>[user] Hi", "<s>use Hi")
    assert e.code == "AF655" and e.fields["chars"] == "'[', ']', 'r'"
    assert round_trip_error("a  b\n", "a b") is None  # white space only
    assert round_trip_error("\uff71\uff72 \ufb01", "\u30a2\u30a4 fi") is None  # NFKC forms
    assert round_trip_error("Caf\u00e9", "Caf?") is not None
