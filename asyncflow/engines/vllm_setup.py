"""The ``vllm`` engine's start-up and set-up (:mod:`asyncflow.engines.vllm`): what it asks
``vllm.LLM`` for, from the plan, without importing vLLM (:func:`engine_kwargs`,
:func:`memory_utilization`, :func:`bind_cpu_workers`, where its files go, the LoRA adapter's
config and how checkpoint names group into vLLM's layers); the functions every vLLM worker runs
(``collective_rpc``); and what it puts back or quiets process-wide while vLLM starts.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile

from asyncflow.engines.base import EngineSpec

#: gpu_memory_utilization = the plan's share of the device times this (vLLM's own default takes
#: 0.9 of a whole device: the rest is for the CUDA context, NCCL and allocator slack)
MEMORY_MARGIN = 0.9
#: without a plan share (an engine built outside a run) vLLM takes this much of the device
MEMORY_DEFAULT = 0.5
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's max_lora_rank values


# ---------------------------------------------------------------------- start-up (pure parts)
def engine_kwargs(spec: EngineSpec, model_dir: str, cpu: bool, prefix_caching: bool = True) -> dict:
    """The keyword arguments of ``vllm.LLM`` for ``spec`` (no vLLM import):

    - ``tensor_parallel_size``: the task's ``devices_per_replica`` on a GPU plan
      (``spec.extra["devices"]``; on a CPU plan a device is a CPU slot, i.e. a thread, and the
      engine runs one rank); above 1 with vLLM's multiprocess executor (one process per rank).
    - memory: on a CPU vLLM's KV cache is ``kv_cache_gib``; on a GPU ``gpu_memory_utilization``
      (:func:`memory_utilization`).
    - LoRA (``models.<m>.lora``): ``enable_lora`` with one adapter at a time in the batch
      (``max_loras`` 1, two kept loaded: the newest and the one before) and ``max_lora_rank``
      the smallest vLLM rank >= the adapter's ``r``."""
    a = spec.args
    kw = dict(model=model_dir, skip_tokenizer_init=True,
              dtype=a.get("dtype", spec.model.get("dtype") or "float32"), seed=spec.seed,
              enforce_eager=bool(a.get("enforce_eager", True)),
              max_num_seqs=int(a.get("max_num_seqs", 256)),
              enable_prefix_caching=prefix_caching,
              trust_remote_code=bool(spec.model.get("trust_remote_code")))
    tp = int(spec.extra.get("devices") or 1) if spec.extra.get("device_kind") == "GPU" else 1
    kw["tensor_parallel_size"] = tp
    if tp > 1:
        kw["distributed_executor_backend"] = "mp"
    if cpu:
        kw["kv_cache_memory_bytes"] = int(float(a.get("kv_cache_gib", 0.25)) * 2**30)
    else:
        kw["gpu_memory_utilization"] = memory_utilization(spec)
    lora = spec.model.get("lora") or {}
    if lora:
        r = int(lora.get("r", 8))
        rank = next((x for x in LORA_RANKS if x >= r), None)
        if rank is None:
            raise ValueError(f"task {spec.task!r}: vLLM takes LoRA ranks up to {LORA_RANKS[-1]}, "
                             f"the adapter's r is {r}")
        kw.update(enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=rank)
    return kw


def memory_utilization(spec: EngineSpec) -> float:
    """``gpu_memory_utilization``: the task arg where given; else the plan's share of each of
    the worker's devices (``spec.extra["device_share"]``: 0.5 where two workers time-share a
    GPU) times :data:`MEMORY_MARGIN`, rounded down to 0.01; :data:`MEMORY_DEFAULT` without a
    plan share."""
    given = spec.args.get("gpu_memory_utilization")
    if given is not None:
        return float(given)
    share = spec.extra.get("device_share")
    if not share:
        return MEMORY_DEFAULT
    return max(0.01, int(min(1.0, float(share)) * MEMORY_MARGIN * 100) / 100)


def engine_dir(spec: EngineSpec):
    """``(path, TemporaryDirectory | None)``: where the engine writes its files (the model copy
    vLLM starts from, removed once it started; LoRA adapters): ``<run dir>/engines/<task>.<r>``
    in a run, a temporary directory (``asyncflow-vllm-*``) outside one; :meth:`close`
    removes it."""
    run_dir = spec.extra.get("run_dir")
    if run_dir:
        path = os.path.join(run_dir, "engines", f"{spec.task}.{spec.replica}")
        shutil.rmtree(path, ignore_errors=True)  # a restarted worker's leftovers
        os.makedirs(path)
        return path, None
    tmp = tempfile.TemporaryDirectory(prefix="asyncflow-vllm-")
    return tmp.name, tmp


def bind_cpu_workers(spec: EngineSpec, tp: int) -> None:
    """vLLM on CPU binds each rank's OpenMP threads to cores and, left to itself, wants a NUMA
    node per rank: split this process's cores among the ranks (``VLLM_CPU_OMP_THREADS_BIND``,
    unless set to other than ``auto``), or say why tensor parallelism cannot run here
    (AF654)."""
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < tp:
        from types import SimpleNamespace

        from asyncflow.errors import TaskError

        raise TaskError("AF654", SimpleNamespace(name=spec.task, loc=spec.extra.get("task_loc", "")),
                        tp=tp, why=f"vLLM on a CPU runs each rank on cores of its own and this "
                        f"process has {len(cores) or 'an unknown number of'} core(s)")
    per = len(cores) // tp
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(map(str, cores[i * per:(i + 1) * per])) for i in range(tp))
    try:  # vLLM caches its environment once an engine started in this process
        from vllm import envs

        if getattr(envs, "_is_envs_cache_enabled", lambda: False)():
            envs.disable_envs_cache()
            envs.enable_envs_cache()
    except ImportError:
        pass


def layer_groups(names, packed: dict) -> dict[str, list[str]]:
    """Checkpoint names by the vLLM layer they load into: ``...q_proj.weight`` into
    ``...qkv_proj`` where the model packs ``q_proj`` there (its ``packed_modules_mapping``), a
    weight and its bias into their module."""
    into = {part: whole for whole, parts in packed.items() for part in parts}
    groups: dict[str, list[str]] = {}
    for n in sorted(names):
        module, _, _ = n.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        key = f"{parent}.{into[leaf]}" if leaf in into else module
        groups.setdefault(key, []).append(n)
    return groups


def adapter_config(lora: dict, state: dict) -> dict:
    """peft's ``adapter_config.json`` for an adapter whose tensors are ``state`` (its target
    modules named as they appear there: vLLM wants names, not ``all-linear``)."""
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in state})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(lora["r"]),
            "lora_alpha": float(lora["alpha"]), "lora_dropout": float(lora.get("dropout", 0.0)),
            "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "modules_to_save": None, "base_model_name_or_path": None}


# ---------------------------------------------------------------------- on every vLLM worker
# (collective_rpc: in this process, or pickled by reference to the ranks of a tensor-parallel
# engine, so module-level functions, never lambdas); the weights: vLLM's ``reload_weights``
# (model_executor/model_loader/reload) split into its three phases, so that they can arrive in
# chunks over several calls
def scale_model_logits(worker, scale: float) -> None:
    _scale_logits(worker.model_runner.get_model(), scale)


def packed_modules(worker) -> dict:
    return dict(getattr(worker.model_runner.get_model(), "packed_modules_mapping", {}) or {})


def reload_begin(worker) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(worker.model_runner.get_model())


def reload_load(worker, items) -> None:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        worker.model_runner.get_model().load_weights(iter(items))


def reload_end(worker) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    runner = worker.model_runner
    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(runner.get_model(), runner.model_config)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()


# vLLM warnings that this engine's set-up makes expected (it skips vLLM's tokenizer on purpose;
# a rotary embedding has no weights to reload; the global RNG states are put back), by the vLLM
# module that logs them: dropped, so that the other warnings stand out
_EXPECTED = {
    "vllm.engine.arg_utils": ("The global random seed is set to",),
    "vllm.renderers.base": ("Chat template warmup failed",
                            "Using None for EOS token id because tokenizer"),
    # a layer none of whose tensors a partial update (or a tied lm_head) sends keeps its own
    "vllm.model_executor.model_loader.reload.layerwise": (": Failed to load weights",),
    # serve hands vLLM's LLMEngine.add_request token ids, which vLLM 0.32 renders itself
    "vllm.v1.engine.input_processor": ("Passing raw prompts to InputProcessor is deprecated",),
}


class _DropExpected(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(p in msg for p in self.prefixes)


def quiet_expected_warnings() -> None:
    for name, prefixes in _EXPECTED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropExpected) for f in logger.filters):
            logger.addFilter(_DropExpected(prefixes))


@contextlib.contextmanager
def global_rng_kept():
    """vLLM seeds ``random``, numpy and torch process-wide while it starts (in-process): put
    their states back, other engines of the process may draw from them."""
    import random

    import numpy as np
    import torch

    py, npy, pt = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.random.set_rng_state(pt)


def _scale_logits(model, scale: float) -> None:
    """Multiply the model's logits by ``scale`` (vLLM applies ``logits_processor.scale``)."""
    proc = getattr(model, "logits_processor", None)
    if proc is None or not hasattr(proc, "scale"):
        raise TypeError(f"{type(model).__name__} has no logits_processor.scale: the vllm engine "
                        "cannot apply the temperature to its log-probs")
    proc.scale = float(proc.scale) * scale


def check_head_size(config, platform) -> None:
    """vLLM's CPU attention kernels exist for a few head sizes only: say so before it fails."""
    if not platform.is_cpu():
        return
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):
        return
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head not in supported:
        raise ValueError(f"vLLM on CPU supports attention head sizes {supported}, this model has "
                         f"{head} (hidden_size {config.hidden_size} / num_attention_heads "
                         f"{config.num_attention_heads}); e.g. tiny_decoder(hidden=64, heads=2)")
