"""Where a worker (:class:`asyncflow.runtime.worker.Worker`) runs, and what differs there: a
thread of the driver's process (the local backend) or a thread of a Ray actor's process -- its
node, how an injected kill kills it, whether a trainer's calls that need no answer go out
on a courier thread (:mod:`asyncflow.runtime.courier`), and whether its read of the next step's
rows is made on a thread of its own while it computes (``reader``).
"""
from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

from asyncflow.runtime.courier import Courier
from asyncflow.runtime.signals import Crash


class ThreadHost:
    """Where a worker runs: a thread of the driver's process (the local backend)."""

    ray = False

    def node(self) -> dict:
        """What names this host's node (workers.json); raises when that is unknown."""
        return {}

    def die(self) -> None:
        """An injected kill: the thread dies as a killed worker (``Worker.kill``)."""
        raise Crash()

    def courier(self, name: str) -> Courier | None:
        """Where a trainer's calls that need no answer go (``Loop.send``): None, made at once
        (a thread's calls to the in-process store and control take microseconds)."""
        return None

    def reader(self, name: str) -> ThreadPoolExecutor | None:
        """Where a trainer's read of the next step goes (``Loop.fetch``): None, made at once."""
        return None


class RayHost(ThreadHost):
    """A thread of a Ray actor's process (the ray backend)."""

    ray = True

    def node(self) -> dict:
        import ray  # noqa: PLC0415 (this module imports no Ray on the local backend)

        return {"node": ray.get_runtime_context().get_node_id()}

    def die(self) -> None:
        """An injected kill: the process dies (SIGKILL), acking nothing."""
        os.kill(os.getpid(), signal.SIGKILL)

    def courier(self, name: str) -> Courier | None:
        """A courier thread: each actor call is a round trip of milliseconds."""
        return Courier(name)

    def reader(self, name: str) -> ThreadPoolExecutor | None:
        """A thread of its own: the store call (a round trip of milliseconds, more while the
        cores are busy) runs while the loop publishes and reports the step before."""
        return ThreadPoolExecutor(1, thread_name_prefix=f"asyncflow-reader:{name}")
