"""What issue 14's measurements rest on: a run's start-up phases (summary and trace.json), the
workers' CPU seconds per op (workers.json ``cpu_s``), the lean local Ray's patch and its way out,
the sim engine's keyed draws, and the serve rollout's one-read-per-pull plan."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from shared_runs import shipped_run

ROOT = Path(__file__).resolve().parent.parent
SIM = str(ROOT / "pipelines" / "sim_longtail.yaml")
PHASES = ["imports and compile", "backend", "store and control", "workers placed", "workers ready"]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """``asyncflow run pipelines/sim_longtail.yaml --backend local --steps 3`` (latencies
    shrunk), a CLI process: the run test_trace_vs_plan.py holds against its plan
    (tests/shared_runs.py)."""
    r = shipped_run(tmp_path_factory, "sim_longtail.yaml", "local").ok()
    return Path(r.out), r.stdout


def test_start_up_phases_are_printed_and_in_the_trace(local_run):
    d, out = local_run
    phases = json.loads((d / "trace.json").read_text())["otherData"]["startup_s"]
    assert list(phases) == PHASES
    assert all(v >= 0 for v in phases.values())
    assert phases["imports and compile"] > 0  # the CLI's own imports and compile
    line = next(x for x in out.splitlines() if x.startswith("start-up (s):"))
    assert all(p in line for p in PHASES)
    total = next(x for x in out.splitlines() if "start-up (s)" in x and "│" in x)
    assert abs(float(total.split("│")[2]) - sum(phases.values())) < 0.02


def test_workers_report_cpu_seconds_per_op(local_run):
    d, _ = local_run
    workers = json.loads((d / "workers.json").read_text())
    by_task = {w["task"]: w["cpu_s"] for w in workers.values()}
    assert set(by_task) == {"generate", "score", "advantage", "update"}
    for task, cpu in by_task.items():
        assert cpu.get("READ", 0) > 0, (task, cpu)  # every worker reads
        assert all(isinstance(v, float) and v > 0 for v in cpu.values())
    assert by_task["update"].get("COMPUTE", 0) > 0 and by_task["generate"].get("COMPUTE", 0) > 0


def test_cpu_seconds_keep_an_op_of_a_few_microseconds_and_leave_out_none():
    """An op that used 30 µs of CPU (a worker beside busy processes) is reported, not rounded
    to 0.0; one that used none (or less than half a µs) is left out."""
    from asyncflow.runtime.worker import cpu_report

    got = cpu_report({"READ": 3e-5, "ACK": 2e-7, "WAIT": 0.0, "COMPUTE": 1.23456789})
    assert got == {"COMPUTE": 1.234568, "READ": 3e-05}
    assert list(got) == sorted(got)


def test_driver_without_the_cli_records_no_import_phase(tmp_path):
    from asyncflow.compiler.pipeline import compile_file
    from asyncflow.runtime.driver import Driver

    plan = compile_file(SIM, ["step.steps=1", "tasks.generate.args.latency.max=0.02",
                                        "tasks.update.args.seconds_per_sample=0.0002"])
    res = Driver(plan, "local", out_dir=str(tmp_path / "r")).run()
    assert list(res.startup) == PHASES[1:]  # no process start given: no import phase


def test_lean_local_ray_patches_only_while_ray_starts():
    pytest.importorskip("ray")
    from ray._private import node as ray_node, parameter as ray_parameter

    from asyncflow.runtime.ray_patch import lean_local_ray

    api, init = ray_node.Node.start_api_server, ray_parameter.RayParams.__init__
    with lean_local_ray(None):
        assert ray_node.Node.start_api_server is not api
        assert ray_parameter.RayParams().no_monitor is True
        assert ray_parameter.RayParams(no_monitor=False).no_monitor is False  # asked: kept
    assert ray_node.Node.start_api_server is api and ray_parameter.RayParams.__init__ is init
    with lean_local_ray(None, full=True):  # ASYNCFLOW_RAY_FULL=1 (RunOptions.ray_full)
        assert ray_node.Node.start_api_server is api
        assert ray_parameter.RayParams().no_monitor is False
    with pytest.raises(RuntimeError):  # restored even when the start fails
        with lean_local_ray(None):
            raise RuntimeError("ray.init failed")
    assert ray_node.Node.start_api_server is api


def test_key_random_is_keyed_and_uniform():
    from asyncflow.engines.sim_draws import KeyRandom, rng, uniforms

    a, b = rng("latency", 5, 12), rng("latency", 5, 12)
    assert [a.random() for _ in range(5)] == [b.random() for _ in range(5)]
    assert rng("latency", 5, 12).random() != rng("latency", 5, 13).random()
    xs = np.array([KeyRandom(f"k:{i}").random() for i in range(20000)])
    assert 0.0 <= xs.min() and xs.max() < 1.0 and abs(xs.mean() - 0.5) < 0.01
    counts = np.bincount([KeyRandom(f"r:{i}").randrange(10) for i in range(20000)], minlength=10)
    assert counts.min() > 1800 and counts.max() < 2200
    with pytest.raises(TypeError):
        KeyRandom("x").seed(3)
    # a batch's draws depend only on (key, row, j): any order, any batch
    u = uniforms(("tokens", 0), [7, 3, 11], 4)
    v = uniforms(("tokens", 0), [11, 7], 6)
    assert np.array_equal(u[0], v[1][:4]) and np.array_equal(u[2], v[0][:4])
    assert u.shape == (3, 4) and (u >= 0).all() and (u < 1).all()


def test_a_lognormal_row_latency_is_the_generators_draw_bit_for_bit():
    from asyncflow.costmodel import Distribution
    from asyncflow.engines.sim_draws import KeyRandom, row_latency

    specs = [{"dist": "lognormal", "median": 5.0, "sigma": 1.0, "max": 60.0, "seed": 5},
             {"dist": "lognormal", "median": 0.02, "sigma": 2.5, "seed": 17},
             {"dist": "lognormal", "median": 1.0, "sigma": 0.0, "seed": 0}]
    rows = list(range(3000)) + [2 ** 40 + 7, 2 ** 62]
    for spec in specs:
        d = Distribution.from_spec(spec)
        drawn = [row_latency(d, r) for r in rows]
        assert drawn == [max(0.0, d.sample(KeyRandom(f"latency:{d.seed}:{r}"))) for r in rows]
    capped = Distribution.from_spec(specs[0])
    assert max(row_latency(capped, r) for r in rows) == 60.0  # the cap applies


def test_sim_outputs_do_not_depend_on_the_batch():
    from asyncflow.engines.base import EngineSpec
    from asyncflow.engines.sim import SimEngine

    eng = SimEngine(EngineSpec(task="g", kind="rollout", model={}, outputs=("response", "logprobs"),
                               args={"response_tokens": {"dist": "uniform", "min": 2, "max": 9,
                                                         "seed": 1}}))
    one = eng._outputs({"_row": [5], "prompt": ["1+2="]}, ["response", "logprobs"])
    many = eng._outputs({"_row": [9, 5, 2], "prompt": ["x", "1+2=", "y"]},
                        ["response", "logprobs"])
    assert one["response"][0] == many["response"][1]
    assert one["response"][0].ids == many["response"][1].ids
    assert one["logprobs"][0] == many["logprobs"][1]
    assert len(one["logprobs"][0]) == len(one["response"][0].ids)
    assert all(x < 0 for x in one["logprobs"][0])


def test_a_serve_rollout_fills_its_free_slots_in_one_read():
    from asyncflow.compiler.pipeline import compile_file

    plan = compile_file(SIM, ["tasks.generate.args.slots=512"])
    read = next(o for o in plan.worker("generate/0").ops if o.kind == "READ")
    assert read.chunk == read.rows == 512
