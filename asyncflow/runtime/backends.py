"""Where workers run: ``local`` (threads in this process: :mod:`asyncflow.runtime.local_backend`)
or ``ray`` (one actor per process of the plan on its placement-group bundles:
:mod:`asyncflow.runtime.ray_backend`). Both hand every worker the same three things: the plan
(plain data), a store handle (:mod:`asyncflow.runtime.store`) and a control handle
(:mod:`asyncflow.runtime.control`).
"""
from __future__ import annotations

from asyncflow.runtime.local_backend import LocalBackend
from asyncflow.runtime.options import RunOptions
from asyncflow.runtime.ray_backend import RayBackend

BACKENDS = {"local": LocalBackend, "ray": RayBackend}


def make_backend(options: RunOptions):
    """The backend ``options.backend`` names, set up with ``options``."""
    try:
        cls = BACKENDS[options.backend]
    except KeyError:
        raise ValueError(f"unknown backend {options.backend!r} (known: {', '.join(BACKENDS)})") from None
    return cls(options)
