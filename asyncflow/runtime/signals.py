"""How a worker's loop is told to end from inside: :class:`Crash` (tests, ``kill``) and
:class:`Stop` (the run is over). Both are ``BaseException`` so that no user code's ``except
Exception`` swallows them."""
from __future__ import annotations


class Crash(BaseException):
    """Raised inside a worker told to crash (tests): it stops at once, acking nothing."""


class Stop(BaseException):
    """Raised inside a serve loop when the run is over: in-flight samples are abandoned."""
