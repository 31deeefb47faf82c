"""Advantage estimators: rewards (and values) in, advantages out.

Every estimator has the same leading arguments, so the runtime can call any of them alike:

    fn(rewards, groups, values=None, *, <settings>)

- ``rewards``: one scalar per sample (list of floats, a 1-D numpy array or a 1-D tensor).
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

The arithmetic is numpy's: this module never imports torch (an advantage worker would spend ~2 s
of CPU importing it at start-up). Tensors are still accepted as inputs, on any device and of any
dtype: they are read through their own ``detach`` / ``cpu`` / ``numpy`` (or ``tolist``) methods.
Standard deviations follow torch's: Bessel-corrected when ``unbiased_std`` (TRL, verl), 0 for
fewer than two numbers.
"""
from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence

import numpy as np

from asyncflow.algos.config import AdvantageConfig, AlgoError

_D = AdvantageConfig()


# ----------------------------------------------------------------------------- helpers


def _is_tensor(x) -> bool:
    """A torch tensor, recognised by duck typing (importing torch is what this module avoids)."""
    return hasattr(x, "detach") and hasattr(x, "cpu") and hasattr(x, "tolist")


def _array(x) -> np.ndarray:
    """Numbers (a number, nested lists, a numpy array, a tensor) -> float64 numpy array.

    Mirrors ``torch.as_tensor(x, dtype=torch.float64)``: one-element tensors inside a list count
    as scalars; strings are not numbers. The result may share memory with ``x``: never write to
    it in place."""
    if _is_tensor(x):
        x = x.detach().cpu()
        try:
            x = x.numpy()
        except (TypeError, RuntimeError):  # bfloat16 and others without a numpy dtype
            x = x.tolist()
    elif isinstance(x, (list, tuple)) and x and (_is_tensor(x[0]) or _is_tensor(x[-1])):
        x = [float(e) if _is_tensor(e) else e for e in x]  # as torch: tensor items are scalars
    a = np.asarray(x)
    kind = a.dtype.kind
    if kind in "biuf":
        return a.astype(np.float64, copy=False)
    if kind in "USV":
        raise TypeError(f"expected numbers, got {a.dtype} data")
    return np.asarray(x, dtype=np.float64)  # python ints beyond int64, complex, ...: as float64


def _as_vector(rewards) -> np.ndarray:
    r = _array(rewards)
    if r.ndim != 1:
        raise AlgoError(f"rewards must be one scalar per sample, got shape {tuple(r.shape)}")
    return r


def _group_index(groups: Sequence[Hashable], n: int) -> np.ndarray:
    """Group ids -> bin indices 0..G-1 (equal ids, and only those, share a bin; some bins may be
    empty). Dense, in order of first appearance, unless the ids are integers of a small range."""
    if _is_tensor(groups):
        groups = groups.tolist()
    if len(groups) != n:
        raise AlgoError(f"{n} rewards but {len(groups)} group ids")
    ids = None
    if isinstance(groups, np.ndarray):
        ids = groups
    elif n and isinstance(groups, (list, tuple)) and type(groups[0]) is int:
        ids = np.asarray(groups)
    if ids is not None and n and ids.ndim == 1 and ids.dtype.kind in "iu":
        lo, hi = int(ids.min()), int(ids.max())
        if hi - lo < 4 * n + 16:  # integer ids: offsets from the smallest are the bins
            return (ids - ids.dtype.type(lo)).astype(np.intp)
    dense: dict = {}
    return np.array([dense.setdefault(g, len(dense)) for g in groups], dtype=np.intp)


def _group_mean_std(r: np.ndarray, index: np.ndarray, unbiased: bool):
    """Per-sample mean, std and size of the sample's group (sums in sample order)."""
    g = int(index.max()) + 1
    count = np.bincount(index, minlength=g).astype(np.float64)
    mean = np.bincount(index, weights=r, minlength=g) / count  # an empty bin is never read
    d = r - mean[index]
    sq = np.bincount(index, weights=d * d, minlength=g)
    dof = (count - 1) if unbiased else count
    var = np.where(dof > 0, sq / np.maximum(dof, 1), 0.0)  # one sample: std 0
    return mean[index], np.sqrt(var)[index], count[index]


def _std(x: np.ndarray, unbiased: bool):
    if x.size < 2 or x.min() == x.max():  # equal numbers: exactly 0, as torch's Welford std
        return np.float64(0.0)
    return x.std(ddof=1 if unbiased else 0)


def _pad(rows: Sequence, name: str) -> tuple[np.ndarray, np.ndarray]:
    """List of per-token lists -> padded [B, T] float64 array and its [B, T] bool mask."""
    if _is_tensor(rows):
        rows = _array(rows)
    rows = [_array(x).reshape(-1) for x in rows]
    lengths = np.array([len(x) for x in rows], dtype=np.intp)
    t = int(lengths.max()) if len(rows) else 0
    mask = np.arange(t) < lengths[:, None]
    out = np.zeros((len(rows), t), dtype=np.float64)
    if t:
        out[mask] = np.concatenate(rows)  # row-major: row i's tokens fill its first len_i slots
    return out, mask


def _per_token_rewards(r: np.ndarray, mask: np.ndarray, kl, kl_coef: float,
                       padded_kl: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """r_t = -kl_coef * kl_t at every token, plus the sample's reward at its last token."""
    b, t = mask.shape
    tok = np.zeros((b, t), dtype=np.float64)
    if kl is not None and kl_coef:
        k, kmask = padded_kl if padded_kl is not None else _pad(kl, "kl")
        if kmask.shape != mask.shape or not np.array_equal(kmask, mask):
            raise AlgoError("kl must have one value per response token of every sample")
        tok -= kl_coef * k
    lengths = mask.sum(1)
    has = lengths > 0  # a sample with no tokens has nowhere to put its reward
    rows = np.arange(b)[has]
    tok[rows, lengths[has] - 1] += r[has]
    return tok


def _discounted(x: np.ndarray, factor: float) -> np.ndarray:
    """y_t = x_t + factor * y_{t+1} along each row, y_T = 0."""
    cols = np.ascontiguousarray(x.T)  # one contiguous row per token position
    out = np.empty_like(cols)
    running = np.zeros(x.shape[0], dtype=np.float64)
    for i in reversed(range(cols.shape[0])):
        running = cols[i] + factor * running
        out[i] = running
    return out.T


def _unpad(x: np.ndarray, mask: np.ndarray) -> list[list[float]]:
    flat = x[mask].tolist()
    ends = np.cumsum(mask.sum(1)).tolist()
    return [flat[s:e] for s, e in zip([0] + ends[:-1], ends)]


# ----------------------------------------------------------------------------- estimators
# (np.errstate: like torch, inf / nan inputs or eps = 0 give inf / nan, without warnings)


def grpo(rewards, groups, values=None, *, eps: float = _D.eps,
         scale_by_std: bool = _D.scale_by_std, unbiased_std: bool = _D.unbiased_std) -> list[float]:
    """GRPO (DeepSeekMath): A_i = (r_i - mean(group)) / (std(group) + eps).

    ``scale_by_std=False`` is Dr. GRPO (Liu et al. 2025): A_i = r_i - mean(group).
    """
    r = _as_vector(rewards)
    if r.size == 0:
        return []
    with np.errstate(all="ignore"):
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
    if r.size == 0:
        return []
    with np.errstate(all="ignore"):
        mean, _, n = _group_mean_std(r, _group_index(groups, len(r)), False)
        others = (mean * n - r) / np.maximum(n - 1, 1)
        a = np.where(n > 1, r - others, 0.0)
    return a.tolist()


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
    if r.size == 0:
        return []
    with np.errstate(all="ignore"):
        if group_baseline:
            if groups is None:
                raise AlgoError("reinforce_pp with group_baseline needs group ids")
            r = r - _group_mean_std(r, _group_index(groups, len(r)), unbiased_std)[0]
        if kl is None:
            return ((r - r.mean()) / (_std(r, unbiased_std) + eps)).tolist()
        if len(kl) != len(r):
            raise AlgoError(f"{len(r)} rewards but kl for {len(kl)} samples")
        k, mask = _pad(kl, "kl")
        tok = _per_token_rewards(r, mask, kl, kl_coef, padded_kl=(k, mask))
        ret = _discounted(tok, gamma)  # G_t = r_t + gamma * G_{t+1}
        flat = ret[mask]
        adv = (ret - flat.mean()) / (_std(flat, unbiased_std) + eps) if flat.size else ret
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
    if r.size == 0:
        return [], []
    with np.errstate(all="ignore"):
        v, mask = _pad(values, "values")
        tok = _per_token_rewards(r, mask, kl, kl_coef)
        b = v.shape[0]
        v_next = np.concatenate([v[:, 1:], np.zeros((b, 1))], axis=1)  # pads are 0: V_T = 0
        delta = (tok + gamma * v_next - v) * mask
        adv = _discounted(delta, gamma * lam)  # A_t = delta_t + gamma * lam * A_{t+1}
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
