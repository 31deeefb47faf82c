"""Set-up of the ``deepspeed`` engine (:mod:`asyncflow.engines.deepspeed`): its DeepSpeed config
and its rank in the replicas' process group.

:func:`ds_config` builds the config ``deepspeed.initialize`` gets from the task's settings (the
ZeRO stage, micro-batch, clipping, the model's dtype) with the ``ds_config`` arg merged over it.
:func:`init_distributed` makes replica ``spec.replica`` of ``spec.replicas`` rank ``replica`` of
a ``replicas``-rank group (setting ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``, so no launcher is needed); :func:`release_distributed` tears it down again. The
args read here (``master_addr``, ``master_port``, ``dist_backend``, ``dist_timeout``) are
declared in :data:`asyncflow.argtable.DEEPSPEED_ARGS` and described in the engine's docstring.
"""
from __future__ import annotations

import copy
import datetime
import os
import socket

import torch
import torch.distributed as dist

from asyncflow.engines.base import EngineSpec

DEFAULT_PORT = 29500


def ds_config(stage: int, micro_batch: int, max_grad_norm, dtype: torch.dtype,
              overrides: dict) -> dict:
    """The DeepSpeed config of a trainer: ZeRO ``stage``, one accumulation step (the engine
    sets the boundary by hand), clipping at ``max_grad_norm`` (off when unset), ``bf16`` or
    ``fp16`` mode for a model in that ``dtype``; ``overrides`` (the ``ds_config`` arg)
    deep-merged over it."""
    config = {
        "train_micro_batch_size_per_gpu": max(micro_batch, 1),
        "gradient_accumulation_steps": 1,  # the boundary is set by hand (engine docstring)
        "gradient_clipping": float(max_grad_norm) if max_grad_norm else 0.0,
        "zero_optimization": {"stage": stage, "overlap_comm": False},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if dtype == torch.bfloat16:  # bf16 weights and compute, fp32 master weights in ZeRO
        config["bf16"] = {"enabled": True}
    elif dtype == torch.float16:
        config["fp16"] = {"enabled": True}
    _merge(config, overrides or {})
    return config


def _merge(base: dict, extra: dict) -> None:
    """Deep-merge ``extra`` into ``base``."""
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = copy.deepcopy(v)


# ---------------------------------------------------------------------- process group

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(spec: EngineSpec, args: dict) -> tuple[int, int]:
    """Join (or, for one replica, create) the data-parallel process group; (world, rank).
    The meeting point: the ``master_addr`` / ``master_port`` args, else the worker's
    (``spec.extra``); else the address is ``MASTER_ADDR`` (default ``127.0.0.1``) and the port a
    free one (one replica) or ``MASTER_PORT`` (default :data:`DEFAULT_PORT`)."""
    import deepspeed  # optional: only a deepspeed trainer needs it

    world, rank = int(spec.replicas), int(spec.replica)
    if dist.is_initialized():
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise RuntimeError(
                f"task {spec.task!r}: this process is already rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not replica {rank} of {world}")
        return world, rank
    port = args.get("master_port") or spec.extra.get("master_port")
    if port is None:
        port = _free_port() if world == 1 else int(os.environ.get("MASTER_PORT", DEFAULT_PORT))
    addr = (args.get("master_addr") or spec.extra.get("master_addr")
            or os.environ.get("MASTER_ADDR", "127.0.0.1"))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(spec.extra.get("local_rank", rank)),
                      WORLD_SIZE=str(world), MASTER_ADDR=str(addr), MASTER_PORT=str(port))
    backend = args.get("dist_backend")
    if backend is None:
        from deepspeed.accelerator import get_accelerator

        backend = get_accelerator().communication_backend_name()
    deepspeed.init_distributed(
        dist_backend=backend, auto_mpi_discovery=False, verbose=False,
        timeout=datetime.timedelta(seconds=float(args.get("dist_timeout", 600))),
        rank=rank, world_size=world)
    return world, rank


def release_distributed() -> None:
    """Tear down this process's process group and DeepSpeed's references to it (its cached
    world, data-parallel and expert groups): ``torch.distributed.destroy_process_group`` alone
    leaves DeepSpeed holding the dead group, and the next engine of the process fails with
    "Group ... is not registered"."""
    if not dist.is_initialized():
        return
    try:
        from deepspeed.comm import comm as ds_comm  # the module: its cdb is set at init
    except ImportError:  # no deepspeed: torch's group is the only one there is
        ds_comm = None
    if ds_comm is not None and ds_comm.cdb is not None:
        ds_comm.destroy_process_group()
        return
    dist.destroy_process_group()
