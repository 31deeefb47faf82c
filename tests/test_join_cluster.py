"""Joining a cluster started the usual way: ``ray start --head`` with Ray 2.60's token
authentication on and GPUs declared (``--num-gpus 2`` on a machine without them, the CPU twin
of a GPU node), then ``asyncflow run --address``: with the head's token it runs and its workers
get Ray's GPU ids; a wrong token or an address where nothing listens is AF608 naming the
address and what to check, exit 2, never an internal error."""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("ray")

from faults.common import processes_of  # noqa: E402

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]

PIPELINE = (ROOT / "pipelines" / "sim_longtail.yaml").read_text()
SETS = ["step.prompts_per_step=4", "step.samples_per_prompt=4",
        "tasks.generate.args.latency.median=0.005", "tasks.generate.args.latency.max=0.02",
        "tasks.update.args.seconds_per_sample=0.001", "pools.rollout.devices=1",
        "tasks.generate.replicas=1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A head started with `ray start`, token authentication on, 2 declared GPUs; its
    processes (tagged by an environment marker) are killed at the end, and only they: `ray
    stop` would stop every Ray on the machine."""
    tmp = tmp_path_factory.mktemp("head")
    token, marker, port = secrets.token_hex(32), uuid.uuid4().hex, _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
           "ASYNCFLOW_TEST_RUN": marker}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_worker_niceness", None)  # the head's own workers: Ray's default niceness
    ray = str(Path(sys.executable).with_name("ray"))
    r = subprocess.run([ray, "start", "--head", "--port", str(port), "--num-cpus", "2",
                        "--num-gpus", "2", "--include-dashboard", "false", "--disable-usage-stats",
                        "--temp-dir", str(tmp / "ray")], env=env, capture_output=True, text=True,
                       timeout=120)
    try:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        host = socket.gethostbyname(socket.gethostname())
        yield {"address": f"{host}:{port}", "token": token}
    finally:
        for _ in range(3):
            for entry in processes_of(marker):  # "pid cmdline"
                try:
                    os.kill(int(entry.split()[0]), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)


def _run(tmp_path, address: str, env_extra: dict, *args: str, timeout: float = 180):
    p = tmp_path / "p.yaml"
    p.write_text(PIPELINE)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    env.update(PYTHONPATH=str(ROOT), HOME=str(tmp_path), **env_extra)  # no ~/.ray/auth_token
    cmd = [sys.executable, "-m", "asyncflow.cli", "run", str(p), "--address", address,
           "--steps", "2", "--out", str(tmp_path / "run"), "--quiet"]
    for s in SETS:
        cmd += ["--set", s]
    cmd += list(args)  # after SETS: a later --set wins
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                       cwd=str(tmp_path))
    return r, time.time() - t


def test_joins_a_ray_start_head_with_its_token_and_gets_its_gpus(head, tmp_path):
    r, _ = _run(tmp_path, head["address"],
                {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": head["token"]}, "--device-kind", "gpu")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    w = json.loads((tmp_path / "run" / "workers.json").read_text())
    gen, upd = w["generate/0"]["gpus"], w["update/0"]["gpus"]
    assert len(gen) == 1 and len(upd) == 1 and gen != upd, w  # two pools: disjoint GPU ids
    # the head's raylet started them: the job's environment, not the head's, set their priority
    assert {x["nice"] for x in w.values()} == {0}, w


_NICE = """
import json, os
from asyncflow.runtime.ray_connect import ensure_ray
ray, started = ensure_ray(num_cpus=1)
nice = ray.remote(num_cpus=0)(lambda: os.nice(0))
print(json.dumps({"worker": ray.get(nice.remote()), "started": started,
                  "env": os.environ.get("RAY_worker_niceness")}))
ray.shutdown()
"""


@pytest.mark.parametrize("given", [None, "7"])
def test_a_local_rays_workers_run_at_the_drivers_priority(tmp_path, given):
    """Ray runs its workers at nice 15, under every process at the default 0 (beside two busy
    processes a run's workers got ~3% of a core); a run's own local Ray runs them at 0, a
    RAY_worker_niceness the user set is kept, and the environment is left as it was."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_worker_niceness")}
    env["PYTHONPATH"] = str(ROOT)
    if given is not None:
        env["RAY_worker_niceness"] = given
    r = subprocess.run([sys.executable, "-c", _NICE], capture_output=True, text=True, timeout=180,
                       env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"worker": int(given or 0), "started": True, "env": given}


def test_more_gpus_than_the_cluster_has_is_af609_at_once(head, tmp_path):
    """Each bundle fits a node, all of them do not: located at the pool, not a placement
    group that waits for resources that never come."""
    r, took = _run(tmp_path, head["address"],
                   {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": head["token"]},
                   "--device-kind", "gpu", "--set", "pools.rollout.devices=2",
                   "--set", "tasks.generate.replicas=2")
    text = r.stdout + r.stderr
    assert r.returncode == 2, text[-3000:]
    assert "AF609 the pools need 3 GPU in all" in text and "p.yaml:17:3" in text, text[-3000:]
    assert "internal error" not in text and took < 60


def test_a_wrong_token_is_af608_naming_the_address_and_the_token(head, tmp_path):
    r, _ = _run(tmp_path, head["address"], {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64})
    text = r.stdout + r.stderr
    assert r.returncode == 2, text[-3000:]
    assert f"AF608 cannot join the Ray cluster at {head['address']}" in text, text[-3000:]
    assert "RAY_AUTH_TOKEN" in text and "ray get-auth-token" in text
    assert "internal error" not in text and "Traceback" not in text


def test_an_address_where_nothing_listens_is_af608_at_once(tmp_path):
    port = _free_port()
    r, took = _run(tmp_path, f"127.0.0.1:{port}", {})
    text = r.stdout + r.stderr
    assert r.returncode == 2, text[-3000:]
    assert f"AF608 cannot join the Ray cluster at 127.0.0.1:{port}: nothing answers there" in text
    assert "RAY_AUTH_MODE=token" in text  # no token set here: the hint says how to set it
    assert "internal error" not in text and took < 30


def test_a_submitted_jobs_own_niceness_is_not_set_twice(monkeypatch):
    """Ray merges the join's runtime_env into a submitted job's own and refuses two values of
    one variable: where the job's runtime_env already sets RAY_worker_niceness, the join adds
    none (a ValueError from ray.init otherwise)."""
    from asyncflow.runtime import ray_connect

    var = "RAY_JOB_CONFIG_JSON_ENV_VAR"
    monkeypatch.delenv(var, raising=False)
    assert not ray_connect._job_sets_niceness()
    for job, sets in (({"runtime_env": {"env_vars": {"RAY_worker_niceness": "5"}}}, True),
                      ({"runtime_env": {"env_vars": {"OTHER": "1"}, "pip": ["x"]}}, False),
                      ({"runtime_env": None}, False)):
        monkeypatch.setenv(var, json.dumps(job))
        assert ray_connect._job_sets_niceness() is sets, job
    monkeypatch.setenv(var, "not json")
    assert not ray_connect._job_sets_niceness()
