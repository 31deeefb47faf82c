"""What the sharded store's handle and its shards share: the bounded ``ray.get`` (a shard that
does not answer is :class:`~asyncflow.runtime.store.common.StoreLost`, never a hang), the lease-id
packing (a handle's lease id packs each shard's part), and the store's size constants.
"""
from __future__ import annotations

import ray

from asyncflow.runtime.store.common import StoreLost

BITS = 40
MASK = (1 << BITS) - 1
POLL_S = 5.0  # the longest one long poll waits before the handle re-polls
INLINE = 64 * 1024  # chunks below this many bytes stay inline in the shard (no object store)
CACHE = 16  # fetched chunks a handle keeps
DONE = 65536  # lease parts a shard remembers as ended by their last row (ack_rows/release_rows)


def bounded_get(refs, limit_s: float):
    """``ray.get`` bounded by ``limit_s``; a shard that times out or died is :class:`StoreLost`."""
    try:
        return ray.get(refs, timeout=limit_s)
    except ray.exceptions.GetTimeoutError:
        raise StoreLost(f"a sample-store shard did not answer within {limit_s:.0f} s") from None
    except ray.exceptions.RayActorError as e:
        raise StoreLost(f"a sample-store shard died ({str(e).splitlines()[0][:200]})") from None


def pack(parts: dict[int, int]) -> int:
    """One lease id from its parts' ids, by shard."""
    return sum(lid << (BITS * s) for s, lid in parts.items())


def unpack(lease_id: int, shards: int) -> dict[int, int]:
    """:func:`pack`'s parts: {shard: its lease id}."""
    return {s: (lease_id >> (BITS * s)) & MASK for s in range(shards) if (lease_id >> (BITS * s)) & MASK}


def joined(answers) -> bool:
    """One lease's answer from its parts': None is a part that had ended with its last row; the
    lease is live while some part is, and an op succeeds when every live part's does."""
    live = [a for a in answers if a is not None]
    return bool(live) and all(live)

