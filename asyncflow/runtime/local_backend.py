"""The ``local`` backend: every worker is a thread of this process, the store an in-process
:class:`~asyncflow.runtime.store.SampleStore`, the control plane a plain
:class:`~asyncflow.runtime.control.Control`."""
from __future__ import annotations

import threading
import time
from typing import Any

from asyncflow.plan import Plan
from asyncflow.runtime.control import Control
from asyncflow.runtime.options import RunOptions
from asyncflow.runtime.placement import check_feasible
from asyncflow.runtime.store import SampleStore
from asyncflow.runtime.worker import Worker


class LocalBackend:
    """Every worker is a thread of this process; the store is an in-process SampleStore."""

    name = "local"
    use_ray = False

    def __init__(self, options: RunOptions | None = None):
        self.options = options or RunOptions()
        self.lease_s = self.options.lease_s
        self.workers: dict[str, Any] = {}
        self.threads: dict[str, threading.Thread] = {}
        self.results: dict[str, dict] = {}

    def make_store(self, plan):
        return SampleStore(self.lease_s)

    def make_control(self) -> tuple[Any, Any]:
        c = Control()
        return c, c  # (what workers get, what the driver calls)

    def start(self, plan_dict: dict, worker_ids: list[str], store, control, t0: float,
              options: dict) -> None:
        self._args = (plan_dict, store, control, t0)
        self._check_devices(plan_dict)
        for wid in worker_ids:
            self._make(wid, options.get("per_worker", {}).get(wid, options))
        for wid in worker_ids:
            self.threads[wid].start()

    @staticmethod
    def _check_devices(plan_dict: dict) -> None:
        """On a GPU plan where torch sees CUDA devices, the pools must fit them (AF609, as on
        Ray): a worker placed on ``cuda:N`` past the last device would otherwise fall back to
        the CPU. Where torch sees none, the engines run on the CPU (the CPU twin; devices.py)."""
        if plan_dict.get("device_kind") != "GPU" or not any(
                w.get("devices") for w in plan_dict.get("workers", [])):
            return
        try:
            import torch
        except ImportError:  # no engine here can use a device either
            return
        if not torch.cuda.is_available():
            return
        check_feasible(Plan.from_dict(plan_dict), [{"GPU": float(torch.cuda.device_count())}],
                       where="this machine's")

    def _make(self, wid: str, options: dict) -> None:
        plan_dict, store, control, t0 = self._args
        w = Worker(plan_dict, wid, store, control, t0, options)
        self.workers[wid] = w

        def body(w=w, wid=wid):
            try:
                res = w.run()
            except BaseException as e:  # the thread dies of anything: the driver sees it
                res = {"worker": wid, "status": "died",
                       "error": f"{e.__class__.__name__}: {e}", "op": w.op}
            if self.workers.get(wid) is w:
                self.results[wid] = res

        self.threads[wid] = threading.Thread(target=body, name=f"asyncflow:{wid}", daemon=True)

    def restart(self, wid: str, options: dict) -> None:
        """A new worker (thread) for ``wid``, which ended (crashed, died)."""
        old = self.workers.get(wid)
        if old is not None:
            old.close_sync()
        self._make(wid, options)
        self.results.pop(wid, None)
        self.threads[wid].start()

    def stack(self, wid: str) -> str:
        w = self.workers.get(wid)
        return w.stack() if w is not None else ""

    def alive(self, wid: str) -> bool:
        th = self.threads.get(wid)
        return bool(th and th.is_alive())

    def finished(self) -> dict[str, dict]:
        return {w: r for w, r in self.results.items()}

    def kill(self, wid: str) -> None:
        self.workers[wid].kill()

    def kill_actor(self, target: str) -> None:
        raise ValueError(f"{target} is not an actor on the local backend")

    def join(self, timeout: float) -> None:
        deadline = time.time() + timeout
        for th in self.threads.values():
            th.join(max(0.0, deadline - time.time()))

    def shutdown(self, keep_ray: bool = False) -> None:
        for w in self.workers.values():
            w.close_sync()
