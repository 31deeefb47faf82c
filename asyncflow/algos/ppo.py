"""On-policy policy losses: PPO, GRPO and DAPO, all the clipped surrogate of PPO.

Every policy loss here and in ``offpolicy.py`` has one signature:

    loss_fn(new_logprobs, old_logprobs, advantages, mask, cfg=None, *,
            ref_logprobs=None, prox_logprobs=None, entropy=None, normalizer=None)
        -> (loss: scalar tensor, metrics: dict[str, float])

- ``new_logprobs`` [B, T]: log pi_theta of the response tokens, with gradient.
- ``old_logprobs`` [B, T]: log-probs recorded by the rollout (the behaviour policy, the store's
  ``logprobs`` column). For the on-policy losses here this is PPO's "old" policy.
- ``advantages`` [B] (one per sample, broadcast over its tokens) or [B, T].
- ``mask`` [B, T]: 1 on response tokens, 0 on padding. Padding changes nothing, whatever it holds.
- ``cfg``: a :class:`~asyncflow.algos.config.LossConfig`, a dict of its fields, or None.
- ``ref_logprobs`` [B, T]: the frozen reference policy, for the KL penalty (``kl_coef > 0``).
- ``prox_logprobs`` [B, T]: the proximal policy (the trainer's weights at the start of this step),
  used by the off-policy losses only; there, None means "the current policy", new_logprobs.detach().
- ``entropy`` [B, T]: per-token entropy of pi_theta (with gradient), for ``entropy_coef`` and the
  ``entropy`` metric.
- ``normalizer``: when a step is split into micro-batches, the step's total number of tokens
  (token_mean) or sequences (seq_mean, seq_sum_norm), so that summing the micro-batch losses
  gives the step's mean. None: this batch's own count.

Metrics are python floats: ``loss``, ``pg_loss``, ``clip_frac`` (share of tokens whose clipped
term was chosen), ``approx_kl`` (k3 estimate of KL(old || new), CleanRL's), ``ratio_mean``,
``tokens``, and ``kl_ref`` / ``entropy`` when those inputs are given.
"""
from __future__ import annotations

import torch

from asyncflow.algos import kl as kl_estimators
from asyncflow.algos.config import AlgoError, LossConfig

AGGREGATIONS = ("token_mean", "seq_mean", "seq_sum_norm")


# ----------------------------------------------------------------------------- shared pieces


def as_config(cfg) -> LossConfig:
    return LossConfig.from_args(cfg)


def prepare(new_logprobs, mask, *tensors):
    """Float mask, and every tensor with its padding set to 0 (so that garbage or inf/nan there
    reaches neither the loss nor the gradient). Advantages of shape [B] become [B, 1]."""
    if new_logprobs.dim() != 2 or mask.shape != new_logprobs.shape:
        raise AlgoError(f"new_logprobs and mask must both be [B, T], got "
                        f"{tuple(new_logprobs.shape)} and {tuple(mask.shape)}")
    keep = mask.bool()
    out = [torch.where(keep, new_logprobs, torch.zeros_like(new_logprobs))]
    for x in tensors:
        if x is None:
            out.append(None)
            continue
        x = torch.as_tensor(x, dtype=new_logprobs.dtype, device=new_logprobs.device)
        if x.dim() == 1:  # one value per sample
            x = x.unsqueeze(-1).expand_as(new_logprobs)
        if x.shape != new_logprobs.shape:
            raise AlgoError(f"expected [B] or [B, T] = {tuple(new_logprobs.shape)}, "
                            f"got {tuple(x.shape)}")
        out.append(torch.where(keep, x, torch.zeros_like(x)))
    return keep.to(new_logprobs.dtype), out


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # sum_t m_t x_t / sum_t m_t   (0 when there are no tokens)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def aggregate(loss_tok, mask, mode: str, normalizer=None, norm_length=None) -> torch.Tensor:
    """Per-token losses [B, T] -> one scalar.

    - token_mean:   sum_{i,t} l_it / (number of tokens)                 (DAPO, PPO)
    - seq_mean:     mean_i [ sum_t l_it / |o_i| ] over non-empty samples  (GRPO)
    - seq_sum_norm: sum_{i,t} l_it / (number of samples * L), L fixed   (Dr. GRPO)
    """
    total = (loss_tok * mask).sum()
    tokens = mask.sum(-1)
    sequences = (tokens > 0).sum()
    if mode == "token_mean":
        denom = mask.sum() if normalizer is None else normalizer
        return total / max(float(denom), 1.0)
    if mode == "seq_mean":
        per_seq = (loss_tok * mask).sum(-1) / tokens.clamp(min=1)
        denom = sequences if normalizer is None else normalizer
        return per_seq.sum() / max(float(denom), 1.0)
    if mode == "seq_sum_norm":
        length = norm_length if norm_length is not None else loss_tok.shape[-1]
        denom = sequences if normalizer is None else normalizer
        return total / max(float(denom) * float(length), 1.0)
    raise AlgoError(f"unknown loss_agg {mode!r} (known: {', '.join(AGGREGATIONS)})")


def clipped_surrogate(ratio, advantages, eps_low: float, eps_high: float):
    """PPO's pessimistic surrogate, per token, as a loss to minimise:

        l_t = -min(rho_t * A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_t)

    Returns (l_t, clipped_t) where clipped_t marks tokens whose clipped term was the minimum.
    """
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    return torch.maximum(unclipped, clipped), clipped > unclipped


def regularise(loss_tok, new, mask, cfg: LossConfig, ref, entropy, metrics: dict):
    """Per-token penalties shared by every policy loss:

        l_t += kl_coef * KL_t(pi || ref)      (estimator cfg.kl_estimator, k3 by default)
        l_t -= entropy_coef * H_t
    """
    if ref is not None:
        kl_tok = kl_estimators.kl(cfg.kl_estimator, new, ref)
        metrics["kl_ref"] = masked_mean(kl_tok.detach(), mask).item()
        if cfg.kl_coef:
            loss_tok = loss_tok + cfg.kl_coef * kl_tok
    elif cfg.kl_coef:
        raise AlgoError("kl_coef > 0 needs ref_logprobs (a reference policy's log-probs)")
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy.detach(), mask).item()
        if cfg.entropy_coef:
            loss_tok = loss_tok - cfg.entropy_coef * entropy
    elif cfg.entropy_coef:
        raise AlgoError("entropy_coef > 0 needs the per-token entropy")
    return loss_tok


def ratio_metrics(log_ratio, mask, clipped=None) -> dict:
    """clip_frac, approx_kl = mean((rho - 1) - log rho), ratio_mean, tokens."""
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        out = {
            "approx_kl": masked_mean((ratio - 1) - log_ratio, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "tokens": mask.sum().item(),
        }
        if clipped is not None:
            out["clip_frac"] = masked_mean(clipped.to(mask.dtype), mask).item()
    return out


def finish(loss_tok, pg_tok, new, mask, cfg, mode, ref, entropy, normalizer, metrics):
    """Add the penalties, aggregate, and fill the loss metrics."""
    loss_tok = regularise(loss_tok, new, mask, cfg, ref, entropy, metrics)
    agg = cfg.loss_agg or mode
    loss = aggregate(loss_tok, mask, agg, normalizer, cfg.norm_length)
    with torch.no_grad():
        metrics["pg_loss"] = aggregate(pg_tok, mask, agg, normalizer, cfg.norm_length).item()
    metrics["loss"] = loss.item()
    return loss, metrics


def _clipped_policy_loss(new_logprobs, old_logprobs, advantages, mask, cfg, ref_logprobs,
                         entropy, normalizer, eps_low, eps_high, mode):
    mask, (new, old, adv, ref, ent) = prepare(new_logprobs, mask, old_logprobs, advantages,
                                               ref_logprobs, entropy)
    old, adv, ref = old.detach(), adv.detach(), None if ref is None else ref.detach()
    # rho_t = pi_theta(o_t) / pi_old(o_t) = exp(log pi_theta - log pi_old)
    log_ratio = torch.clamp(new - old, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    pg_tok, clipped = clipped_surrogate(torch.exp(log_ratio), adv, eps_low, eps_high)
    metrics = ratio_metrics(log_ratio, mask, clipped)
    return finish(pg_tok, pg_tok.detach(), new, mask, cfg, mode, ref, ent, normalizer, metrics)


# ----------------------------------------------------------------------------- the losses


def ppo_loss(new_logprobs, old_logprobs, advantages, mask, cfg=None, *, ref_logprobs=None,
             prox_logprobs=None, entropy=None, normalizer=None):
    """PPO (Schulman et al. 2017): clipped surrogate, ratio in [1 - clip_eps, 1 + clip_eps],
    token-level mean. ``prox_logprobs`` is not used."""
    cfg = as_config(cfg)
    return _clipped_policy_loss(new_logprobs, old_logprobs, advantages, mask, cfg, ref_logprobs,
                                entropy, normalizer, cfg.clip_eps, cfg.clip_eps, "token_mean")


def grpo_loss(new_logprobs, old_logprobs, advantages, mask, cfg=None, *, ref_logprobs=None,
              prox_logprobs=None, entropy=None, normalizer=None):
    """GRPO (DeepSeekMath, Shao et al. 2024):

        L = mean_i [ 1/|o_i| sum_t ( l_t^clip + kl_coef * k3_t(pi || ref) ) ]

    the clipped surrogate (clip_eps both sides) averaged over each response's tokens, then over
    the responses; the KL to the reference is the k3 estimator inside the sum."""
    cfg = as_config(cfg)
    return _clipped_policy_loss(new_logprobs, old_logprobs, advantages, mask, cfg, ref_logprobs,
                                entropy, normalizer, cfg.clip_eps, cfg.clip_eps, "seq_mean")


def dapo_loss(new_logprobs, old_logprobs, advantages, mask, cfg=None, *, ref_logprobs=None,
              prox_logprobs=None, entropy=None, normalizer=None):
    """DAPO (Yu et al. 2025): "clip-higher", ratio in [1 - eps_low, 1 + clip_eps_high] with
    eps_low = clip_eps_low or clip_eps, and a token-level mean over all tokens of the batch:

        L = sum_{i,t} l_t^clip / sum_i |o_i|

    so long responses weigh by their length (GRPO's sequence mean dilutes their tokens)."""
    cfg = as_config(cfg)
    return _clipped_policy_loss(new_logprobs, old_logprobs, advantages, mask, cfg, ref_logprobs,
                                entropy, normalizer, cfg.eps_low, cfg.clip_eps_high, "token_mean")


# ----------------------------------------------------------------------------- for trainers


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0):
    """Per-token log pi(o_t) and entropy H_t from logits [B, T, V] that predict tokens [B, T]
    (already aligned: logits[:, t] scores tokens[:, t]). Returns (logprobs [B, T], entropy [B, T]).
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return chosen, entropy
