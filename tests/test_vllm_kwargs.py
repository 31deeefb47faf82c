"""What the ``vllm`` engine asks vLLM for, from the plan (issue 22 item 6), without vLLM:
tensor parallelism from ``devices_per_replica``, ``gpu_memory_utilization`` from the worker's
share of its device, LoRA's rank, and the CPU ranks' core binding. The engine itself, on a real
vLLM: tests/test_vllm_engine.py (``-m vllm``)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncflow.compiler import compile_file
from asyncflow.engines import vllm as ve
from asyncflow.engines import vllm_setup
from asyncflow.engines.base import EngineSpec
from asyncflow.errors import TaskError
from asyncflow.runtime.worker import engine_spec

ROOT = Path(__file__).resolve().parent.parent
MODEL = {"name": "policy", "init": "asyncflow.models:tiny_decoder", "args": {}}


def spec(args=None, model=MODEL, **extra):
    return EngineSpec(task="generate", kind="rollout", model=model, args=dict(args or {}),
                      extra=extra)


def gpu_plan(monkeypatch, *sets):
    monkeypatch.chdir(ROOT)
    return compile_file("pipelines/grpo_digits_vllm.yaml", list(sets), device_kind="gpu")


def test_memory_utilization_is_the_plans_share_of_the_device(monkeypatch):
    # generate and ref time-share the rollout pool's GPU: half of it each, less the margin
    plan = gpu_plan(monkeypatch)
    s = engine_spec(plan, plan.task("generate"), 0)
    assert s.extra["device_kind"] == "GPU" and s.extra["device_share"] == 0.5
    kw = ve.engine_kwargs(s, "/m", cpu=False)
    assert kw["gpu_memory_utilization"] == 0.45
    assert "kv_cache_memory_bytes" not in kw
    # alone on its pool: the whole device, less the margin (vLLM's own 0.9)
    alone = gpu_plan(monkeypatch, "tasks.ref.pool=train")
    s = engine_spec(alone, alone.task("generate"), 0)
    assert s.extra["device_share"] == 1.0
    assert ve.engine_kwargs(s, "/m", cpu=False)["gpu_memory_utilization"] == 0.9
    # three on one device: 1/3 rounded down by placement, then the margin, rounded down
    three = gpu_plan(monkeypatch, "tasks.update.pool=rollout")
    s = engine_spec(three, three.task("generate"), 0)
    assert s.extra["device_share"] == pytest.approx(0.3333)
    assert vllm_setup.memory_utilization(s) == 0.29


def test_memory_utilization_arg_overrides_and_default_without_a_plan():
    given = spec({"gpu_memory_utilization": 0.7}, device_share=0.5)
    assert vllm_setup.memory_utilization(given) == 0.7
    assert vllm_setup.memory_utilization(spec()) == vllm_setup.MEMORY_DEFAULT
    assert vllm_setup.memory_utilization(spec(device_share=0.25)) == 0.22


def test_tensor_parallel_size_from_devices_per_replica(monkeypatch):
    plan = gpu_plan(monkeypatch, "pools.rollout.devices=2", "tasks.generate.devices_per_replica=2",
                    "tasks.ref.pool=train")
    s = engine_spec(plan, plan.task("generate"), 0)
    kw = ve.engine_kwargs(s, "/m", cpu=False)
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "mp"
    one = gpu_plan(monkeypatch)
    kw = ve.engine_kwargs(engine_spec(one, one.task("generate"), 0), "/m", cpu=False)
    assert kw["tensor_parallel_size"] == 1 and "distributed_executor_backend" not in kw
    # on a CPU plan a device is a CPU slot: threads, not ranks
    cpu = compile_file("pipelines/grpo_digits_vllm.yaml",
                       ["pools.rollout.devices=2", "tasks.generate.devices_per_replica=2",
                        "tasks.ref.pool=train"],
                       device_kind="cpu")
    s = engine_spec(cpu, cpu.task("generate"), 0)
    assert s.extra["threads"] == 2
    kw = ve.engine_kwargs(s, "/m", cpu=True)
    assert kw["tensor_parallel_size"] == 1 and kw["kv_cache_memory_bytes"] == 2**28
    assert "gpu_memory_utilization" not in kw


def test_cpu_ranks_are_bound_to_cores_or_a_coded_error(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5}, raising=False)
    ve.bind_cpu_workers(spec(), 2)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    with pytest.raises(TaskError) as e:
        ve.bind_cpu_workers(spec(), 2)
    assert e.value.code == "AF654" and "generate" in str(e.value) and "1 core" in str(e.value)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|0")  # the user's own binding stands
    ve.bind_cpu_workers(spec(), 2)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|0"


def test_lora_rank_and_adapter_config():
    kw = ve.engine_kwargs(spec(model={**MODEL, "lora": {"r": 4, "alpha": 8.0}}), "/m", cpu=True)
    assert kw["enable_lora"] and kw["max_lora_rank"] == 8 and kw["max_loras"] == 1
    assert ve.engine_kwargs(spec(model={**MODEL, "lora": {"r": 16}}), "/m", True)["max_lora_rank"] == 16
    assert "enable_lora" not in ve.engine_kwargs(spec(), "/m", cpu=True)
    with pytest.raises(ValueError, match="LoRA ranks up to 512"):
        ve.engine_kwargs(spec(model={**MODEL, "lora": {"r": 600}}), "/m", cpu=True)
    state = {f"base_model.model.model.layers.0.self_attn.{m}.lora_{ab}.weight": None
             for m in ("q_proj", "v_proj") for ab in "AB"}
    cfg = ve.adapter_config({"r": 4, "alpha": 8.0, "dropout": 0.0}, state)
    assert cfg["target_modules"] == ["q_proj", "v_proj"] and cfg["lora_alpha"] == 8.0


def test_layer_groups_follow_the_models_packing():
    names = ["m.l.0.attn.q_proj.weight", "m.l.0.attn.q_proj.bias", "m.l.0.attn.k_proj.weight",
             "m.l.0.attn.o_proj.weight", "m.l.0.mlp.up_proj.weight", "m.l.0.mlp.gate_proj.weight",
             "m.norm.weight"]
    groups = ve.layer_groups(names, {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                     "gate_up_proj": ["gate_proj", "up_proj"]})
    assert groups == {"m.l.0.attn.qkv_proj": ["m.l.0.attn.k_proj.weight", "m.l.0.attn.q_proj.bias",
                                              "m.l.0.attn.q_proj.weight"],
                      "m.l.0.attn.o_proj": ["m.l.0.attn.o_proj.weight"],
                      "m.l.0.mlp.gate_up_proj": ["m.l.0.mlp.gate_proj.weight",
                                                 "m.l.0.mlp.up_proj.weight"],
                      "m.norm": ["m.norm.weight"]}


def test_lora_on_vllm_compiles_and_deepspeed_is_still_af215(monkeypatch):
    from asyncflow.errors import UserError

    monkeypatch.chdir(ROOT)
    plan = compile_file("pipelines/grpo_digits_vllm.yaml", ["models.policy.lora.r=4"])
    assert plan.task("generate").engine == "vllm"
    with pytest.raises(UserError, match="AF215"):
        compile_file("pipelines/grpo_digits_vllm.yaml",
                     ["models.policy.lora.r=4", "tasks.update.engine=deepspeed"])
