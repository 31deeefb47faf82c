"""RL algorithms: advantage estimators and losses, one readable file per family.

The tables below name every estimator and loss *without importing torch*, so the compiler can
resolve ``estimator:`` / ``loss:`` and decide streaming granularity. ``scope`` is how much of a
step an estimator must see at once: ``group`` (all samples of one prompt), ``batch`` (the whole
step), or ``sample``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EstimatorInfo:
    target: str  # "module:function"
    scope: str  # group | batch | sample
    needs_values: bool = False
    doc: str = ""


@dataclass(frozen=True)
class LossInfo:
    target: str
    off_policy: bool = False  # corrects for stale samples (importance weights)
    critic: bool = False  # trains a value head
    doc: str = ""


ESTIMATORS = {
    "grpo": EstimatorInfo("asyncflow.algos.advantages:grpo", "group",
                          doc="(r - mean(group)) / (std(group) + eps)"),
    "rloo": EstimatorInfo("asyncflow.algos.advantages:rloo", "group",
                          doc="r - mean of the other samples of the group"),
    "reinforce_pp": EstimatorInfo("asyncflow.algos.advantages:reinforce_pp", "batch",
                                  doc="r normalised over the whole step's batch"),
    "gae": EstimatorInfo("asyncflow.algos.advantages:gae", "sample", needs_values=True,
                         doc="generalised advantage estimation from per-token values"),
}

LOSSES = {
    "grpo": LossInfo("asyncflow.algos.ppo:grpo_loss", doc="clipped surrogate, sequence-mean"),
    "ppo": LossInfo("asyncflow.algos.ppo:ppo_loss", doc="clipped surrogate"),
    "dapo": LossInfo("asyncflow.algos.ppo:dapo_loss", doc="clip-higher, token-level mean"),
    "cispo": LossInfo("asyncflow.algos.offpolicy:cispo_loss", off_policy=True,
                      doc="clipped IS weight, stop-gradient, REINFORCE"),
    "tis": LossInfo("asyncflow.algos.offpolicy:tis_loss", off_policy=True,
                    doc="truncated importance sampling"),
    "topr": LossInfo("asyncflow.algos.offpolicy:topr_loss", off_policy=True,
                     doc="tapered off-policy REINFORCE"),
    "decoupled_ppo": LossInfo("asyncflow.algos.offpolicy:decoupled_ppo_loss", off_policy=True,
                              doc="behaviour vs proximal policy"),
    "value": LossInfo("asyncflow.algos.value:value_loss", critic=True, doc="clipped value MSE"),
}


def resolve(target: str):
    """Import ``module:function`` (imports torch where the target does)."""
    import importlib

    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)
