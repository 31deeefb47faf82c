"""The sample store's seam: :class:`Store`, what the workers, the driver, checkpoints and
``asyncflow simulate`` may call on a store, and nothing else.

Two implementations: :class:`asyncflow.runtime.store.local.SampleStore` (in process: the local backend
and the simulator) and :class:`asyncflow.runtime.store.ray.RayStore` (sharded over Ray actors,
whose shards use only this protocol on the in-process store they hold). The semantics are the
store module's rules (:mod:`asyncflow.runtime.store.local`); ``tests/test_store_contract.py`` runs one
suite against both, so a change to either is held to the same contract.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

from asyncflow.runtime.store.common import Lease


@runtime_checkable
class Store(Protocol):
    # -- rows and fields
    def register_task(self, task: str, inputs: list[str]) -> None: ...

    def add_rows(self, columns: dict[str, list], groups: list[int],
                 versions: list[int] | None = None) -> list[int]: ...

    def write(self, rows: list[int], columns: dict[str, list], *,
              lease_id: int | None = None) -> bool: ...

    def start_rows_at(self, first_row: int) -> None: ...

    # -- leases
    def get(self, task: str, n: int, *, min_rows: int = 1, whole_groups: bool = False,
            group_size: int = 1, max_row: int | None = None, timeout: float = 0.0,
            filter_fn: Callable[[dict], Any] | None = None, min_version: int | None = None,
            fields: list[str] | None = None, lease_s: float | None = None,
            owner: str | None = None) -> Lease | None: ...

    def get_split(self, task: str, n: int, split: int, *, min_rows: int = 1,
                  max_row: int | None = None, timeout: float = 0.0, filter_fn=None,
                  min_version: int | None = None, fields: list[str] | None = None,
                  lease_s: float | None = None, owner: str | None = None) -> list[Lease]: ...

    def ack(self, lease_id: int | Lease, columns: dict[str, list] | None = None) -> bool: ...

    def ack_many(self, lease_ids: list) -> list[bool]: ...

    def ack_rows(self, lease_id: int | Lease, rows: list[int],
                 columns: dict[str, list] | None = None) -> bool: ...

    def release(self, lease_id: int | Lease) -> bool: ...

    def release_rows(self, lease_id: int | Lease, rows: list[int]) -> bool: ...

    def renew(self, lease_id: int | Lease, lease_s: float | None = None) -> bool: ...

    def renew_many(self, lease_ids: list[int], lease_s: float | None = None) -> int: ...

    def revoke(self, owner: str) -> int: ...

    def expire(self, now: float | None = None) -> int: ...

    def stop_waits(self) -> None: ...

    def drop(self, rows: list[int], reason: str) -> int: ...

    # -- inspection and upkeep
    def consumed(self, task: str) -> list[int]: ...

    def pending(self, task: str) -> int: ...

    def stats(self) -> dict: ...

    def gc(self) -> int: ...

    def snapshot(self) -> dict: ...


__all__ = ["Store", "Lease"]
