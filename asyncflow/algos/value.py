"""The critic's loss: clipped value regression (PPO, as in OpenAI baselines / CleanRL).

Same positional layout as the policy losses, so one dispatcher serves both:

    value_loss(values, old_values, returns, mask, cfg=None, *, normalizer=None, **unused)

- ``values`` [B, T]: V_phi(s_t) now, with gradient;
- ``old_values`` [B, T]: the values the advantages were computed with (the store's ``values``);
- ``returns`` [B, T]: the targets R_t (gae's ``returns``), or [B] broadcast over the tokens.
"""
from __future__ import annotations

import torch

from asyncflow.algos.ppo import aggregate, as_config, masked_mean, prepare


def value_loss(values, old_values, returns, mask, cfg=None, *, normalizer=None, **unused):
    """v_clip = old_v + clip(v - old_v, -value_clip, value_clip)

    l_t = 0.5 * max((v_t - R_t)^2, (v_clip_t - R_t)^2)

    token-level mean (``loss_agg`` may say otherwise). ``value_clip=None``: l_t = 0.5 (v - R)^2.
    Metrics: ``value_loss``, ``value_clip_frac``, ``value_mean``, ``returns_mean``,
    ``explained_var`` = 1 - Var(R - v) / Var(R)."""
    cfg = as_config(cfg)
    mask, (v, old, ret) = prepare(values, mask, old_values, returns)
    old, ret = old.detach(), ret.detach()
    unclipped = (v - ret).square()
    if cfg.value_clip is None:
        loss_tok, clipped = 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        v_clip = old + torch.clamp(v - old, -cfg.value_clip, cfg.value_clip)
        clipped_sq = (v_clip - ret).square()
        loss_tok, clipped = 0.5 * torch.maximum(unclipped, clipped_sq), clipped_sq > unclipped
    loss = aggregate(loss_tok, mask, cfg.loss_agg or "token_mean", normalizer, cfg.norm_length)
    with torch.no_grad():
        err = ret - v
        var_r = masked_mean((ret - masked_mean(ret, mask)).square(), mask)
        var_e = masked_mean((err - masked_mean(err, mask)).square(), mask)
        metrics = {
            "loss": loss.item(),
            "value_loss": loss.item(),
            "value_clip_frac": masked_mean(clipped.to(mask.dtype), mask).item(),
            "value_mean": masked_mean(v, mask).item(),
            "returns_mean": masked_mean(ret, mask).item(),
            "explained_var": (1 - var_e / var_r).item() if var_r > 0 else 0.0,
            "tokens": mask.sum().item(),
        }
    return loss, metrics
