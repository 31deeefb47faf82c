"""User functions that go wrong (NaN, a string, raise, sys.exit), real or injected: exit 2 with
a located AF61x naming the task, on both backends."""
from __future__ import annotations

import pytest

from tests.faults.common import run_args, run_cli
from tests.shared_runs import cli_result

CASES = {"nan": "AF612", "text": "AF612", "boom": "AF610", "bye": "AF610"}


@pytest.mark.parametrize("fn", list(CASES))
def test_bad_reward_local(tmp_path, fn):
    r, _ = run_cli(tmp_path, steps=2, sets=[f"tasks.score.fn=faultfns:{fn}"])
    assert r.returncode == 2, r.stderr[-3000:]
    assert CASES[fn] in r.stderr and "score" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("fn", ["nan", "bye"])
def test_bad_reward_ray(tmp_path, fn):
    r, _ = run_cli(tmp_path, steps=2, backend="ray", sets=[f"tasks.score.fn=faultfns:{fn}"])
    assert r.returncode == 2, r.stderr[-3000:]
    assert CASES[fn] in r.stderr and "score" in r.stderr


@pytest.mark.parametrize("spec,code", [("nan@step1:score", "AF612"), ("raise@step1:score", "AF610"),
                                       ("exit@step1:score", "AF610"),
                                       ("nan@step1:generate/0", "AF612")])
def test_injected_user_faults(tmp_path, spec, code):
    # a fault on one replica (task/R) needs that replica to get rows of the faulty steps: with
    # the file's 4 rollout replicas the other three may take them all (a loaded machine did)
    one = ["tasks.generate.replicas=1", "pools.rollout.devices=1"] if "/" in spec else []
    r, _ = run_cli(tmp_path, "--inject", spec, steps=3, sets=one)
    assert r.returncode == 2, r.stderr[-3000:]
    assert code in r.stderr and spec.rpartition(":")[2].partition("/")[0] in r.stderr


@pytest.mark.parametrize("spec,part", [
    ("boom@step1:score", "kind 'boom'"), ("kill@soon:score", "when 'soon'"),
    ("kill@step1:nope", "target 'nope'"), ("kill@step1:generate/9", "target 'generate/9'"),
    ("hang@step1:control", "target 'control'"), ("kill@step1", "'step1'"),
    ("kill@step99:score", "when 'step99'")])
def test_bad_inject_spec_is_a_usage_error(tmp_path, capsys, monkeypatch, spec, part):
    # refused before a worker starts: the CLI's entry point in this process is enough
    monkeypatch.chdir(tmp_path)
    r = cli_result(capsys, *run_args(tmp_path, "--inject", spec, steps=4))
    assert r.returncode == 2 and "AF634" in r.stderr and part in r.stderr, r.stderr[-2000:]
