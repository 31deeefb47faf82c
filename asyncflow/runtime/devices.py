"""The device a worker's engine runs on (placement rule 7, :mod:`asyncflow.compiler.passes.placement`).

On Ray a worker's process asks for its plan share of its bundles' GPUs
(:meth:`asyncflow.runtime.ray_backend.RayBackend.start`) and Ray assigns it GPU ids, setting
``CUDA_VISIBLE_DEVICES`` to them: the process sees them as ``cuda:0 .. cuda:n-1``, and the engine
runs on ``cuda:0`` (an engine over several devices, e.g. tensor parallel, gets them all). Without
Ray (the local backend, one node) the plan's ``devices`` are the CUDA indices: ``cuda:N``. Where
torch sees no CUDA (a CPU machine, or a Ray cluster that declares GPUs it does not have:
``ray start --num-gpus 2``, the CPU twin of a GPU node) the engine runs on the CPU, said once
per process on stderr. An engine class with ``uses_device = False`` (``sim``) imports no torch
here and is given no device.
"""
from __future__ import annotations

import sys
import threading

_warned: set = set()
_lock = threading.Lock()


def ray_gpu_ids() -> list:
    """The GPU ids Ray assigned this process (ints where Ray gives digits), [] without Ray."""
    try:
        import ray

        if not ray.is_initialized():
            return []
        return [int(x) if str(x).isdigit() else x for x in ray.get_gpu_ids()]
    except ImportError:
        return []


def resolve(device_kind: str, devices: list[int], use_ray: bool, uses_device: bool = True,
            who: str = "") -> dict:
    """``{"gpus": Ray's ids, "device": "cuda:N" | "cpu" | None}`` for worker ``who``."""
    gpus = ray_gpu_ids() if use_ray else []
    if not uses_device:
        return {"gpus": gpus, "device": None}
    local = list(range(len(gpus))) if use_ray else (list(devices) if device_kind == "GPU" else [])
    if not local:
        return {"gpus": gpus, "device": "cpu"}
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > max(local):
        return {"gpus": gpus, "device": f"cuda:{local[0]}"}
    key = ("no-cuda", tuple(gpus) if use_ray else "local")
    with _lock:
        first = key not in _warned
        _warned.add(key)
    if first:
        where = f"Ray assigned GPU ids {gpus}" if use_ray else f"the plan places it on devices {local}"
        print(f"asyncflow: warning: worker {who}: {where}, but torch sees no CUDA device there "
              f"({torch.cuda.device_count()} visible): its engine runs on the CPU (said once per "
              "process)", file=sys.stderr)
    return {"gpus": gpus, "device": "cpu"}


RENDEZVOUS_S = 120.0  # how long replicas > 0 wait for replica 0's address (then AF636)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_address(use_ray: bool) -> str:
    """This node's address as other nodes reach it (Ray's view of it), 127.0.0.1 without Ray."""
    if use_ray:
        import ray

        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def rendezvous(control, task: str, replica: int, generation: int, use_ray: bool,
               timeout: float = RENDEZVOUS_S) -> dict:
    """The meeting point of a data-parallel engine's replicas (``master_addr``,
    ``master_port``; ``local_rank`` 0: each process sees its own devices): replica 0 offers its
    node's address and a free port under ``(task, generation)``, the others wait for it (bounded;
    a coded error names the task when replica 0 never comes). ``generation``: a restarted
    group's new key, so no one meets the dead group's port."""
    import time

    key = f"{task}#{generation}"
    offer = {"master_addr": node_address(use_ray), "master_port": free_port()} if replica == 0 else None
    deadline = time.monotonic() + timeout
    while True:
        got = control.rendezvous(key, offer)
        if got is not None:
            return {**got, "local_rank": 0}
        if time.monotonic() >= deadline:
            from asyncflow.errors import TaskError
            from types import SimpleNamespace

            raise TaskError("AF636", SimpleNamespace(name=task, loc=""), replica=replica,
                            waited=f"{timeout:g}")
        time.sleep(0.1)
