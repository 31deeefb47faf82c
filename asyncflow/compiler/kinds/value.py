"""The rules of ``value`` tasks: a critic's per-token values of a response."""
from __future__ import annotations

from asyncflow.compiler.kinds.base import KindRules


class ValueRules(KindRules):
    name = "value"
    critic = True
    device_parallel = True
