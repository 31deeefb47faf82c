"""The rules of ``reward`` tasks: score each sample with a user function."""
from __future__ import annotations

from asyncflow.compiler.kinds.base import KindRules


class RewardRules(KindRules):
    name = "reward"
    rewards = True
