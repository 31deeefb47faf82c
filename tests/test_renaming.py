"""A field's name is the user's label: a pipeline with every field renamed runs.

For every shipped pipeline that can run here (``*_vllm*`` only where vllm imports,
``*_deepspeed*`` only where deepspeed does), each field is renamed -- once by the stated
adversarial swap (``response`` <-> ``logprobs``, ``reward`` <-> ``advantages``, ``prompt`` <->
``answer``, ``values`` <-> ``returns``, the rest named after other roles) and once by a renaming
drawn with a fixed seed (marked slow) -- written to a temporary directory beside a module that renames the
data source's columns (a module name of its own per run), and run for 2 steps with ``asyncflow run
--backend local`` in this process with a timeout (a hang fails the test; the DeepSpeed and vLLM
pipelines run in a process of their own, :data:`shared_runs.OWN_PROCESS`). The run must exit 0 and write 2 steps of
finite metrics. The main job is also run renamed on the default Ray backend, and, since a local
run is deterministic, renamed and original runs of the main job must log the same numbers.

Also the bug report's own pipelines (a PPO pipeline with a critic whose fields have the user's
names; the main job with ``advantages`` called ``adv``; with ``response`` called
``completion``): each passes ``asyncflow check`` and runs 2 steps.

The renaming helpers live in ``compiler_tests/test_renaming_compile.py`` (the compile-only
property over the same renamings).
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "compiler_tests"))
from test_renaming_compile import (  # noqa: E402
    FILES, draw_renaming, names_of, swap_renaming, write_renamed)

sys.path.insert(0, str(ROOT / "tests"))
from shared_runs import OWN_PROCESS, CliTimeout, in_process  # noqa: E402

RUN_TIMEOUT = 240  # seconds for one 2-step local run (they take ~5 s; a hang fails)
RAY_TIMEOUT = 600  # 121 s beside two CPU hogs


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _runnable(path: Path):
    marks = []
    if "_vllm" in path.name:
        marks += [pytest.mark.vllm,
                  pytest.mark.skipif(not _has("vllm"), reason="vllm does not import")]
    if "_deepspeed" in path.name:
        marks += [pytest.mark.deepspeed,
                  pytest.mark.skipif(not _has("deepspeed"), reason="deepspeed does not import")]
    if "sim_" not in path.name:
        marks.append(pytest.mark.engine)
    return marks


_MODULES = itertools.count()


def data_module() -> str:
    """A new name for a renamed pipeline's data module: the runs share this process, where a
    module once imported under a name stays in ``sys.modules`` (a second ``renamed_data`` would
    be the first one)."""
    return f"renamed_run_{next(_MODULES)}"


def cli(*args: str, timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``asyncflow ARGS`` in this process (torch and the engines are imported once), or, for a
    pipeline of :data:`shared_runs.OWN_PROCESS`, in a subprocess of its own session; past
    ``timeout`` the command is interrupted (the subprocess's whole group, a local Ray included,
    killed) and the test fails with what it printed."""
    cmd = [sys.executable, "-m", "asyncflow.cli", *args]
    if not any(part in Path(a).name for a in args for part in OWN_PROCESS):
        try:
            r = in_process(list(args), cwd=str(cwd), timeout=timeout)
        except CliTimeout as e:
            pytest.fail(str(e))
        return subprocess.CompletedProcess(cmd, r.returncode, r.stdout, r.stderr)
    proc = subprocess.Popen(cmd, cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"asyncflow {' '.join(args)} did not finish in {timeout} s\n"
                    f"--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def small(path: Path) -> list[str]:
    """``--set`` overrides that keep a 2-step run small: the fewest prompts per step that keep
    ``prompts_per_step * samples_per_prompt`` divisible by every train task's micro_batch."""
    from asyncflow.dsl.load import load_file

    p = load_file(str(path))
    if any(t.kind == "filter" for t in p.tasks.values()):
        # a filter (dapo's) drops the groups without reward variance: at random init, with a
        # few prompts a step, it drops them all and nothing trains; keep the file's step
        return ["--set", "step.steps=2"]
    spp = p.step.samples_per_prompt
    mbs = [int(t.args["micro_batch"]) for t in p.tasks.values() if "micro_batch" in (t.args or {})]
    n = next(k for k in range(1, p.step.prompts_per_step + 1)
             if all((k * spp) % mb == 0 for mb in mbs))
    return ["--set", "step.steps=2", "--set", f"step.prompts_per_step={n}"]


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    assert path.exists(), f"no {path}"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _numbers(v, at=""):
    if isinstance(v, bool):
        return
    if isinstance(v, (int, float)):
        yield at, v
    elif isinstance(v, dict):
        for k, x in v.items():
            yield from _numbers(x, f"{at}.{k}")
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _numbers(x, f"{at}[{i}]")


def assert_two_finite_steps(run_dir: Path, r: subprocess.CompletedProcess) -> list[dict]:
    recs = metrics(run_dir)
    assert [x.get("step") for x in recs] == [0, 1], (recs, r.stderr[-3000:])
    nums = [(k, v) for rec in recs for k, v in _numbers(rec)]
    bad = [(k, v) for k, v in nums if not math.isfinite(v)]
    assert not bad, bad
    for rec in recs:  # a step whose rows a filter dropped trains no sample and has no reward
        assert isinstance(rec.get("samples"), int), rec
        if rec["samples"]:
            assert isinstance(rec.get("reward_mean"), (int, float)), rec
    assert sum(rec["samples"] for rec in recs) > 0, recs
    return recs


def run_local(path: Path, out: Path, extra=(), timeout: float = RUN_TIMEOUT,
              ) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    r = cli("run", str(path), "--backend", "local", "--out", str(out), "--quiet",
            *small(path), *extra, timeout=timeout)
    return r, time.perf_counter() - t0


def _renaming(path: Path, how: str) -> dict[str, str]:
    names = names_of(path)
    if how == "swap":
        return swap_renaming(names)
    return draw_renaming(names, zlib.crc32(path.name.encode()))


# the swap for every file runs in CI; the drawn renamings (11 more runs of ~5-8 s) are 'slow'
CASES = [pytest.param(p, how, id=f"{p.name}-{how}",
                      marks=_runnable(p) + ([pytest.mark.slow] if how == "drawn" else []))
         for p in FILES for how in ("swap", "drawn")]


_DONE: dict[tuple[str, str], tuple[Path, subprocess.CompletedProcess]] = {}  # finished runs


@pytest.mark.parametrize("path,how", CASES)
def test_renamed_pipeline_runs(path, how, tmp_path):
    m = _renaming(path, how)
    renamed = write_renamed(path, m, tmp_path / "p", module=data_module())
    r, secs = run_local(renamed, tmp_path / "run")
    if r.returncode == 0:
        _DONE[(path.name, how)] = (tmp_path / "run", r)
    assert r.returncode == 0, (m, renamed.read_text(), r.stderr[-6000:])
    assert "Traceback" not in r.stderr, r.stderr[-6000:]
    recs = assert_two_finite_steps(tmp_path / "run", r)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    if "fields" in plan:  # the run's plan knows the fields by their new names
        assert set(plan["fields"]) == set(m.values()), (m, plan["fields"])
    print(f"{path.name} {how}: {secs:.1f} s, reward {[x['reward_mean'] for x in recs]}")


# columns that depend on wall-clock time, not on what ran
TIMING = re.compile(r"time|_s$|per_s|utilization|bubble|queue|exposed|throughput|secs|latency")


def _what_ran(recs: list[dict]) -> list[dict]:
    return [{k: v for k, v in rec.items() if not TIMING.search(k)} for rec in recs]


def test_renamed_main_job_logs_the_same_numbers(tmp_path):
    """Renaming changes nothing that runs: the main job, renamed by the adversarial swap, logs
    the same rewards, losses and KL as the original (a local run is deterministic)."""
    path = ROOT / "pipelines" / "grpo_digits.yaml"
    a, _ = run_local(path, tmp_path / "orig")
    assert a.returncode == 0, a.stderr[-4000:]
    if ("grpo_digits.yaml", "swap") in _DONE:  # test_renamed_pipeline_runs ran it already
        run_dir, b = _DONE["grpo_digits.yaml", "swap"]
    else:
        renamed = write_renamed(path, swap_renaming(names_of(path)), tmp_path / "p",
                                module=data_module())
        run_dir = tmp_path / "renamed"
        b, _ = run_local(renamed, run_dir)
        assert b.returncode == 0, b.stderr[-4000:]
    x = _what_ran(assert_two_finite_steps(tmp_path / "orig", a))
    y = _what_ran(assert_two_finite_steps(run_dir, b))
    for k in ("reward_mean", "loss", "kl"):
        assert k in x[0], x[0]
    assert [sorted(r) for r in x] == [sorted(r) for r in y]
    for rx, ry in zip(x, y):
        for k in rx:
            if isinstance(rx[k], float):
                assert ry[k] == pytest.approx(rx[k], rel=1e-6, abs=1e-9), (k, rx[k], ry[k])
            else:
                assert ry[k] == rx[k], (k, rx[k], ry[k])


@pytest.mark.ray
def test_renamed_main_job_runs_on_ray(tmp_path):
    """The main job, renamed by the swap, on the default Ray backend (a local Ray)."""
    path = ROOT / "pipelines" / "grpo_digits.yaml"
    m = swap_renaming(names_of(path))
    renamed = write_renamed(path, m, tmp_path / "p", module=data_module())
    t0 = time.perf_counter()
    r = cli("run", str(renamed), "--out", str(tmp_path / "run"), "--quiet", *small(path),
            timeout=RAY_TIMEOUT)
    assert r.returncode == 0, r.stderr[-6000:]
    assert_two_finite_steps(tmp_path / "run", r)
    print(f"ray: {time.perf_counter() - t0:.1f} s")


# -- the bug report's pipelines ------------------------------------------------------------------
DATA_MODULE = '''\
from asyncflow.datasets import digits


def rows(**kw):
    return [{"question": r["prompt"], "answer": r["answer"]} for r in digits(**kw)]
'''

USER_PPO = """\
pipeline: my_ppo
description: PPO with a critic, fields named my way

models:
  policy: {init: asyncflow.models:tiny_decoder, args: {layers: 2, hidden: 64}}
  critic: {init: asyncflow.models:tiny_decoder, args: {layers: 2, hidden: 64}}
  reference: {copy_of: policy, frozen: true}

data:
  prompts:
    source: my_data:rows
    args: {n: 10000, seed: 0}
    fields: [question, answer]

pools:
  rollout: {devices: 1}
  train: {devices: 1}

step: {prompts_per_step: 32, samples_per_prompt: 2, steps: 200}

tasks:
  generate:
    kind: rollout
    engine: hf
    model: policy
    pool: rollout
    inputs: [question]
    outputs: [completion, lp]
    args: {max_new_tokens: 16, temperature: 1.0}
  reward:
    kind: reward
    fn: asyncflow.rewards:digits_match
    inputs: [question, answer, completion]
    outputs: [score]
  ref:
    kind: logprob
    engine: hf
    model: reference
    pool: train
    inputs: [question, completion]
    outputs: [ref_lp]
  value:
    kind: value
    engine: hf
    model: critic
    pool: train
    inputs: [question, completion]
    outputs: [value]
  gae:
    kind: advantage
    estimator: gae
    inputs: [score, value]
    outputs: [adv, ret]
    args: {gamma: 1.0, lam: 0.95}
  ppo:
    kind: train
    engine: hf
    model: policy
    pool: train
    loss: ppo
    inputs: [question, completion, lp, ref_lp, adv]
    args: {lr: 1.0e-4, micro_batch: 16, kl_coef: 0.001}
  value_train:
    kind: train
    engine: hf
    model: critic
    pool: train
    loss: value
    inputs: [question, completion, value, ret]
    args: {lr: 1.0e-4, micro_batch: 16}

sync:
  - {from: ppo, to: generate, max_staleness: 1}
  - {from: value_train, to: value, max_staleness: 1}
"""


def _main_job_with(old: str, new: str) -> str:
    text = (ROOT / "pipelines" / "grpo_digits.yaml").read_text()
    out, n = re.subn(rf"(?<=[\[ ]){old}(?=[,\]])", new, text)
    assert n >= 2, (old, n)
    return out


USER_FILES = {
    "user_ppo": ("my_ppo.yaml", USER_PPO),
    "main_job_adv": ("grpo_adv.yaml", _main_job_with("advantages", "adv")),
    "main_job_completion": ("grpo_completion.yaml", _main_job_with("response", "completion")),
}


@pytest.mark.engine
@pytest.mark.parametrize("key", list(USER_FILES))
def test_users_pipeline_checks_and_runs(key, tmp_path):
    name, text = USER_FILES[key]
    d = tmp_path / "mine"
    d.mkdir()
    mod = f"my_data_{key}"  # a name of its own: the runs share this process (data_module())
    (d / f"{mod}.py").write_text(DATA_MODULE)
    path = d / name
    assert text.count("source: my_data:rows") == (key == "user_ppo"), text
    path.write_text(text.replace("source: my_data:rows", f"source: {mod}:rows"))
    c = cli("check", str(path), timeout=60)
    assert c.returncode == 0, c.stdout + c.stderr
    assert "warning" not in c.stderr, c.stderr
    r, secs = run_local(path, tmp_path / "run")
    assert r.returncode == 0, r.stderr[-6000:]
    recs = assert_two_finite_steps(tmp_path / "run", r)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    if key == "user_ppo":
        roles = {f: x["role"] for f, x in plan.get("fields", {}).items()}
        assert roles == {"question": "data", "answer": "data", "completion": "response",
                         "lp": "logprobs", "score": "reward", "ref_lp": "ref_logprobs",
                         "value": "values", "adv": "advantages", "ret": "returns"}, roles
        for k in ("loss",):
            assert k in recs[-1], recs[-1]
    print(f"{key}: {secs:.1f} s")


def test_user_ppo_text_matches_the_report():
    """The regression pipeline says what the report says (guards the fixture itself)."""
    import yaml

    doc = yaml.safe_load(USER_PPO)
    t = doc["tasks"]
    assert t["reward"]["outputs"] == ["score"] and t["value"]["outputs"] == ["value"]
    assert t["gae"]["inputs"] == ["score", "value"] and t["gae"]["outputs"] == ["adv", "ret"]
    assert t["ppo"]["inputs"] == ["question", "completion", "lp", "ref_lp", "adv"]
    assert t["value_train"]["inputs"] == ["question", "completion", "value", "ret"]
    adv = yaml.safe_load(USER_FILES["main_job_adv"][1])["tasks"]
    assert adv["advantage"]["outputs"] == ["adv"] and adv["update"]["inputs"][-1] == "adv"
    comp = yaml.safe_load(USER_FILES["main_job_completion"][1])["tasks"]
    assert comp["generate"]["outputs"] == ["completion", "logprobs"]
    assert "completion" in comp["score"]["inputs"] and "response" not in str(comp)


# -- names the runtime keeps for itself --------------------------------------------------------
@pytest.mark.engine
@pytest.mark.parametrize("reserved", ["_row", "_group", "_version"])
def test_store_column_names_are_refused_or_work(reserved, tmp_path):
    """The sample store keeps columns of its own (``_row``, ``_group``, ``_version``). A user
    field of that name must either be refused by ``check`` (exit 2, located at the field) or run
    like any other name -- never pass ``check`` and then break the run."""
    path = ROOT / "pipelines" / "grpo_digits.yaml"
    m = {n: n for n in names_of(path)}
    m["reward"] = reserved
    renamed = write_renamed(path, m, tmp_path / "p", module=data_module())
    c = cli("check", str(renamed), timeout=60)
    if c.returncode == 2:
        text = renamed.read_text()
        lines = {i + 1 for i, x in enumerate(text.splitlines()) if reserved in x}
        heads = [x for x in c.stderr.splitlines() if re.match(rf"{re.escape(str(renamed))}:\d+:\d+: AF\d{{3}} ", x)]
        assert heads and any(int(x.split(":")[1]) in lines for x in heads), c.stderr
        return
    assert c.returncode == 0, c.stdout + c.stderr
    r, _ = run_local(renamed, tmp_path / "run", timeout=30)  # ~5-10 s when it works
    assert r.returncode == 0, r.stderr[-4000:]
    assert_two_finite_steps(tmp_path / "run", r)
