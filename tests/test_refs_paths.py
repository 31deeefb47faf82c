"""``module:name`` references are found the same way by ``check`` and by ``run``.

A reward module and a data factory module kept next to the pipeline file -- not on ``sys.path``,
the working directory elsewhere -- pass ``asyncflow check`` and import at run time, on the local
backend and on Ray (whose workers get the search path from the driver, absolute).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow import refs

ROOT = Path(__file__).resolve().parents[1]

# unique module names: nothing else on sys.path (or in sys.modules) has them
REWARD_MOD = "af_refs_paths_reward"
DATA_MOD = "af_refs_paths_data"

REWARD_SRC = '''
def my_reward(q, gold, out):
    """Inputs positionally, in the task's declared order: prompt, answer, response."""
    assert isinstance(q, str) and q.endswith("="), q
    return 1.0 if str(out).strip().startswith(str(gold)) else 0.0
'''

DATA_SRC = '''
def make(n=16, seed=0):
    return [{"prompt": f"{i % 5}+{seed}=", "answer": str(i % 5 + seed)} for i in range(n)]
'''


def _project(tmp_path: Path) -> tuple[Path, Path]:
    """(the pipeline file, a working directory that is not its directory)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / f"{REWARD_MOD}.py").write_text(REWARD_SRC)
    (proj / f"{DATA_MOD}.py").write_text(DATA_SRC)
    text = (ROOT / "pipelines/sim_longtail.yaml").read_text()
    for a, b in [
        ("source: asyncflow.datasets:digits", f"source: {DATA_MOD}:make"),
        ("args: {n: 10000, seed: 0}", "args: {n: 16, seed: 1}"),
        ("fn: asyncflow.rewards:digits_match", f"fn: {REWARD_MOD}:my_reward"),
        ("rollout: {devices: 4}", "rollout: {devices: 1}"),
        ("replicas: 4", "replicas: 1"),
        ("prompts_per_step: 32", "prompts_per_step: 4"),
        ("samples_per_prompt: 4", "samples_per_prompt: 2"),
        ("steps: 20", "steps: 2"),
        ("{dist: lognormal, median: 0.05, sigma: 1.0, max: 1.0, seed: 5}", "0.001"),
        ("seconds_per_sample: 0.005, micro_batch: 16", "seconds_per_sample: 0.0001, micro_batch: 8"),
    ]:
        assert a in text, a
        text = text.replace(a, b)
    p = proj / "p.yaml"
    p.write_text(text)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return p, elsewhere


def _cli(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "asyncflow.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_search_path_is_the_pipeline_dir_then_the_cwd_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    assert refs.search_path("d/p.yaml") == [str((tmp_path / "d").resolve()), str(tmp_path.resolve())]
    assert refs.search_path(None) == [str(tmp_path.resolve())]


def test_check_and_run_pick_the_same_module_when_two_dirs_have_one(tmp_path, monkeypatch):
    """sys.path comes first, then the pipeline's directory, then the CWD: for the static lookup
    as for the import (a user's directory never shadows what is installed)."""
    name = "af_refs_paths_shadow"
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"
    for d in (first, second, third):
        d.mkdir()
        (d / f"{name}.py").write_text(f"WHERE = {d.name!r}\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(second)])  # on sys.path: wins
    paths = [str(first), str(second)]
    assert refs.find_module(name, paths).origin == str(second / f"{name}.py")
    assert refs.resolve(f"{name}:WHERE", paths) == "second"
    sys.modules.pop(name, None)
    paths = [str(first), str(third)]  # neither on sys.path: the pipeline's directory first
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(second)])
    assert refs.find_module(name, paths).origin == str(first / f"{name}.py")
    assert refs.resolve(f"{name}:WHERE", paths) == "first"
    sys.modules.pop(name, None)


def test_the_modules_are_not_importable_without_the_search_path(tmp_path):
    p, elsewhere = _project(tmp_path)
    r = subprocess.run([sys.executable, "-c", f"import {REWARD_MOD}"], cwd=elsewhere,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr


def test_check_accepts_modules_beside_the_pipeline(tmp_path):
    p, elsewhere = _project(tmp_path)
    r = _cli(["check", str(p)], elsewhere)
    assert r.returncode == 0, r.stderr
    assert ": ok (" in r.stdout


def test_load_prompts_imports_the_factory_beside_the_pipeline(tmp_path, monkeypatch):
    from asyncflow.compiler.pipeline import compile_file
    from asyncflow.runtime.data import load_prompts

    p, elsewhere = _project(tmp_path)
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))  # resolve() puts the search path in front
    rows = load_prompts(compile_file(str(p)))
    assert len(rows) == 16 and rows[0] == {"prompt": "0+1=", "answer": "1"}


def test_models_load_imports_the_factory_from_paths(tmp_path, monkeypatch):
    from asyncflow import models

    mod = tmp_path / "af_refs_paths_model.py"
    mod.write_text("def make(tag='x'):\n    return ('model-' + tag, 'tokenizer')\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    loaded = models.load("af_refs_paths_model:make", {"tag": "y"}, paths=[str(tmp_path)])
    assert tuple(loaded) == ("model-y", "tokenizer")


def _run(backend: str, tmp_path: Path, timeout: float) -> None:
    p, elsewhere = _project(tmp_path)
    out = tmp_path / "run"
    r = _cli(["run", str(p), "--backend", backend, "--quiet", "--out", str(out), "--debug"],
             elsewhere, timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    assert all(m.get("reward_mean") is not None for m in metrics)


def test_run_local_imports_modules_beside_the_pipeline(tmp_path):
    _run("local", tmp_path, 120)


@pytest.mark.ray
def test_run_ray_imports_modules_beside_the_pipeline(tmp_path):
    pytest.importorskip("ray")
    _run("ray", tmp_path, 180)
