"""What a loop asks of its host (:mod:`asyncflow.runtime.loops`).

A host subclasses :class:`~asyncflow.runtime.loops.state.Loop` and overrides the hooks it
needs; :class:`Host` names them, for a reader and a type checker.
"""
from __future__ import annotations

from typing import Protocol


class Host(Protocol):
    """The hooks the loops call (defaults on :class:`~asyncflow.runtime.loops.state.Loop`)."""

    def sync(self, force: bool = False, wait_s: float = 0.0) -> bool:
        """The control plane: flush reports; hear of the stop flag (returned), newer weights
        and removed rows (``Loop.heard_newer``, ``Loop.heard_dropped``)."""

    def clock(self) -> float:
        """Now, in seconds (real or virtual)."""

    def check(self) -> None:
        """Raise ``Crash`` when the worker was killed."""

    def send(self, fn, *args) -> None:
        """Make the call ``fn(*args)``, whose answer the loop does not need (a trainer's publish
        notice, its step's ack and report), now or in order later (the Ray host's courier)."""

    def enter(self, op: str) -> None:
        """Liveness: the loop enters op ``op``."""

    def hold(self, lease, lease_s) -> None:
        """The loop holds ``lease`` until it is acked (a host renews it)."""

    def unhold(self, lease_id) -> None:
        """The loop no longer holds lease ``lease_id``."""

    def inject(self, step: int, rows) -> None:
        """Injected faults due at ``step``."""

    def nan(self, step: int, out: dict) -> dict:
        """``out`` as an injected ``nan`` fault leaves it."""

    def evaluate(self) -> None:
        """eval: evaluate the version held now, if the plan lists it."""

    def publish_version(self, model: str, version: int) -> float:
        """A trainer publishes ``version`` of ``model``; the seconds it took."""

    # the serve loop's (asyncflow.runtime.loops.serve)
    def updating_weights(self) -> bool:
        """The engine is taking up new weights: a pull leases nothing now."""

    def may_pull(self, n: int) -> bool:
        """Whether a pull for ``n`` free slots reads the store now (a backoff, a dry store)."""

    def pulled(self, asked: int, got: int, first: bool) -> None:
        """A pull's READ asked for ``asked`` rows and leased ``got`` (0: found nothing)."""
