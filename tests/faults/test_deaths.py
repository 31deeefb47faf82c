"""A worker that dies is known at once, its leases revoked, and it is restarted (--max-restarts);
a trainer restarts from the newest checkpoint in the same command; a lost actor is an error."""
from __future__ import annotations

import json
import time

import pytest

from tests.faults.common import SPS, check_rows, no_orphans, run_cli


def _workers(tmp_path) -> dict:
    return json.loads((tmp_path / "run" / "workers.json").read_text())


def test_sigkill_one_of_several_rollout_workers_on_ray(tmp_path):
    # kill@step2 strikes when generate/1 computes its first rows of step >= 2; with 6 steps, on
    # a loaded machine the other replicas could lease every row of steps 2-5 first, so the kill
    # never struck (restarts 0, seen under load): 8 steps give it twice as many rows to meet,
    # and 4 slots a replica (16 in all, half a step's 32 rows) leave every replica work at
    # every step, as in test_max_restarts_0_makes_a_death_fatal
    r, wall = run_cli(tmp_path, "--inject", "kill@step2:generate/1", backend="ray", steps=8,
                      sets=["tasks.generate.args.slots=4"])
    assert r.returncode == 0, r.stderr[-3000:]
    check_rows(tmp_path / "run", 8)
    w = _workers(tmp_path)
    # the replacement stops with the run ("stopped"); on a loaded machine the other replicas
    # may finish the run while it still starts (imports, engine) -- beside two CPU hogs it took
    # longer than the run's 10 s join -- and it ends as "restarted", never having run
    assert w["generate/1"]["restarts"] == 1
    assert w["generate/1"]["status"] in ("stopped", "restarted"), w["generate/1"]
    assert "workers restarted      │              1" in r.stdout.replace("\u2502", "│")
    no_orphans(r.marker)


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_killing_the_only_rollout_replica(tmp_path, backend):
    r, _ = run_cli(tmp_path, "--inject", "kill@step1:generate/0", backend=backend, steps=4,
                   sets=["tasks.generate.replicas=1", "pools.rollout.devices=1"])
    assert r.returncode == 0, r.stderr[-3000:]
    check_rows(tmp_path / "run", 4)
    assert _workers(tmp_path)["generate/0"]["restarts"] == 1
    if backend == "ray":
        no_orphans(r.marker)


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_trainer_death_with_checkpoints_restarts_from_the_checkpoint(tmp_path, backend):
    r, wall = run_cli(tmp_path, "--inject", "kill@step3:update", "--checkpoint-every", "2",
                      backend=backend, steps=6)
    assert r.returncode == 0, r.stderr[-3000:]
    check_rows(tmp_path / "run", 6)  # every step's rows exactly once, across the restart
    log = (tmp_path / "run" / "resume.jsonl").read_text()
    assert '"checkpoint": "step_' in log  # step_2, or step_4 when Ray's kill lands late
    assert _workers(tmp_path)["update/0"]["restarts"] == 1
    print(f"[{backend}] run with a trainer restart: {wall:.1f} s")
    if backend == "ray":
        no_orphans(r.marker)


def test_trainer_death_without_checkpoints_is_a_clear_error(tmp_path):
    r, _ = run_cli(tmp_path, "--inject", "kill@step1:update", steps=4)
    assert r.returncode == 1
    assert "AF633" in r.stderr and "update/0" in r.stderr and "--checkpoint-every" in r.stderr


def test_max_restarts_0_makes_a_death_fatal(tmp_path):
    # 4 slots a replica (16 in all, half a step's 32 rows): every replica has work at every step,
    # so generate/2 reaches step 1's rows (where it kills itself) before the run can end without
    # it; with the pipeline's 16 slots two replicas could take whole steps, and on a loaded
    # machine the run ended (exit 0) before generate/2 ever read a row of step 1
    r, _ = run_cli(tmp_path, "--inject", "kill@step1:generate/2", "--max-restarts", "0", steps=4,
                   sets=["tasks.generate.args.slots=4"])
    assert r.returncode == 1
    assert "AF631" in r.stderr and "generate/2" in r.stderr and "--max-restarts 0" in r.stderr
    assert (tmp_path / "run" / "trace.json").exists()
    assert _workers(tmp_path)["generate/2"]["status"] == "crashed"


def test_out_of_memory_in_a_worker_restarts_it(tmp_path):
    r, _ = run_cli(tmp_path, "--inject", "oom@step1:score", steps=4)
    assert r.returncode == 0, r.stderr[-3000:]
    check_rows(tmp_path / "run", 4)
    assert _workers(tmp_path)["score/0"]["restarts"] == 1


@pytest.mark.parametrize("target,what", [("control", "control actor"), ("store/0", "sample store")])
def test_losing_an_actor_is_an_error_with_the_records_written(tmp_path, target, what):
    r, _ = run_cli(tmp_path, "--inject", f"kill@step1:{target}", backend="ray", steps=6)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "AF632" in r.stderr and what in r.stderr, r.stderr[-3000:]
    run = tmp_path / "run"
    assert (run / "trace.json").exists() and (run / "workers.json").exists()
    # the lost actor is an error, not a hang: a run that waited on it forever fails in
    # run_cli's timeout (the wall time itself is no claim: a loaded machine stretches it)
    no_orphans(r.marker)
