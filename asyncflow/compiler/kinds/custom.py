"""The rules of ``custom`` tasks: any user function over rows or batches (the common rules)."""
from __future__ import annotations

from asyncflow.compiler.kinds.base import KindRules


class CustomRules(KindRules):
    name = "custom"
