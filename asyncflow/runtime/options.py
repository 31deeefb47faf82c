"""Run options: the knobs of one run, one frozen :class:`RunOptions` handed down from the CLI
(``asyncflow run``'s flags and the ``ASYNCFLOW_*`` environment variables, read there and only
there: :func:`asyncflow.commands.run.env_options`) to the driver, the backends, the store
handle and the workers. Tests and programs build one directly (or give the driver its fields
as keywords)."""
from __future__ import annotations

from dataclasses import dataclass

#: the longest any call to a runtime actor (store shard, control, weight payload) may take, plus
#: the call's own wait, before the actor counts as lost (``ASYNCFLOW_CALL_TIMEOUT_S``)
DEFAULT_CALL_TIMEOUT_S = 120.0
#: the longest Ray may take to place a pool's placement group (``ASYNCFLOW_PG_TIMEOUT_S``)
DEFAULT_PG_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RunOptions:
    """One run's knobs (``asyncflow run --help`` says what each flag does)."""

    backend: str = "local"  # local (threads) | ray
    address: str | None = None  # --address: the Ray cluster to join
    steps: int | None = None  # --steps: train steps (None: the plan's)
    lease_s: float = 60.0  # --lease-s: seconds before an unacked lease is re-issued
    shards: int = 1  # --store-shards: sample-store shard actors (ray)
    checkpoint_every: int | None = None  # --checkpoint-every K
    keep_checkpoints: int | None = None  # --keep-checkpoints K
    resume: bool = False  # --resume: continue the run directory from its newest checkpoint
    max_restarts: int | None = None  # --max-restarts (None: a dead worker is not restarted)
    stall_timeout: float = 300.0  # --stall-timeout: the watchdog's bound (AF630)
    inject: tuple = ()  # --inject specs, as given or parsed (asyncflow.runtime.faults)
    poll_s: float | None = None  # the driver's loop period (None: the backend's default)
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S  # ASYNCFLOW_CALL_TIMEOUT_S
    pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S  # ASYNCFLOW_PG_TIMEOUT_S
    ray_full: bool = False  # ASYNCFLOW_RAY_FULL=1: a local Ray starts all its processes
