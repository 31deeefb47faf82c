"""A worker's courier: calls whose answer the loop does not need, made in order on a thread of
their own, so that the loop goes on at once.

On Ray each actor call costs a round trip of 1.5-3 ms. At the end of a train step the loop
tells the control of the version it published, acks the step's leases and reports the step;
no answer changes what it does next, and on a trainer-bound pipeline the device waited for all
three (benchmarks/README.md, "scheduling"). The courier makes them one after the other, in the
order they were given (the publish, the ack, the report: the driver never hears of a step whose
rows are not consumed yet), while the loop reads the next step.

Nothing is silent: a call that fails is raised again in the loop, at its next
:meth:`Courier.check` (the worker's ``sync``), as the loop would have raised it itself; and
:meth:`Courier.drain` waits until every call was made (a worker's loop ends with it, so a
finished worker has sent everything).
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class Courier:
    """Calls ``fn(*args)`` in the order :meth:`send` was given them, on one daemon thread."""

    def __init__(self, name: str):
        self._q: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name=f"asyncflow-courier:{name}",
                                         daemon=True)
        self._thread.start()

    def send(self, fn: Callable[..., Any], *args) -> None:
        """Make the call ``fn(*args)`` after those sent before it; a failure of an earlier one
        is raised here first."""
        self.check()
        self._q.put((fn, args))

    def check(self) -> None:
        """Raise the first failed call's exception (once)."""
        e, self._error = self._error, None
        if e is not None:
            raise e

    def drain(self) -> None:
        """Wait until every call sent was made; then :meth:`check`."""
        self._q.join()
        self.check()

    def _work(self) -> None:
        while True:
            fn, args = self._q.get()
            try:
                if self._error is None:  # after a failure the rest are not made
                    fn(*args)
            except BaseException as e:  # noqa: BLE001 -- handed to the loop (check)
                self._error = e
            finally:
                self._q.task_done()
