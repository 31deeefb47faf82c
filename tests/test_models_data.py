"""Models, data sources, rewards, filters and environments (pure Python except the marked ones)."""
from __future__ import annotations

import json

import pytest

from asyncflow import datasets, envs, filters, rewards
from asyncflow.models import CharTokenizer

# --------------------------------------------------------------------------- tokenizer


def test_char_tokenizer_round_trip():
    tok = CharTokenizer()
    text = "12+7=19 What is 3*4? Answer: \\boxed{12}.\n"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.vocab_size == CharTokenizer.VOCAB_SIZE and max(ids) < tok.vocab_size
    assert {tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id} == {0, 1, 2, 3}


def test_char_tokenizer_specials_and_unknown():
    tok = CharTokenizer()
    assert tok.decode([tok.bos_id] + tok.encode("42") + [tok.eos_id, tok.pad_id]) == "42"
    assert tok.encode("é") == [tok.unk_id]
    assert tok.decode(tok.encode("é")) == "?"
    assert all(i < tok.vocab_size for i in tok.encode(CharTokenizer.CHARS))


# --------------------------------------------------------------------------- datasets


@pytest.mark.parametrize("task", datasets.DIGITS_TASKS)
def test_digits_deterministic_and_correct(task):
    a = datasets.digits(n=50, seed=3, task=task)
    assert a == datasets.digits(n=50, seed=3, task=task)
    assert a != datasets.digits(n=50, seed=4, task=task)
    assert len(a) == 50 and all(set(r) == {"prompt", "answer"} for r in a)
    for r in a:
        assert r["prompt"].endswith("=")
        if task == "add":
            x, y = r["prompt"][:-1].split("+")
            assert int(r["answer"]) == int(x) + int(y)
        elif task == "copy":
            assert r["prompt"] == f"copy {r['answer']}="
        else:
            assert r["prompt"] == f"rev {r['answer'][::-1]}="


def test_digits_defaults_and_bad_task():
    rows = datasets.digits(n=200)
    assert all(0 <= int(r["answer"]) <= 8 for r in rows)
    assert any(int(r["answer"]) > 8 for r in datasets.digits(n=200, max_operand=9))
    with pytest.raises(ValueError):
        datasets.digits(n=1, task="divide")


def test_math_qa_deterministic_and_answerable():
    rows = datasets.math_qa(n=40, seed=1)
    assert rows == datasets.math_qa(n=40, seed=1)
    for r in rows:
        assert "\\boxed{}" in r["prompt"]
        assert int(r["answer"]) >= 0
        assert rewards.math_answer_match(r["prompt"], r["answer"],
                                         f"so \\boxed{{{r['answer']}}}") == 1.0


def test_jsonl_loader(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "1+1=", "answer": "2", "x": 1}) + "\n\n"
                 + json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    assert datasets.jsonl(str(p))[0]["x"] == 1
    assert datasets.jsonl(str(p), fields=["prompt"]) == [{"prompt": "1+1="}, {"prompt": "2+2="}]
    with pytest.raises(ValueError, match="no field"):
        datasets.jsonl(str(p), fields=["x"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{nope\n")
    with pytest.raises(ValueError, match=":1:"):
        datasets.jsonl(str(bad))


def test_parquet_loader(tmp_path):
    import pyarrow as pa  # the `data` extra, in `dev`: this test runs in CI, it never skips
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+1="], "answer": ["2"]}), str(p))
    assert datasets.parquet(str(p)) == [{"prompt": "1+1=", "answer": "2"}]


# --------------------------------------------------------------------------- rewards


@pytest.mark.parametrize("response,expected", [
    ("19", 1.0), (" 19 ", 1.0), ("19 is it", 1.0), ("19abc", 1.0), ("19.", 1.0),
    ("190", 0.1 + 0.4 * 2 / 3),  # a longer number is not the answer
    ("18", 0.1 + 0.4 * 1 / 2), ("91", 0.1), ("x19", 0.0), ("", 0.0),
])
def test_digits_match_partial(response, expected):
    assert rewards.digits_match("12+7=", "19", response, partial=True) == pytest.approx(expected)


def test_digits_match_exact_by_default():
    assert rewards.digits_match("", "7", "7") == 1.0
    assert rewards.digits_match("", "7", " 7\n") == 1.0
    assert rewards.digits_match("", "7", "8") == 0.0
    assert rewards.digits_match("", "7", "77") == 0.0
    assert all(rewards.digits_match("", "19", r) == 0.0 for r in ["1", "199", "9", "1 9"])


@pytest.mark.parametrize("response,answer,expected", [
    ("so the total is \\boxed{42}.", "42", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{3} no wait \\boxed{4}", "4", 1.0),
    ("The answer is 1,000.", "1000", 1.0),
    ("answer: $12", "12", 1.0),
    ("#### 7", "7", 1.0),
    ("we get 3 then 5 then 8", "8", 1.0),
    ("we get 3 then 5 then 8", "5", 0.0),
    ("it is 0.50", "1/2", 1.0),
    ("50%", "50", 1.0),
    ("no numbers here", "3", 0.0),
    ("The answer is Paris.", "paris", 1.0),
    ("\\boxed{12", "12", 1.0),  # unbalanced box: falls back to the last number
])
def test_math_answer_match(response, answer, expected):
    assert rewards.math_answer_match("q", answer, response) == expected


# --------------------------------------------------------------------------- filters


def test_group_has_variance_by_group():
    groups, rewards = [0, 0, 1, 1, 2, 2], [1.0, 1.0, 0.0, 1.0, 0.5, 0.5]
    assert filters.group_has_variance(rewards, groups) == [False, False, True, True, False, False]
    assert filters.group_has_variance(rewards, groups=groups) == [False, False, True, True, False, False]
    assert filters.group_has_variance([1, 1]) == [False, False]
    assert filters.group_has_variance([0.1, 0.2]) == [True, True]
    assert filters.group_has_variance([0.1, 0.2], eps=0.5) == [False, False]


# --------------------------------------------------------------------------- envs


def test_digits_dialogue_right_answers():
    env = envs.digits_dialogue(max_turns=3)
    row = ("3+4=", "7")  # reset(prompt, answer): the rollout's inputs in declared order
    assert env.reset(*row) == "3+4="
    obs, r, done = env.step("7")
    assert not done and r == pytest.approx(1 / 3) and obs.startswith(" +")
    k = int(obs.strip()[1:-1])
    obs, r, done = env.step(str(7 + k))
    assert not done and r == pytest.approx(1 / 3)
    k2 = int(obs.strip()[1:-1])
    obs, r, done = env.step(str(7 + k + k2))
    assert done and r == pytest.approx(1 / 3)
    with pytest.raises(RuntimeError):
        env.step("0")


def test_digits_dialogue_deterministic_and_errors():
    row = ("3+4=", "7")
    a, b = envs.digits_dialogue(), envs.digits_dialogue()
    a.reset(*row), b.reset(*row)
    assert a.step("7") == b.step("7")
    env = envs.digits_dialogue(max_turns=3)
    env.reset(*row)
    assert env.step("8") == ("", 0.0, True)
    env = envs.digits_dialogue(max_turns=3, stop_on_error=False)
    env.reset(*row)
    obs, r, done = env.step("8")
    assert r == 0.0 and not done and obs.startswith(" no, 7. +")


# --------------------------------------------------------------------------- models


@pytest.mark.engine
def test_tiny_decoder_seeded_and_directory_round_trip(tmp_path):
    torch = pytest.importorskip("torch")
    from asyncflow import models

    torch.set_num_threads(1)
    before = torch.random.get_rng_state()
    m1, tok = models.tiny_decoder(layers=1, hidden=32, heads=2, seed=5)
    assert torch.equal(before, torch.random.get_rng_state())  # global RNG untouched
    m2, _ = models.tiny_decoder(layers=1, hidden=32, heads=2, seed=5)
    m3, _ = models.tiny_decoder(layers=1, hidden=32, heads=2, seed=6)
    s1, s2, s3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert not all(torch.equal(s1[k], s3[k]) for k in s1)
    assert m1.config.vocab_size == tok.vocab_size
    assert next(m1.parameters()).dtype == torch.float32

    models.save((m1, tok), str(tmp_path))
    m4, tok4 = models.load(str(tmp_path))
    assert isinstance(tok4, CharTokenizer)
    s4 = m4.state_dict()
    assert all(torch.equal(s1[k], s4[k]) for k in s1)
    with pytest.raises(ValueError):
        models.load("not-a-dir-nor-factory")
