"""The run directory's rules (asyncflow/runtime/rundir.py) through the CLI, and checkpoints that
hold no pickle: nothing a user gave is lost, mixed or overwritten without ``--force``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow.runtime import checkpoint

from shared_runs import cli

ROOT = Path(__file__).resolve().parent.parent
SIM = str(ROOT / "pipelines" / "sim_longtail.yaml")
FAST = ["--set", "tasks.generate.args.latency.max=0.02", "--set",
        "tasks.update.args.seconds_per_sample=0.0002"]


@pytest.fixture
def run(capsys):
    """``asyncflow run`` of the sim pipeline (local backend, fast) in this process: (exit code,
    output). Several runs into one directory in one process also check that a run releases
    the directory's lock when it ends (a held lock would be AF623 naming this process)."""
    def go(*args):
        return cli(capsys, "run", SIM, "--backend", "local", "--quiet", *FAST, *args)
    return go


def test_out_into_a_run_needs_resume_or_force(run, tmp_path):
    d = tmp_path / "run"
    assert run("--steps", "2", "--out", str(d))[0] == 0
    before = (d / "metrics.jsonl").read_text()
    (d / "notes.txt").write_text("mine")
    rc, out = run("--steps", "2", "--out", str(d))
    assert rc == 2 and "AF622" in out and "Traceback" not in out, out
    assert (d / "metrics.jsonl").read_text() == before  # untouched
    rc, out = run("--steps", "3", "--out", str(d), "--force")
    assert rc == 0, out
    assert len((d / "metrics.jsonl").read_text().splitlines()) == 3  # the new run only
    assert (d / "notes.txt").read_text() == "mine"  # not asyncflow's: kept


def test_a_run_that_stopped_before_its_first_step_says_force_replaces_it(run, tmp_path):
    """A run that never ended a step (say its Ray did not start: AF613) left plan.json only:
    AF622 says that there is nothing to resume and --force replaces it; a run with steps is
    not described so."""
    d = tmp_path / "run"
    assert run("--steps", "2", "--out", str(d))[0] == 0
    rc, out = run("--steps", "2", "--out", str(d))
    assert rc == 2 and "AF622" in out and "before its first step" not in out, out
    for f in ("metrics.jsonl", "train_rows.jsonl", "samples.jsonl", "trace.json", "final"):
        p = d / f
        if p.is_dir():
            import shutil
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    rc, out = run("--steps", "2", "--out", str(d))
    assert rc == 2 and "AF622" in out and "before its first step" in out and "--force" in out, out


def test_resume_of_nothing_is_an_error(run, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for d in (empty, tmp_path / "missing"):
        rc, out = run("--resume", str(d))
        assert rc == 2 and "AF620" in out, out
    d = tmp_path / "nockpt"  # a run, but no checkpoint
    assert run("--steps", "2", "--out", str(d))[0] == 0
    rc, out = run("--resume", str(d))
    assert rc == 2 and "AF620" in out and "--checkpoint-every" in out, out


def test_resume_refuses_a_changed_plan_unless_forced_and_checkpoints_hold_no_pickle(run, tmp_path):
    d = tmp_path / "run"
    assert run("--steps", "4", "--checkpoint-every", "1", "--out", str(d))[0] == 0
    rc, out = run("--resume", str(d), "--steps", "5", "--set", "sync.0.max_staleness=1")
    assert rc == 2 and "AF621" in out and "sync.0.max_staleness: 2 -> 1" in out, out
    rc, out = run("--resume", str(d), "--steps", "5")  # more steps: not a change of plan
    assert rc == 0, out
    for path in d.rglob("*"):  # no pickle anywhere in a run directory
        if path.is_file():
            assert path.suffix != ".pkl", path
            assert path.read_bytes()[:1] != b"\x80", f"{path} is a pickle"
    ck = checkpoint.latest(str(d))
    assert json.loads((Path(ck) / "store.json").read_text())["first_row"] >= 0
    assert json.loads((Path(ck) / "plan.json").read_text())["pipeline"] == "sim_longtail"


def test_an_unreadable_newest_checkpoint_falls_back_saying_so(run, tmp_path):
    d = tmp_path / "run"
    assert run("--steps", "4", "--checkpoint-every", "1", "--out", str(d))[0] == 0
    newest = checkpoint.checkpoints(str(d))[0]
    Path(newest, "state.json").write_text("{cut")
    rc, out = run("--resume", str(d), "--steps", "5")
    assert rc == 0, out
    assert f"checkpoint {os.path.basename(newest)} is unreadable" in out
    log = [json.loads(x) for x in (d / "resume.jsonl").read_text().splitlines()]
    assert log[-1]["skipped"][0][0] == os.path.basename(newest)


def test_two_runs_cannot_share_a_directory(run, tmp_path):
    d = tmp_path / "run"
    slow = ["--set", "tasks.update.args.seconds_per_sample=0.01"]
    first = subprocess.Popen([sys.executable, "-m", "asyncflow.cli", "run", SIM, "--backend",
                              "local", "--quiet", "--steps", "20", "--out", str(d), *slow],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        import time

        deadline = time.time() + 60
        while not (d / "plan.json").exists() and time.time() < deadline:
            time.sleep(0.05)
        rc, out = run("--resume", str(d), "--steps", "20")
        assert rc == 2 and "AF623" in out and str(first.pid) in out, out
    finally:
        first.kill()
        first.wait()


@pytest.mark.parametrize("bad", ["", "x"])
def test_force_is_not_needed_for_a_fresh_directory(run, tmp_path, bad):
    d = tmp_path / f"fresh{bad}"
    if bad:
        d.mkdir()
        (d / "unrelated.txt").write_text("a user's file")
    assert run("--steps", "1", "--out", str(d))[0] == 0


def test_force_removes_only_what_asyncflow_wrote(run, tmp_path):
    """--force removes the entries of the run directory's manifest (what earlier asyncflow
    runs there made), nothing else: a directory whose run files no manifest lists is the
    user's, and --force refuses it (AF624) leaving every file as it was."""
    d = tmp_path / "mine"
    (d / "checkpoints").mkdir(parents=True)
    (d / "checkpoints" / "mine.txt").write_text("a user's checkpoint notes")
    (d / "metrics.jsonl").write_text('{"mine": 1}\n')
    rc, out = run("--steps", "1", "--out", str(d), "--force")
    assert rc == 2 and "AF624" in out and "metrics.jsonl" in out and "checkpoints" in out, out
    assert (d / "checkpoints" / "mine.txt").read_text() == "a user's checkpoint notes"
    assert (d / "metrics.jsonl").read_text() == '{"mine": 1}\n'

    d = tmp_path / "ours"  # an earlier asyncflow run's files go, a user's file beside them stays
    assert run("--steps", "2", "--checkpoint-every", "1", "--out", str(d))[0] == 0
    manifest = json.loads((d / ".asyncflow-manifest.json").read_text())["entries"]
    assert {"metrics.jsonl", "checkpoints", "plan.json"} <= set(manifest)
    (d / "checkpoints" / "mine.txt").write_text("mine")
    (d / "notes.txt").write_text("mine")
    old = checkpoint.checkpoints(str(d))
    assert old
    rc, out = run("--steps", "1", "--out", str(d), "--force")
    assert rc == 0, out
    assert not any(os.path.exists(c) for c in old)  # the earlier run's checkpoints are gone
    assert len((d / "metrics.jsonl").read_text().splitlines()) == 1  # the new run only
    assert (d / "checkpoints" / "mine.txt").read_text() == "mine"
    assert (d / "notes.txt").read_text() == "mine"
