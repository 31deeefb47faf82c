"""Advantage estimators: rewards (and values) in, advantages out.

Every estimator has the same leading arguments, so the runtime can call any of them alike:

    fn(rewards, groups, values=None, *, <settings>)

- ``rewards``: one scalar per sample (list of floats or a 1-D tensor).
- ``groups``: one group id per sample (any hashable; samples of one prompt share it), the store's
  ``_group`` column. Ignored by ``gae``; ``reinforce_pp`` uses it only with ``group_baseline``.
- ``values``: per-token values, one list per sample (``gae`` only).
- ``kl``: (``reinforce_pp``, ``gae``) per-token KL(pi || ref) of each sample, one list per sample,
  folded into the reward as ``-kl_coef * kl_t`` at every token.

They return plain python lists (what the sample store holds): one float per sample, or one list
of floats per sample for per-token estimates. Settings and their defaults are those of
:class:`asyncflow.algos.config.AdvantageConfig`. Arithmetic is done in float64.

Edge cases, the same everywhere: an empty batch gives ``[]``; a group of one sample has no
baseline to compare against, so grpo and rloo give it advantage 0; a zero standard deviation gives
0 / (0 + eps) = 0.
"""
from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence

import torch

from asyncflow.algos.config import AdvantageConfig, AlgoError

_D = AdvantageConfig()


# ----------------------------------------------------------------------------- helpers


def _as_vector(rewards) -> torch.Tensor:
    r = torch.as_tensor(rewards, dtype=torch.float64).detach().cpu()
    if r.dim() != 1:
        raise AlgoError(f"rewards must be one scalar per sample, got shape {tuple(r.shape)}")
    return r


def _group_index(groups: Sequence[Hashable], n: int) -> torch.Tensor:
    """Group ids -> dense indices 0..G-1, in order of first appearance."""
    if isinstance(groups, torch.Tensor):
        groups = groups.tolist()
    if len(groups) != n:
        raise AlgoError(f"{n} rewards but {len(groups)} group ids")
    dense: dict = {}
    return torch.tensor([dense.setdefault(g, len(dense)) for g in groups], dtype=torch.long)


def _group_mean_std(r: torch.Tensor, index: torch.Tensor, unbiased: bool):
    """Per-sample mean, std and size of the sample's group."""
    g = int(index.max()) + 1
    count = torch.zeros(g, dtype=r.dtype).index_add_(0, index, torch.ones_like(r))
    mean = torch.zeros(g, dtype=r.dtype).index_add_(0, index, r) / count
    sq = torch.zeros(g, dtype=r.dtype).index_add_(0, index, (r - mean[index]).square())
    dof = (count - 1) if unbiased else count
    var = torch.where(dof > 0, sq / dof.clamp(min=1), torch.zeros_like(sq))  # one sample: std 0
    return mean[index], var.sqrt()[index], count[index]


def _std(x: torch.Tensor, unbiased: bool) -> torch.Tensor:
    if x.numel() < 2:
        return torch.zeros((), dtype=x.dtype)
    return x.std(unbiased=unbiased)


def _pad(rows: Sequence, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """List of per-token lists -> padded [B, T] float64 tensor and its [B, T] bool mask."""
    rows = [torch.as_tensor(x, dtype=torch.float64).reshape(-1) for x in rows]
    t = max((len(x) for x in rows), default=0)
    out = torch.zeros(len(rows), t, dtype=torch.float64)
    mask = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, x in enumerate(rows):
        out[i, : len(x)] = x
        mask[i, : len(x)] = True
    return out, mask


def _per_token_rewards(r: torch.Tensor, mask: torch.Tensor, kl, kl_coef: float) -> torch.Tensor:
    """r_t = -kl_coef * kl_t at every token, plus the sample's reward at its last token."""
    b, t = mask.shape
    tok = torch.zeros(b, t, dtype=torch.float64)
    if kl is not None and kl_coef:
        k, kmask = _pad(kl, "kl")
        if kmask.shape != mask.shape or not torch.equal(kmask, mask):
            raise AlgoError("kl must have one value per response token of every sample")
        tok -= kl_coef * k
    lengths = mask.sum(1)
    has = lengths > 0  # a sample with no tokens has nowhere to put its reward
    rows = torch.arange(b)[has]
    tok[rows, lengths[has] - 1] += r[has]
    return tok


def _unpad(x: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [row[m].tolist() for row, m in zip(x, mask)]


# ----------------------------------------------------------------------------- estimators


def grpo(rewards, groups, values=None, *, eps: float = _D.eps,
         scale_by_std: bool = _D.scale_by_std, unbiased_std: bool = _D.unbiased_std) -> list[float]:
    """GRPO (DeepSeekMath): A_i = (r_i - mean(group)) / (std(group) + eps).

    ``scale_by_std=False`` is Dr. GRPO (Liu et al. 2025): A_i = r_i - mean(group).
    """
    r = _as_vector(rewards)
    if r.numel() == 0:
        return []
    mean, std, _ = _group_mean_std(r, _group_index(groups, len(r)), unbiased_std)
    a = r - mean
    if scale_by_std:
        a = a / (std + eps)
    return a.tolist()


def rloo(rewards, groups, values=None) -> list[float]:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - (sum(group) - r_i) / (n - 1), leave-one-out mean.

    Equivalently n / (n - 1) * (r_i - mean(group)). A group of one (n = 1) gives 0.
    """
    r = _as_vector(rewards)
    if r.numel() == 0:
        return []
    mean, _, n = _group_mean_std(r, _group_index(groups, len(r)), False)
    others = (mean * n - r) / (n - 1).clamp(min=1)
    return torch.where(n > 1, r - others, torch.zeros_like(r)).tolist()


def reinforce_pp(rewards, groups=None, values=None, *, kl=None, kl_coef: float = _D.kl_coef,
                 gamma: float = _D.gamma, group_baseline: bool = _D.group_baseline,
                 eps: float = _D.eps, unbiased_std: bool = _D.unbiased_std):
    """REINFORCE++ (Hu 2025): returns normalised over the whole batch, no critic, no groups.

    Without ``kl``: A_i = (r_i - mean(batch)) / (std(batch) + eps), one float per sample.

    With ``kl`` (per-token KL of each sample) and ``kl_coef``: per-token rewards
    r_t = -kl_coef * kl_t (+ r_i at the last token), returns G_t = sum_{s >= t} gamma^(s-t) r_s,
    then A_t = (G_t - mean) / (std + eps) over all tokens of the batch; one list per sample.

    ``group_baseline`` (REINFORCE++-baseline): r_i - mean(group) first, then the above.
    """
    r = _as_vector(rewards)
    if r.numel() == 0:
        return []
    if group_baseline:
        if groups is None:
            raise AlgoError("reinforce_pp with group_baseline needs group ids")
        r = r - _group_mean_std(r, _group_index(groups, len(r)), unbiased_std)[0]
    if kl is None:
        return ((r - r.mean()) / (_std(r, unbiased_std) + eps)).tolist()
    if len(kl) != len(r):
        raise AlgoError(f"{len(r)} rewards but kl for {len(kl)} samples")
    _, mask = _pad(kl, "kl")
    tok = _per_token_rewards(r, mask, kl, kl_coef)
    ret = torch.zeros_like(tok)
    running = torch.zeros(len(r), dtype=torch.float64)
    for t in reversed(range(tok.shape[1])):  # G_t = r_t + gamma * G_{t+1}
        running = tok[:, t] + gamma * running
        ret[:, t] = running
    flat = ret[mask]
    adv = (ret - flat.mean()) / (_std(flat, unbiased_std) + eps) if flat.numel() else ret
    return _unpad(adv, mask)


def gae(rewards, groups=None, values=None, *, kl=None, kl_coef: float = _D.kl_coef,
        gamma: float = _D.gamma, lam: float = _D.lam, whiten: bool = _D.whiten,
        eps: float = _D.eps) -> tuple[list[list[float]], list[list[float]]]:
    """GAE (Schulman et al. 2016) over one response's tokens, the reward arriving at the end.

    Per-token reward r_t = 0 (or -kl_coef * kl_t), plus the sample's reward at its last token.
    With V_T = 0 after the last token:

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t          (the value target, "returns")

    Returns ``(advantages, returns)``, each one list per sample of its own length.
    ``whiten`` normalises the advantages over all tokens of the batch (returns are unchanged).
    """
    r = _as_vector(rewards)
    if values is None:
        raise AlgoError("gae needs per-token values (a critic's `values` column)")
    if len(values) != len(r):
        raise AlgoError(f"{len(r)} rewards but values for {len(values)} samples")
    if r.numel() == 0:
        return [], []
    v, mask = _pad(values, "values")
    tok = _per_token_rewards(r, mask, kl, kl_coef)
    b, t = v.shape
    v_next = torch.cat([v[:, 1:], torch.zeros(b, 1, dtype=v.dtype)], dim=1)  # pads are 0: V_T = 0
    delta = (tok + gamma * v_next - v) * mask
    adv = torch.zeros_like(v)
    running = torch.zeros(b, dtype=torch.float64)
    for i in reversed(range(t)):  # A_t = delta_t + gamma * lam * A_{t+1}
        running = delta[:, i] + gamma * lam * running
        adv[:, i] = running
    ret = adv + v
    if whiten and mask.any():
        flat = adv[mask]
        adv = (adv - flat.mean()) / (_std(flat, True) + eps)
    return _unpad(adv, mask), _unpad(ret, mask)


# ----------------------------------------------------------------------------- dispatch

FUNCTIONS = {"grpo": grpo, "rloo": rloo, "reinforce_pp": reinforce_pp, "gae": gae}


def _call(name: str, rewards, groups, values, kl, cfg: dict):
    if name not in FUNCTIONS:
        raise AlgoError(f"unknown advantage estimator {name!r} (known: {', '.join(FUNCTIONS)})")
    fn = FUNCTIONS[name]
    conf = AdvantageConfig.from_args(cfg)  # unknown keys ignored; known ones type-checked below
    accepted = inspect.signature(fn).parameters
    kwargs = {k: getattr(conf, k) for k in accepted if hasattr(conf, k)}
    if kl is not None:
        if "kl" not in accepted:
            raise AlgoError(f"estimator {name!r} takes no per-token kl")
        kwargs["kl"] = kl
    return fn(rewards, groups, values, **kwargs)


def estimate(name: str, rewards, groups, values=None, *, kl=None, **cfg) -> list:
    """Advantages by the estimator called ``name`` (a key of ``asyncflow.algos.ESTIMATORS``).

    ``cfg`` holds AdvantageConfig settings; other keys are ignored. gae's returns are dropped
    here: use :func:`estimate_columns` to get them too.
    """
    out = _call(name, rewards, groups, values, kl, cfg)
    return out[0] if name == "gae" else out


def estimate_columns(name: str, rewards, groups, values=None, *, kl=None, **cfg) -> dict:
    """Like :func:`estimate`, as store columns: ``{"advantages": [...]}``, plus ``"returns"``
    for gae (the critic's targets)."""
    out = _call(name, rewards, groups, values, kl, cfg)
    if name == "gae":
        return {"advantages": out[0], "returns": out[1]}
    return {"advantages": out}
