"""Data as users keep it (issue 21, deliverable 3): .jsonl, .json, .parquet, a save_to_disk
directory (a Dataset, or a DatasetDict and its `split:`), a load_dataset-able directory, and a hub
data set id `org/name` with a `split:` served from a pre-filled Hugging Face cache (offline: the
network is never used). Chat-form values (lists of {role, content} messages) come back unchanged
as plain Python from every format; paths are relative to the pipeline file, whatever the CWD.
`check` reports what it can know cheaply (AF342, AF390, AF391), the run the rest (AF601, AF607).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow.check import check_file
from asyncflow.compiler.pipeline import compile_file
from asyncflow.diagnostics import Diagnostics
from asyncflow.errors import UserError
from asyncflow.runtime.data import load_prompts, load_rows

ROOT = Path(__file__).resolve().parents[1]

CHAT = [  # chat-form rows: the second message of row 1 has a key the others lack
    {"messages": [{"role": "system", "content": "Answer with a number."},
                  {"role": "user", "content": "What is 1+1?"}], "gold": "2"},
    {"messages": [{"role": "user", "content": "What is 2+2?"},
                  {"role": "assistant", "content": "4", "name": "tutor"},
                  {"role": "user", "content": "And 3+3?"}], "gold": "6"},
]
TEST = [{"messages": [{"role": "user", "content": "What is 5+5?"}], "gold": "10"}]


def _plain(v) -> bool:
    """Whether ``v`` holds only plain Python values (no numpy / arrow types)."""
    if isinstance(v, dict):
        return all(type(k) is str and _plain(x) for k, x in v.items())
    if isinstance(v, list):
        return all(_plain(x) for x in v)
    return v is None or type(v) in (str, int, float, bool)


def _pipeline(tmp_path: Path, source: str, extra: str = "") -> Path:
    """The sim pipeline in ``tmp_path/pipe/``, reading ``source`` (relative to that file)."""
    text = (ROOT / "pipelines/sim_longtail.yaml").read_text()
    text = text.replace("source: asyncflow.datasets:digits", f"source: {source}")
    text = text.replace("args: {n: 10000, seed: 0}", "args: {}" + (f"\n    {extra}" if extra else ""))
    text = re.sub(r"\bprompt\b", "messages", re.sub(r"\banswer\b", "gold", text))  # the field names
    assert source in text
    d = tmp_path / "pipe"
    d.mkdir(exist_ok=True)
    p = d / "p.yaml"
    p.write_text(text)
    return p


def _write_jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _diags(p: Path) -> list:
    diags = Diagnostics()
    check_file(str(p), diags=diags)
    return [d for d in diags.items if d.severity == "error"]


def _line(p: Path, needle: str) -> int:
    return next(i for i, x in enumerate(p.read_text().splitlines(), 1) if needle in x)


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """A private, offline Hugging Face home: nothing is downloaded, nothing lands in ~/.cache."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(home / "datasets"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return home


def _fill_hub_cache(home: Path, repo: str, files: dict[str, list]) -> None:
    """A hub data set as huggingface_hub caches a download: refs/main -> a snapshot of files."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    root = home / "hub" / ("datasets--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(sha)
    for name, rows in files.items():
        _write_jsonl(root / "snapshots" / sha / name, rows)


# -- every format, chat form unchanged -----------------------------------------------------------
def _make(kind: str, d: Path) -> tuple[str, str]:
    """Data of ``kind`` under ``d`` (the pipeline's folder); returns (source, extra keys)."""
    if kind == "jsonl":
        _write_jsonl(d / "data" / "train.jsonl", CHAT)
        return "data/train.jsonl", ""
    if kind == "json-array":
        (d / "data").mkdir(parents=True, exist_ok=True)
        (d / "data" / "train.json").write_text(json.dumps(CHAT))
        return "data/train.json", ""
    if kind == "json-lines":
        _write_jsonl(d / "data" / "train.json", CHAT)
        return "data/train.json", ""
    if kind == "parquet":
        import pyarrow as pa  # the data extra: installed wherever the tests are
        import pyarrow.parquet as pq

        (d / "data").mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(CHAT), str(d / "data" / "train.parquet"))
        return "data/train.parquet", ""
    import datasets

    if kind == "saved-dataset":
        datasets.Dataset.from_list(CHAT).save_to_disk(str(d / "saved"))
        return "saved", ""
    if kind == "saved-dict":
        datasets.DatasetDict({"train": datasets.Dataset.from_list(CHAT),
                              "test": datasets.Dataset.from_list(TEST)}).save_to_disk(str(d / "saved"))
        return "saved", "split: train"
    if kind == "data-files-dir":  # what load_dataset reads: data files named by split
        _write_jsonl(d / "chat" / "data" / "train.jsonl", CHAT)
        _write_jsonl(d / "chat" / "data" / "test.jsonl", TEST)
        return "chat", "split: train"
    raise AssertionError(kind)


KINDS = ["jsonl", "json-array", "json-lines", "parquet", "saved-dataset", "saved-dict",
         "data-files-dir"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_format_gives_the_chat_rows_unchanged(kind, tmp_path, hf_home, monkeypatch):
    source, extra = _make(kind, tmp_path / "pipe")
    p = _pipeline(tmp_path, source, extra)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # relative to the pipeline file, not the working directory
    assert _diags(p) == []
    plan = compile_file(str(p))
    rows = load_prompts(plan, warn=lambda msg: None)
    assert rows == CHAT
    assert all(_plain(r) for r in rows)
    assert load_rows(plan, "prompts") == rows


def test_hub_id_with_a_split_from_the_cache(tmp_path, hf_home):
    _fill_hub_cache(hf_home, "acme/chat-math", {"data/train.jsonl": CHAT, "data/test.jsonl": TEST})
    p = _pipeline(tmp_path, "acme/chat-math", "split: test")
    assert _diags(p) == []
    rows = load_prompts(compile_file(str(p)), warn=lambda msg: None)
    assert rows == TEST and all(_plain(r) for r in rows)
    # a slice of a split, as datasets writes it
    p = _pipeline(tmp_path, "acme/chat-math", "split: 'train[:1]'")
    assert load_prompts(compile_file(str(p)), warn=lambda msg: None) == CHAT[:1]


def test_a_second_source_is_read_by_name(tmp_path, hf_home):
    d = tmp_path / "pipe"
    _write_jsonl(d / "train.jsonl", CHAT)
    held_out = [{"question": r["messages"], "label": r["gold"]} for r in TEST]
    _write_jsonl(d / "test.jsonl", held_out)
    p = _pipeline(tmp_path, "train.jsonl")
    text = p.read_text().replace("\npools:", "\n  test:\n    source: test.jsonl\n"
                                           "    fields: [question, label]\n\npools:")
    p.write_text(text)
    plan = compile_file(str(p))  # (no task reads the second source's fields: a warning)
    assert [s.name for s in plan.data] == ["prompts", "test"]
    assert load_rows(plan, "test") == held_out
    assert load_rows(plan, "prompts") == CHAT
    with pytest.raises(Exception, match="no data source 'nope'"):
        load_rows(plan, "nope")


# -- check: what can be known without reading the data -------------------------------------------
def test_check_locates_data_mistakes(tmp_path, hf_home):
    d = tmp_path / "pipe"
    _make("saved-dict", d)
    _write_jsonl(d / "train.jsonl", CHAT)
    (d / "empty").mkdir()
    (d / "empty" / "notes.md").write_text("no data here\n")
    cases = [  # (source, extra keys, code, the text the diagnostic points at)
        ("saved", "", "AF390", "source: saved"),               # several splits, none named
        ("saved", "split: tran", "AF390", "split: tran"),    # no such split (did you mean)
        ("train.jsonl", "split: train", "AF390", "split: train"),  # a file has no splits
        ("asyncflow.datasets:digits", "split: train", "AF390", "split: train"),
        ("empty", "", "AF391", "source: empty"),               # a directory without data
        ("missing/dir/", "", "AF342", "source: missing"),      # not there
        ("acme/not-cached", "split: train", "AF342", "source: acme"),  # offline, not cached
    ]
    for source, extra, code, at in cases:
        p = _pipeline(tmp_path, source, extra)
        errs = _diags(p)
        assert [e.code for e in errs] == [code], (source, extra, [e.headline() for e in errs])
        (e,) = errs
        line = _line(p, at)
        assert (e.loc.line, e.loc.col) == (line, p.read_text().splitlines()[line - 1].index(at.split(": ")[1]) + 1)
        if extra == "split: tran":
            assert "did you mean 'train'" in (e.hint or "") and "train, test" in e.message
        if source == "acme/not-cached":
            assert "HF_HUB_OFFLINE" in e.message and str(hf_home / "hub") in e.message


def test_check_accepts_a_cached_hub_id_and_the_named_split(tmp_path, hf_home):
    _fill_hub_cache(hf_home, "acme/chat-math", {"data/train.jsonl": CHAT})
    assert _diags(_pipeline(tmp_path, "acme/chat-math", "split: train")) == []
    _make("saved-dict", tmp_path / "pipe")
    assert _diags(_pipeline(tmp_path, "saved", "split: test")) == []


# -- run time: what only reading the data tells -------------------------------------------------
def test_a_hub_split_it_does_not_have_is_af607_at_split(tmp_path, hf_home):
    _fill_hub_cache(hf_home, "acme/chat-math", {"data/train.jsonl": CHAT, "data/test.jsonl": TEST})
    p = _pipeline(tmp_path, "acme/chat-math", "split: validation")
    assert _diags(p) == []  # the hub snapshot's splits are not read at check
    with pytest.raises(UserError) as ei:
        load_prompts(compile_file(str(p)), warn=lambda msg: None)
    (e,) = ei.value.diagnostics
    assert e.code == "AF607" and e.loc.line == _line(p, "split: validation")
    assert "no split 'validation'" in e.message and "train" in e.message and "test" in e.message


def test_hub_id_not_cached_at_run_time_is_af601(tmp_path, hf_home):
    """(The cache emptied between compile and run: a plan.json run elsewhere reads the same.)"""
    import shutil

    _fill_hub_cache(hf_home, "acme/gone", {"data/train.jsonl": CHAT})
    p = _pipeline(tmp_path, "acme/gone", "split: train")
    plan = compile_file(str(p))
    shutil.rmtree(hf_home / "hub")
    with pytest.raises(UserError) as ei:
        load_prompts(plan, warn=lambda msg: None)
    (e,) = ei.value.diagnostics
    assert e.code == "AF601" and e.loc.line == _line(p, "source: acme/gone")
    assert "HF_HUB_OFFLINE" in e.message


@pytest.mark.parametrize("bad,code", [
    ("[1, 2]", "AF601"),            # not objects
    ('{"a": 1}', "AF601"),          # an object, not an array of rows
    ("[{\"messages\": []", "AF601"),  # not JSON
])
def test_a_bad_json_file_is_af601(tmp_path, bad, code):
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "rows.json").write_text(bad)
    p = _pipeline(tmp_path, "rows.json")
    with pytest.raises(UserError) as ei:
        load_prompts(compile_file(str(p)), warn=lambda msg: None)
    assert ei.value.diagnostics[0].code == code


def test_args_on_a_file_or_saved_directory_are_not_ignored(tmp_path):
    d = tmp_path / "pipe"
    _make("saved-dataset", d)
    _write_jsonl(d / "train.jsonl", CHAT)
    for source in ("train.jsonl", "saved"):
        p = _pipeline(tmp_path, source)
        p.write_text(p.read_text().replace("args: {}", "args: {n: 10}"))
        with pytest.raises(UserError) as ei:
            load_prompts(compile_file(str(p)), warn=lambda msg: None)
        (e,) = ei.value.diagnostics
        assert e.code == "AF601" and "args (n)" in e.message and e.loc.line == _line(p, "source:")


def test_the_training_source_is_the_first_one_eval_does_not_name():
    from types import SimpleNamespace as NS

    from asyncflow.runtime.data import train_source

    held, train = NS(name="held"), NS(name="train")
    assert train_source(NS(data=[held, train], eval=NS(data="held"))) is train
    assert train_source(NS(data=[held, train], eval=None)) is held
    assert train_source(NS(data=[train, held])) is train


# -- end to end, from the CLI --------------------------------------------------------------------
def test_cli_runs_on_a_saved_dataset_dict_split(tmp_path, hf_home):
    """`asyncflow check` and a 2-step local run read a DatasetDict's split beside the pipeline."""
    import datasets

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:3])}).save_to_disk(
        str(tmp_path / "pipe" / "digits"))
    text = (ROOT / "pipelines/sim_longtail.yaml").read_text()
    text = text.replace("source: asyncflow.datasets:digits", "source: digits")
    text = text.replace("args: {n: 10000, seed: 0}", "split: train\n    epochs: 8")
    text = text.replace("prompts_per_step: 32", "prompts_per_step: 8")
    p = tmp_path / "pipe" / "p.yaml"
    p.write_text(text)
    cli = [sys.executable, "-m", "asyncflow.cli"]
    r = subprocess.run([*cli, "check", str(p)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([*cli, "run", str(p), "--backend", "local", "--steps", "2", "--quiet",
                        "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in metrics if "step" in m]) >= 2
