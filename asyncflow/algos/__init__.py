"""RL algorithms: advantage estimators and losses, one readable file per family.

The tables ``ESTIMATORS`` and ``LOSSES`` (defined in :mod:`asyncflow.kinds`, with the roles each
reads and writes) name every estimator and loss *without importing torch*, so the compiler can
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

# the tables live with the task kinds (what each estimator and loss reads and writes)
from asyncflow.kinds import ESTIMATORS, LOSSES, EstimatorInfo, LossInfo

__all__ = ["ESTIMATORS", "LOSSES", "EstimatorInfo", "LossInfo", "estimate", "estimate_columns",
           "loss_aggregation", "compute_loss"]


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
