"""RL algorithms: advantage estimators and losses, one readable file per family.

The tables below name every estimator and loss *without importing torch*, so the compiler can
resolve ``estimator:`` / ``loss:`` and decide streaming granularity. ``scope`` is how much of a
step an estimator must see at once: ``group`` (all samples of one prompt), ``batch`` (the whole
step), or ``sample``.

Two dispatchers, for the runtime and the trainers (they import torch only when called):

- ``estimate(name, rewards, groups, values=None, *, kl=None, **cfg) -> list`` and
  ``estimate_columns(...) -> {"advantages": [...], ("returns": [...] for gae)}``;
- ``compute_loss(name, new_logprobs, old_logprobs, advantages, mask, cfg=None, *,
  ref_logprobs=None, prox_logprobs=None, entropy=None, normalizer=None) -> (loss, metrics)``;
  for the critic loss ``value`` the first three tensors are values, old_values, returns.

Settings and their defaults: ``asyncflow.algos.config`` (``AdvantageConfig``, ``LossConfig``).
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
    agg: str = "token_mean"  # default reduction of per-token losses (LossConfig.loss_agg wins)


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
    "grpo": LossInfo("asyncflow.algos.ppo:grpo_loss", doc="clipped surrogate, sequence-mean",
                     agg="seq_mean"),
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


def _lookup(table: dict, name: str, what: str):
    from asyncflow.algos.config import AlgoError

    if name not in table:
        raise AlgoError(f"unknown {what} {name!r} (known: {', '.join(table)})")
    return table[name]


def estimate(name: str, rewards, groups, values=None, *, kl=None, **cfg) -> list:
    """Advantages by the estimator ``name``; see ``asyncflow.algos.advantages.estimate``."""
    _lookup(ESTIMATORS, name, "advantage estimator")
    return resolve("asyncflow.algos.advantages:estimate")(name, rewards, groups, values,
                                                          kl=kl, **cfg)


def estimate_columns(name: str, rewards, groups, values=None, *, kl=None, **cfg) -> dict:
    """Advantages (and gae's returns) as store columns."""
    _lookup(ESTIMATORS, name, "advantage estimator")
    return resolve("asyncflow.algos.advantages:estimate_columns")(name, rewards, groups, values,
                                                                  kl=kl, **cfg)


def loss_aggregation(name: str, cfg=None) -> str:
    """How loss ``name`` reduces per-token losses under ``cfg``: token_mean | seq_mean |
    seq_sum_norm. A trainer that splits a step into micro-batches passes, as ``normalizer``,
    the step's token count for token_mean and its (non-empty) sequence count otherwise."""
    from asyncflow.algos.config import LossConfig

    info = _lookup(LOSSES, name, "loss")
    return LossConfig.from_args(cfg).loss_agg or info.agg


def compute_loss(name: str, new_logprobs, old_logprobs, advantages, mask, cfg=None, *,
                 ref_logprobs=None, prox_logprobs=None, entropy=None, normalizer=None):
    """The loss ``name`` (a key of ``LOSSES``) on padded [B, T] tensors -> (loss, metrics).

    ``cfg``: a ``LossConfig``, or a dict (a train task's args; keys that are not LossConfig fields,
    such as ``lr``, are ignored), or None for the defaults. For ``value`` (``critic=True``) the
    tensors are (values, old_values, returns, mask) and the keyword tensors are not used."""
    from asyncflow.algos.config import LossConfig

    info = _lookup(LOSSES, name, "loss")
    fn = resolve(info.target)
    conf = LossConfig.from_args(cfg)
    if info.critic:
        return fn(new_logprobs, old_logprobs, advantages, mask, conf, normalizer=normalizer)
    return fn(new_logprobs, old_logprobs, advantages, mask, conf, ref_logprobs=ref_logprobs,
              prox_logprobs=prox_logprobs, entropy=entropy, normalizer=normalizer)
