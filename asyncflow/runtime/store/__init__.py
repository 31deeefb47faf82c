"""The streaming sample store (DESIGN.md, "The runtime"; the rules: :mod:`.local`).

==============  ==================================================================
module          what it holds
==============  ==================================================================
``protocol``    :class:`Store`, the seam every store implements
``common``      errors, :class:`Lease`, the checks and list helpers both backends share
``base``        ``StoreBase``: what the in-process store and the simulator's share (lease
                lifecycle, ``write``, inspection, the snapshot's frame)
``local``       :class:`SampleStore`, in process (``select``: its reads; ``leases``: its
                marks' lease bookkeeping)
``codec``       column types and how columns travel between a handle and its shards
``ray``         ``RayStore``, sharded over Ray actors (``shard``: one shard; ``ray_reads``:
                reads across shards; ``remote``: what handle and shards share)
==============  ==================================================================

Importing this package imports no Ray: ``RayStore`` is ``asyncflow.runtime.store.ray.RayStore``.
"""
from asyncflow.runtime.store.common import (BOOKKEEPING, SNAPSHOT_FORMAT, Lease, StoreError,
                                            StoreLost, check_new_rows)
from asyncflow.runtime.store.local import SampleStore
from asyncflow.runtime.store.protocol import Store

__all__ = ["BOOKKEEPING", "SNAPSHOT_FORMAT", "Lease", "SampleStore", "Store", "StoreError",
           "StoreLost", "check_new_rows"]
