"""Per-token estimators of KL(pi || ref) from the log-probs of the sampled tokens.

Tokens are sampled from pi, so with log r = log ref(x) - log pi(x) (Schulman, "Approximating KL
divergence", 2020):

- k1 = -log r                  unbiased, high variance, can be negative
- k2 = (log r)^2 / 2           biased, low variance, >= 0
- k3 = (r - 1) - log r         unbiased, low variance, >= 0 (the GRPO / DeepSeekMath penalty)

All three are zero where pi == ref. Inputs are tensors of any (equal) shape; the result has it too.
"""
from __future__ import annotations

import torch

from asyncflow.algos.config import AlgoError


def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    # k1 = log pi - log ref
    return logprobs - ref_logprobs


def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    # k2 = 0.5 * (log pi - log ref)^2
    return 0.5 * (logprobs - ref_logprobs).square()


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    # k3 = exp(log ref - log pi) - (log ref - log pi) - 1
    log_r = ref_logprobs - logprobs
    return torch.expm1(log_r) - log_r


ESTIMATORS = {"k1": k1, "k2": k2, "k3": k3}


def kl(name: str, logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """The estimator called ``name`` (k1 | k2 | k3), per token."""
    if name not in ESTIMATORS:
        raise AlgoError(f"unknown KL estimator {name!r} (known: {', '.join(ESTIMATORS)})")
    return ESTIMATORS[name](logprobs, ref_logprobs)
