"""Slow is not dead (leases renewed while a worker computes); a hang is found by the watchdog."""
from __future__ import annotations

import json
import time

import pytest

from tests.faults.common import SPS, check_rows, no_orphans, run_cli


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_slow_reward_with_short_lease_finishes(tmp_path, backend):
    # 50 ms a sample, 32-row batches: a batch takes ~1.6 s, past the 1 s lease. Before the
    # heartbeat renewed leases the rows were re-issued forever and the run never ended. The
    # heartbeat renews every lease_s / 3: a lease lapses only if its thread gets no CPU for
    # two thirds of the lease. With the 0.3 s lease the local run had once, 0.2 s without
    # the CPU beside two CPU hogs re-issued a lease (the claim is the same at 1 s)
    r, wall = run_cli(tmp_path, "--lease-s", "1.0", backend=backend, steps=3,
                      sets=["tasks.score.fn=faultfns:slower"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "leases re-issued       │              0" in r.stdout.replace("\u2502", "│"), r.stdout
    check_rows(tmp_path / "run", 3)
    if backend == "ray":
        no_orphans(r.marker)


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_hang_is_reported_with_task_op_and_stack(tmp_path, backend):
    # the watchdog's bound: short, so the test is quick, yet above the heartbeat silences a
    # loaded machine gives a worker still starting (under two CPU hogs a Ray worker's start-up
    # went 3.2 s without a beat, and a 3 s bound reported it instead of the hang)
    r, wall = run_cli(tmp_path, "--inject", "hang@step1:score", "--stall-timeout", "8",
                      backend=backend, steps=6)
    assert r.returncode == 1, r.stderr[-3000:]
    err = r.stderr
    assert "AF630" in err and "worker score/0 (task 'score')" in err and "COMPUTE" in err, err
    assert "_inject" in err and "Its stack" in err, err  # the worker's Python stack
    # found by the watchdog, not by run_cli's timeout (a hang that is never reported fails
    # there): no bound on the wall time, which a loaded machine stretches
    run = tmp_path / "run"
    assert (run / "trace.json").exists()
    workers = json.loads((run / "workers.json").read_text())
    assert set(workers) >= {"score/0", "update/0"}
    if backend == "ray":
        no_orphans(r.marker)
