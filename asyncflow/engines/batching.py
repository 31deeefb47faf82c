"""Sequence-length-balanced micro-batches for train tasks.

A train step's rows are split into micro-batches of exactly ``micro_batch`` rows (DESIGN.md, batch
units). Rows differ in length, and a micro-batch costs roughly its token count, so the split should
even out the tokens per micro-batch. :func:`balance_micro_batches` is the classic greedy LPT rule
(longest processing time first) under a cardinality constraint:

1. sort the rows longest first (ties: lower index first);
2. put each row into the micro-batch with the fewest tokens so far that still has room
   (ties: the lower micro-batch number);
3. return each micro-batch's row indices ascending, micro-batches in creation order.

Deterministic; O(N log N). Without the size cap LPT is within 4/3 of the optimal largest bin.

A row count that is not a multiple of ``micro_batch`` (rows dropped upstream, a short last
step) is split, with ``remainder=True``, into ``ceil(N / micro_batch)`` micro-batches whose sizes
differ by at most one (the first ``N % bins`` get the extra row), never above ``micro_batch``:
as few forward passes as whole micro-batches of ``micro_batch`` would take, and no near-empty
last one (a 4 + 4 + 1 split leaves the 1-row pass with a ninth of the tokens; 3 + 3 + 3 evens
them out). When ``N`` is a multiple, the split is the exact one above.
"""
from __future__ import annotations

import heapq


def balance_micro_batches(lengths: list[int], micro_batch: int, *,
                          remainder: bool = False) -> list[list[int]]:
    """Indices of ``lengths`` split into ``len(lengths) // micro_batch`` micro-batches of exactly
    ``micro_batch`` rows each, balancing the token sums greedily (module docstring).

    ``remainder=True`` also accepts a row count that is not a multiple of ``micro_batch``:
    ``ceil(N / micro_batch)`` micro-batches of sizes differing by at most one (module
    docstring); without it such a count is a ``ValueError``."""
    n = len(lengths)
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    if n % micro_batch and not remainder:
        raise ValueError(f"{n} rows do not split into micro-batches of {micro_batch}")
    bins = -(-n // micro_batch)
    # capacities: n // bins each, one more for the first n % bins (all micro_batch when exact)
    cap = [n // bins + (b < n % bins) for b in range(bins)] if bins else []
    out: list[list[int]] = [[] for _ in range(bins)]
    heap = [(0, b) for b in range(bins)]  # (tokens, micro-batch number); full ones leave the heap
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        tokens, b = heapq.heappop(heap)
        out[b].append(i)
        if len(out[b]) < cap[b]:
            heapq.heappush(heap, (tokens + lengths[i], b))
    return [sorted(mb) for mb in out]


def token_sums(lengths: list[int], batches: list[list[int]]) -> list[int]:
    """Tokens per micro-batch (for tests and logs)."""
    return [sum(lengths[i] for i in mb) for mb in batches]
