"""Configuration of the estimators and losses: two dataclasses whose fields say what they mean.

A task's ``args`` (YAML ``args: {...}`` or ``--set``) are read into these with ``from_args``.
A trainer's args mix loss settings with optimiser settings (``lr``, ``micro_batch``), so unknown
keys are ignored by default; ``strict=True`` rejects them (the compiler can use
:func:`unknown_keys` to warn). This module imports no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from asyncflow.errors import AsyncflowError


class AlgoError(AsyncflowError, ValueError):
    """An unknown estimator/loss name, a bad setting, or inputs that do not fit together."""


@dataclass(frozen=True)
class AdvantageConfig:
    """Settings of the advantage estimators (``asyncflow.algos.advantages``)."""

    eps: float = 1e-6  # added to a standard deviation before dividing by it
    scale_by_std: bool = True  # grpo: divide by the group std; False is Dr. GRPO (r - mean only)
    unbiased_std: bool = True  # std with Bessel's correction (n - 1), as torch.std / TRL / verl
    group_baseline: bool = False  # reinforce_pp: subtract the group mean first ("-baseline")
    kl_coef: float = 0.0  # reinforce_pp / gae: per-token reward -kl_coef * kl_t (needs `kl`)
    gamma: float = 1.0  # gae / reinforce_pp: discount per token
    lam: float = 0.95  # gae: lambda, the bias/variance trade-off of the estimate
    whiten: bool = False  # gae: normalise advantages over all tokens of the batch

    @classmethod
    def from_args(cls, args: dict | None = None, strict: bool = False) -> "AdvantageConfig":
        return _from_args(cls, args, strict)


@dataclass(frozen=True)
class LossConfig:
    """Settings of the policy and value losses (``ppo``, ``offpolicy``, ``value``)."""

    # --- clipped surrogate (ppo, grpo, dapo, decoupled_ppo, tis) ---
    clip_eps: float = 0.2  # ratio clipped to [1 - clip_eps, 1 + clip_eps]
    clip_eps_low: float | None = None  # dapo: lower epsilon; None means clip_eps
    clip_eps_high: float = 0.28  # dapo "clip-higher": upper epsilon, ratio <= 1 + clip_eps_high
    log_ratio_clamp: float = 20.0  # |log ratio| clamped before exp (keeps exp finite)
    # --- regularisers (every policy loss) ---
    kl_coef: float = 0.0  # + kl_coef * KL(pi || ref) per token (needs ref_logprobs)
    kl_estimator: str = "k3"  # k1 | k2 | k3 (see asyncflow.algos.kl)
    entropy_coef: float = 0.0  # - entropy_coef * entropy per token (needs entropy)
    # --- how per-token losses become one number ---
    loss_agg: str | None = None  # token_mean | seq_mean | seq_sum_norm; None: the loss's default
    norm_length: int | None = None  # seq_sum_norm (Dr. GRPO): fixed length L; None: padded T
    # --- off-policy corrections (stale samples) ---
    tis_cap: float = 2.0  # tis: importance weight truncated at C, min(pi_prox / pi_behav, C)
    behav_weight_cap: float | None = None  # decoupled_ppo: drop tokens with weight above it
    cispo_eps_low: float = 1.0  # cispo: weight >= 1 - eps_low (1.0: no lower bound, MiniMax-M1)
    cispo_eps_high: float = 2.0  # cispo: weight <= 1 + eps_high
    topr_cap: float = 1.0  # topr: negative-advantage tokens weighted by min(pi / pi_behav, cap)
    topr_level: str = "token"  # topr: ratio per token, or per "sequence" (product over tokens)
    # --- critic ---
    value_clip: float | None = 0.2  # value: v clipped to old_v +- value_clip; None: plain MSE

    @classmethod
    def from_args(cls, args: dict | None = None, strict: bool = False) -> "LossConfig":
        return _from_args(cls, args, strict)

    @property
    def eps_low(self) -> float:
        return self.clip_eps if self.clip_eps_low is None else self.clip_eps_low


def unknown_keys(cls, args: dict | None) -> list[str]:
    """The keys of ``args`` that are not fields of ``cls`` (sorted)."""
    names = {f.name for f in fields(cls)}
    return sorted(k for k in (args or {}) if k not in names)


def _from_args(cls, args: Any, strict: bool):
    if args is None:
        return cls()
    if isinstance(args, cls):
        return args
    if not isinstance(args, dict):
        raise AlgoError(f"{cls.__name__}: expected a dict of settings, got {type(args).__name__}")
    bad = unknown_keys(cls, args)
    if strict and bad:
        known = ", ".join(f.name for f in fields(cls))
        raise AlgoError(f"{cls.__name__}: unknown setting(s) {', '.join(bad)} (known: {known})")
    return replace(cls(), **{k: v for k, v in args.items() if k not in bad})
