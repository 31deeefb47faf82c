"""The rules of ``logprob`` tasks: log-probs of a response under a model (a frozen reference,
or the trained policy: proximal log-probs, :func:`asyncflow.kinds.signature`)."""
from __future__ import annotations

from asyncflow.compiler.kinds.base import KindRules


class LogprobRules(KindRules):
    name = "logprob"
    device_parallel = True
