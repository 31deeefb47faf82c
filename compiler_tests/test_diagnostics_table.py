"""The diagnostics table (asyncflow.diagnostics): every code has examples, and every example raises
exactly its code at exactly its place. Plus the CLI's reporting contract and the canonical
pipelines checking clean."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow.check import check_file
from asyncflow.diagnostics import Diagnostics, table
from asyncflow.errors import UserError

from conftest import PIPELINES, ROOT, pipeline_files, position

# an unreadable file, a plug-in engine without ARGS: no source text holds them; their examples
# are in tests/test_diagnostic_examples.py, with every run-time (AF6xx) code's
NO_EXAMPLE = {"AF100", "AF213"}
# AF401 (placement: pool capacity) restates validate's AF321, which catches its example first;
# the placement pass's own tests check it alone
SHADOWED = {"AF401": "AF321"}
CASES = [(code, i, ex) for code, c in table().items() for i, ex in enumerate(c.examples)
         if not code.startswith("AF6")]  # run-time codes: tests/test_diagnostic_examples.py
ASYNCFLOW = [sys.executable, "-m", "asyncflow.cli"]


def test_every_code_has_an_example():
    missing = [code for code, c in table().items()
               if not c.examples and code not in NO_EXAMPLE and not code.startswith("AF6")]
    assert not missing, f"codes without an example: {missing}"


def test_codes_are_well_formed():
    names = set()
    for code, c in table().items():
        assert code == c.code and len(code) == 5 and code.startswith("AF") and code[2:].isdigit()
        assert c.severity in ("error", "warning"), code
        assert c.name not in names, f"name {c.name} used twice"
        names.add(c.name)


def diagnose(path: Path, code: str, sets=()) -> Diagnostics:
    """Every diagnostic of ``path``: ``check`` for the language (AF1xx-AF3xx, AF5xx), the whole
    compiler for its own findings (AF4xx)."""
    diags = Diagnostics()
    if code.startswith("AF4"):
        from asyncflow.compiler import Context, compile_file

        try:
            compile_file(path, sets, ctx=Context(diags=diags))
        except UserError:
            pass
    else:
        check_file(str(path), sets=sets, diags=diags)  # never raises when given diags
    return diags


@pytest.mark.parametrize("code,i,ex", CASES, ids=[f"{c}-{i}" for c, i, _ in CASES])
def test_example_raises_its_code_at_its_place(code, i, ex, write):
    if code in SHADOWED:
        code = SHADOWED[code]
    path = write(ex.text, ex.suffix)
    diags = diagnose(path, code, ex.sets)
    severity = table()[code].severity
    found = [d for d in diags.items if d.code == code and d.severity == severity]
    assert found, f"{code} not reported; got:\n" + "\n".join(d.headline() for d in diags.items)
    if ex.in_set:
        want = ("--set[1]",) + position(ex.sets[0], ex.at)
    else:
        want = (str(path),) + position(ex.text, ex.at)
    got = [(d.loc.file, d.loc.line, d.loc.col) for d in found if d.loc is not None]
    assert want in got, f"{code} expected at {want[1:]}, reported at {[g[1:] for g in got]}"
    if severity == "error":
        assert diags.errors


def test_unreadable_file_af100(tmp_path):
    diags = Diagnostics()
    assert check_file(str(tmp_path / "missing.yaml"), diags=diags) is None
    assert [d.code for d in diags.errors] == ["AF100"]
    assert diags.errors[0].loc.line == 1
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"pipeline: caf\xe9\n")
    diags = Diagnostics()
    check_file(str(bad), diags=diags)
    assert [d.code for d in diags.errors] == ["AF100"] and "UTF-8" in diags.errors[0].message


def test_unknown_suffix_af106(write):
    path = write("pipeline: x\n", ".toml")
    diags = Diagnostics()
    check_file(str(path), diags=diags)
    assert [(d.code, d.loc.line, d.loc.col) for d in diags.errors] == [("AF106", 1, 1)]


def test_check_file_raises_user_error_without_diags(write):
    with pytest.raises(UserError) as e:
        check_file(str(write("# nothing\n")))
    assert [d.code for d in e.value.diagnostics] == ["AF102"]


# -- several errors at once -------------------------------------------------------------------
SEVERAL = (PIPELINES / "grpo_digits.yaml").read_text()
SEVERAL = (SEVERAL.replace("model: reference", "model: referense")          # AF310
                  .replace("estimator: grpo", "estimator: grp0")              # AF330
                  .replace("micro_batch: 64", "micro_batch: 24")              # AF360
                  .replace("  train: {devices: 1}", "  train: {devices: 1}\n  spare: {devices: 0}")
                  .replace("fn: asyncflow.rewards:digits_match", "fn: asyncflow.rewards:digit_match"))


def test_independent_errors_are_all_reported(write):
    path = write(SEVERAL)
    diags = Diagnostics()
    check_file(str(path), diags=diags)
    codes = sorted(d.code for d in diags.errors)
    assert codes == ["AF206", "AF310", "AF330", "AF341", "AF360"], codes
    rules = [d for d in diags.errors if d.code == "AF341"]
    assert rules[0].hint == "did you mean 'digits_match'?"


def test_one_fault_is_reported_once(write):
    """A broken value is reported where it is, not again by every rule that reads it."""
    text = (PIPELINES / "grpo_digits.yaml").read_text().replace("inputs: [reward]", "inputs: reward")
    diags = Diagnostics()
    check_file(str(write(text)), diags=diags)
    assert [d.code for d in diags.errors] == ["AF202"]


# -- the command line ---------------------------------------------------------------------------
def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1")
    return subprocess.run(ASYNCFLOW + list(args), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


def test_cli_reports_located_errors_with_caret_and_exits_2(write):
    path = write(SEVERAL)
    r = run_cli("check", str(path))
    assert r.returncode == 2, r.stderr
    err = r.stderr
    lines = err.splitlines()
    head = next(i for i, line in enumerate(lines) if "AF330" in line)
    want_line, want_col = position(SEVERAL, "grp0")
    assert lines[head] == (f"{path}:{want_line}:{want_col}: AF330 there is no advantage estimator "
                           "'grp0' (known: grpo, rloo, reinforce_pp, gae)")
    assert lines[head + 1].strip() == "estimator: grp0"
    caret = lines[head + 2]
    assert caret.strip() == "^^^^" and caret.index("^") == lines[head + 1].index("grp0")
    assert "hint: did you mean 'grpo'?" in lines[head + 3]
    for code in ("AF206", "AF310", "AF341", "AF360"):
        assert f": {code} " in err
    assert "5 errors" in err
    assert "Traceback" not in err


def test_cli_set_errors_point_into_the_override():
    r = run_cli("check", "pipelines/grpo_digits.yaml", "--set", "tasks.update.loss=grop")
    assert r.returncode == 2
    assert "--set[1]:1:19: AF331 there is no loss 'grop'" in r.stderr
    assert "tasks.update.loss=grop" in r.stderr


def test_cli_clean_file_exits_0_with_ok():
    r = run_cli("check", "pipelines/grpo_digits.yaml", "--set", "sync.0.max_staleness=0")
    assert r.returncode == 0, r.stderr
    assert "pipelines/grpo_digits.yaml: ok" in r.stdout


def test_cli_every_canonical_pipeline_checks_clean():
    files = [str(p.relative_to(ROOT)) for p in pipeline_files()]
    r = run_cli("check", *files)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(": ok") == len(files)


# -- the canonical pipelines ---------------------------------------------------------------------
@pytest.mark.parametrize("path", pipeline_files(), ids=lambda p: p.name)
def test_canonical_pipeline_is_clean(path):
    diags = Diagnostics()
    out = check_file(str(path), diags=diags)
    assert out is not None
    assert not diags.items, "\n".join(d.headline() for d in diags.items)  # not even a warning
    p, g = out
    assert p.description and "\n" not in p.description.strip()


def test_the_expected_canonical_pipelines_exist():
    names = {p.stem for p in pipeline_files(".yaml")}
    assert {"grpo_digits", "grpo_digits_sync", "ppo_gae", "dapo", "rloo", "reinforce_pp",
            "agentic_multiturn", "sim_longtail"} <= names


def test_sync_pipeline_is_grpo_at_staleness_0():
    a = check_file(str(PIPELINES / "grpo_digits.yaml"))[0]
    b = check_file(str(PIPELINES / "grpo_digits_sync.yaml"))[0]
    assert [s.max_staleness for s in b.sync] == [0]
    assert a.tasks == b.tasks and a.models == b.models and a.step == b.step


# -- references resolve without importing anything ----------------------------------------------
GRPO = (PIPELINES / "grpo_digits.yaml").read_text()


def codes_of(path: Path) -> list[str]:
    diags = Diagnostics()
    check_file(str(path), diags=diags)
    return sorted(d.code for d in diags.items)


def test_local_module_next_to_the_pipeline_resolves_without_import(tmp_path):
    pkg = tmp_path / "myrl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('imported!')\n")
    (pkg / "rewards.py").write_text("raise RuntimeError('imported!')\n"
                                    "if True:\n    def score(prompt, answer, response):\n        return 1.0\n")
    path = tmp_path / "p.yaml"
    path.write_text(GRPO.replace("asyncflow.rewards:digits_match", "myrl.rewards:score"))
    assert codes_of(path) == []
    assert "myrl" not in sys.modules and "myrl.rewards" not in sys.modules
    path.write_text(GRPO.replace("asyncflow.rewards:digits_match", "myrl.rewards:scor"))
    assert codes_of(path) == ["AF341"]


def test_data_files_and_model_directories_resolve_from_the_pipeline_directory(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "ckpt").mkdir()
    path = tmp_path / "p.yaml"
    text = (GRPO.replace("source: asyncflow.datasets:digits", "source: data/train.jsonl")
                .replace("init: asyncflow.models:tiny_decoder", "init: ./ckpt"))
    path.write_text(text)
    assert codes_of(path) == []
    path.write_text(text.replace("./ckpt", "./ckpt2").replace("train.jsonl", "test.jsonl"))
    assert codes_of(path) == ["AF342", "AF342"]
    path.write_text(text.replace("./ckpt", "Qwen/Qwen2.5-0.5B-Instruct"))  # a hub id, not cached:
    assert codes_of(path) == ["AF345"]  # an error under HF_HUB_OFFLINE=1 (conftest); online, run downloads it


def test_sim_latency_distributions(tmp_path):
    path = tmp_path / "p.yaml"
    base = (PIPELINES / "sim_longtail.yaml").read_text()
    spec = "{dist: lognormal, median: 0.05, sigma: 1.0, max: 1.0, seed: 5}"
    for good in ("0.05", "{dist: constant, value: 0.1}", "{dist: uniform, min: 0.01, max: 0.1}",
                 "{dist: pareto, scale: 0.01, alpha: 1.5, max: 2.0, seed: 1}"):
        path.write_text(base.replace(spec, good))
        assert codes_of(path) == [], good
    for bad in ("-1", "{dist: gamma, k: 2}", "{dist: lognormal, median: 0.05}", "[1, 2]",
                "{dist: uniform, min: 2, max: 1}", "{dist: [1], min: 2}"):
        path.write_text(base.replace(spec, bad))
        assert codes_of(path) == ["AF362"], bad
