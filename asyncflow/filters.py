"""Filters for ``kind: filter`` tasks (pure Python).

Calling convention: a filter is called *batched*, on whole GRPO groups (every row of each group
present), with one column per input in the task's declared order and, as the keyword ``groups``,
the group (prompt) index of every row: ``fn(*columns, groups=[...], **args)``. It returns
``list[bool]``, one per row: True keeps the row.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence


def group_has_variance(rewards: Sequence[float], groups: Sequence | None = None,
                       eps: float = 0.0) -> list[bool]:
    """DAPO dynamic sampling: keep a group only if its rewards are not all equal (a group whose
    samples all score the same has zero GRPO advantage and teaches nothing). Without ``groups``
    the whole batch is one group. ``eps`` treats rewards closer than it as equal."""
    rewards = [float(r) for r in rewards]
    groups = list(groups) if groups is not None else [0] * len(rewards)
    by_group: dict = defaultdict(list)
    for g, r in zip(groups, rewards):
        by_group[g].append(r)
    varied = {g: max(rs) - min(rs) > eps for g, rs in by_group.items()}
    return [varied[g] for g in groups]
