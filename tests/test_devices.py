"""Workers get their devices from Ray (placement rule 7), on a Ray that declares GPUs this
machine does not have (``ray.init(num_gpus=4)``: the CPU twin of a GPU node, the same code
path): each process asks for its plan share of its bundles' GPUs, Ray assigns ids, and
``workers.json`` gives each worker's ``gpus`` and ``device``."""
from __future__ import annotations

import json

import pytest

from asyncflow.runtime.ray_connect import local_worker_priority

ray = pytest.importorskip("ray")

from asyncflow.compiler.pipeline import compile_text  # noqa: E402
from asyncflow.runtime.placement import device_groups, process_resources  # noqa: E402
from asyncflow.runtime.driver import Driver  # noqa: E402

pytestmark = pytest.mark.ray

PIPELINE = """
pipeline: devices
models:
  policy: {init: asyncflow.models:tiny_decoder, args: {layers: 1, hidden: 16}}
  reference: {copy_of: policy, frozen: true}
data:
  prompts: {source: asyncflow.datasets:digits, args: {n: 64, seed: 0}, fields: [prompt, answer]}
pools:
  gen: {devices: 2}
  learn: {devices: 1}
step: {prompts_per_step: 2, samples_per_prompt: 4, steps: 2}
tasks:
  generate:
    kind: rollout
    engine: sim
    model: policy
    pool: gen
    devices_per_replica: 2
    inputs: [prompt]
    outputs: [response, logprobs]
    args: {slots: 4, latency: 0.002}
  ref:
    kind: logprob
    engine: sim
    model: reference
    pool: gen
    devices_per_replica: 2
    inputs: [prompt, response]
    outputs: [ref_logprobs]
  score: {kind: reward, fn: asyncflow.rewards:digits_match, inputs: [prompt, answer, response], outputs: [reward]}
  advantage: {kind: advantage, estimator: grpo, inputs: [reward], outputs: [advantages]}
  update:
    kind: train
    engine: ENGINE
    model: policy
    pool: learn
    loss: grpo
    inputs: [prompt, response, logprobs, ref_logprobs, advantages]
    args: ARGS
sync:
  - {from: update, to: generate, max_staleness: 1}
"""
SIM_TRAIN = PIPELINE.replace("ENGINE", "sim").replace("ARGS", "{seconds_per_sample: 0.0005, micro_batch: 4}")


@pytest.fixture(scope="module", autouse=True)
def ray_with_declared_gpus():
    if ray.is_initialized():
        ray.shutdown()
    with local_worker_priority():  # the workers' niceness, as asyncflow's own
        ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


def test_the_plan_names_each_workers_devices_and_share():
    plan = compile_text(SIM_TRAIN, "devices.yaml", device_kind="gpu")
    w = {x.id: x for x in plan.workers}
    assert w["generate/0"].devices == w["ref/0"].devices == [0, 1]  # pool gen holds devices 0-1
    assert w["update/0"].devices == [2]  # the next pool starts after it
    assert w["score/0"].devices == []
    assert w["generate/0"].resources == {"GPU": 0.5, "CPU": 0.5}  # two tasks time-share gen
    gen = next(p for p in plan.pools if p.name == "gen")
    assert device_groups(plan, gen) == [[0, 1]]  # one Ray bundle of two GPUs for the replica
    procs = [x for x in plan.workers if x.process == w["generate/0"].process]
    assert {x.id for x in procs} == {"generate/0", "ref/0"}
    assert process_resources(procs, {"GPU": 2.0, "CPU": 2.0}) == {"num_gpus": 2.0, "num_cpus": 2.0}


def test_workers_get_rays_gpu_ids(tmp_path):
    """Colocated workers (one process) share their ids; separate pools get disjoint ids;
    ``devices_per_replica: 2`` gets two; pool-less workers get none."""
    plan = compile_text(SIM_TRAIN, "devices.yaml", device_kind="gpu")
    r = Driver(plan, "ray", out_dir=str(tmp_path)).run()
    assert len(r.metrics) == 2
    w = json.loads((tmp_path / "workers.json").read_text())
    gen, ref, upd = w["generate/0"]["gpus"], w["ref/0"]["gpus"], w["update/0"]["gpus"]
    assert len(gen) == 2 and sorted(gen) == sorted(ref), w
    assert len(upd) == 1 and not set(upd) & set(gen), w
    assert w["score/0"]["gpus"] == [] and w["advantage/0"]["gpus"] == []
    assert w["generate/0"]["device"] is None  # the sim engine uses no torch device


def test_share_process_false_splits_one_gpu_between_processes(tmp_path):
    """Two processes on one device (``share_process: false``): each asks half of it, and Ray
    gives both the same id."""
    text = (SIM_TRAIN.replace("  learn: {devices: 1}", "  learn: {devices: 1, share_process: false}")
            .replace("  score: {kind: reward", "  critic_lp:\n    kind: logprob\n    engine: sim\n"
                     "    model: reference\n    pool: learn\n    inputs: [prompt, response]\n"
                     "    outputs: [other_lp]\n    keep: [other_lp]\n  score: {kind: reward"))
    plan = compile_text(text, "devices.yaml", device_kind="gpu")
    r = Driver(plan, "ray", out_dir=str(tmp_path)).run()
    assert len(r.metrics) == 2
    w = json.loads((tmp_path / "workers.json").read_text())
    assert w["update/0"]["pid"] != w["critic_lp/0"]["pid"]
    assert len(w["update/0"]["gpus"]) == 1 and w["update/0"]["gpus"] == w["critic_lp/0"]["gpus"]


@pytest.mark.engine
def test_an_hf_engine_without_cuda_runs_on_the_cpu_and_says_so_once(tmp_path, capfd):
    pytest.importorskip("torch")
    text = PIPELINE.replace("ENGINE", "hf").replace("ARGS", "{lr: 1.0e-3, micro_batch: 4}")
    plan = compile_text(text, "devices.yaml", device_kind="gpu")
    r = Driver(plan, "ray", out_dir=str(tmp_path)).run()
    assert len(r.metrics) == 2
    w = json.loads((tmp_path / "workers.json").read_text())
    assert len(w["update/0"]["gpus"]) == 1 and w["update/0"]["device"] == "cpu"
    err = capfd.readouterr().err
    warned = [x for x in err.splitlines() if "torch sees no CUDA device" in x]
    assert len(warned) == 1 and f"Ray assigned GPU ids {w['update/0']['gpus']}" in warned[0], err


def test_data_parallel_replicas_meet_at_replica_0s_offer():
    """A distributed engine's replicas (DeepSpeed) meet through the control actor at the
    address and free port replica 0 offers (no fixed 29500, no 127.0.0.1 on Ray); one that
    waits for a replica 0 that never comes is AF636, bounded."""
    import threading

    from asyncflow.errors import TaskError
    from asyncflow.runtime import devices
    from asyncflow.runtime.control import Control

    control, got = Control(), {}

    def meet(replica):
        got[replica] = devices.rendezvous(control, "update", replica, 0, use_ray=False, timeout=10)

    late = threading.Thread(target=meet, args=(1,))
    late.start()  # replica 1 asks first and waits for the offer
    meet(0)
    late.join(10)
    assert got[0] == got[1] and got[0]["master_addr"] == "127.0.0.1" and got[0]["local_rank"] == 0
    assert 1024 < got[0]["master_port"] < 65536
    assert devices.rendezvous(control, "update", 1, 0, False)["master_port"] == got[0]["master_port"]
    with pytest.raises(TaskError) as e:  # a new group generation: no offer yet, none comes
        devices.rendezvous(control, "update", 1, 1, use_ray=False, timeout=0.3)
    assert e.value.code == "AF636" and e.value.fields["replica"] == 1


def test_only_replica_0_of_a_trainer_publishes():
    """Lower rule 7: a trainer's replicas hold the same weights; only replica 0 publishes."""
    text = PIPELINE.replace("ENGINE", "deepspeed").replace("ARGS", "{lr: 1.0e-3, micro_batch: 4}")
    plan = compile_text(text.replace("    pool: learn\n", "    pool: learn\n    replicas: 2\n")
                        .replace("  learn: {devices: 1}", "  learn: {devices: 2}"), "devices.yaml",
                        device_kind="cpu")
    ops = {w.id: [o.kind for o in w.ops] for w in plan.workers}
    assert "PUBLISH" in ops["update/0"] and "PUBLISH" not in ops["update/1"]


def test_local_backend_pools_must_fit_the_machines_gpus(monkeypatch, tmp_path):
    """Without Ray, where torch sees CUDA devices but fewer than the pools need (3 here: gen 2,
    learn 1), the run stops with AF609 at the pool that runs out, located in the file, before
    any worker starts (a worker on cuda:2 of a 2-GPU machine would otherwise run on the CPU).
    torch's device count is what the machine reports; here it is set to 2 and 3."""
    import dataclasses

    import torch

    from asyncflow.errors import AsyncflowError
    from asyncflow.runtime.local_backend import LocalBackend

    path = tmp_path / "devices.yaml"
    path.write_text(SIM_TRAIN)
    plan = compile_text(SIM_TRAIN, str(path), device_kind="gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(AsyncflowError) as e:
        LocalBackend._check_devices(dataclasses.asdict(plan))
    text = str(e.value)
    assert "AF609" in text and "the pools need 3 GPU in all, and pool 'learn' is where this " \
        "machine's 2 run out" in text and "devices.yaml:" in text, text
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    LocalBackend._check_devices(dataclasses.asdict(plan))  # fits: no error
