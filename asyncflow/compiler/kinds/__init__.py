"""Per-kind rules: one module per task kind of :data:`asyncflow.kinds.KINDS`, each a
:class:`~asyncflow.compiler.kinds.base.KindRules`, found by :func:`rules_of`.

The passes iterate over tasks and ask their kind's rules (a trait such as ``trains``, or a
hook such as ``need``) instead of comparing kind names; a new kind is a row of the kinds table
and a module here. ``compiler_tests/test_kind_rules.py`` checks that the two agree.
"""
from __future__ import annotations

from asyncflow.compiler.kinds.advantage import AdvantageRules
from asyncflow.compiler.kinds.base import KindRules, SyncFacts
from asyncflow.compiler.kinds.custom import CustomRules
from asyncflow.compiler.kinds.filter import FilterRules
from asyncflow.compiler.kinds.logprob import LogprobRules
from asyncflow.compiler.kinds.reward import RewardRules
from asyncflow.compiler.kinds.rollout import RolloutRules
from asyncflow.compiler.kinds.train import TrainRules
from asyncflow.compiler.kinds.value import ValueRules
from asyncflow.kinds import KINDS

RULES: dict[str, KindRules] = {r.name: r for r in (
    RolloutRules(), RewardRules(), LogprobRules(), ValueRules(), AdvantageRules(), TrainRules(),
    FilterRules(), CustomRules())}

_NONE = KindRules()  # an unknown kind (the builder's error already): every hook a no-op


def rules_of(kind: str) -> KindRules:
    """The rules of task kind ``kind`` (a no-op set for a kind the table does not know)."""
    return RULES.get(kind, _NONE)


def kinds_that(trait: str) -> tuple[str, ...]:
    """The kinds whose rules have ``trait`` (``trains``, ``samples``, ...), in table order."""
    return tuple(k for k in KINDS if getattr(rules_of(k), trait))


__all__ = ["KindRules", "SyncFacts", "RULES", "rules_of", "kinds_that"]
