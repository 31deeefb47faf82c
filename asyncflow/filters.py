"""Filters for ``kind: filter`` tasks (pure Python).

Calling convention: a filter is called *batched*, on a column dict (``dict[field, list]``, one
entry per row) that holds whole GRPO groups (every row of each ``_group`` present), and returns
``list[bool]``, one per row: True keeps the row. A list of row dicts is accepted too.
"""
from __future__ import annotations

from collections import defaultdict


def group_has_variance(rows, field: str = "reward", eps: float = 0.0) -> list[bool]:
    """DAPO dynamic sampling: keep a group only if its rewards are not all equal (a group whose
    samples all score the same has zero GRPO advantage and teaches nothing). Rows are grouped
    by ``_group``; without it, the whole batch is one group. ``eps`` treats rewards closer than
    it as equal."""
    columns = _columns(rows)
    rewards = [float(r) for r in columns[field]]
    groups = columns.get("_group") or [0] * len(rewards)
    by_group: dict = defaultdict(list)
    for g, r in zip(groups, rewards):
        by_group[g].append(r)
    varied = {g: max(rs) - min(rs) > eps for g, rs in by_group.items()}
    return [varied[g] for g in groups]


def _columns(rows) -> dict:
    if isinstance(rows, dict):
        return rows
    rows = list(rows)
    keys = {k for r in rows for k in r}
    return {k: [r.get(k) for r in rows] for k in keys}
