"""Torch helpers shared by the torch engines: padding layouts, sampling, per-token log-probs.

One layout everywhere (generation, scoring, training), so that a log-prob computed while
sampling is recomputed bit-for-bit-close later:

    [pad .. pad | prompt ids | response ids | pad .. pad]
     left-padded to the longest prompt, right-padded to the longest response

so every response starts at the same column ``P`` (the longest prompt), token ``j`` of a response
is predicted by the logits at column ``P - 1 + j``, and ``position_ids`` count real tokens only.

Attention covers every real token; the *loss* mask (``Packed.response_mask``) may be narrower: a
multi-turn response holds environment observations the policy read but did not generate, and a
row's optional mask (:attr:`asyncflow.tokens.Text.mask`, 0 on those tokens) keeps them out of
every loss, token count, KL and entropy, exactly as if they were padding.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch


@dataclass
class Packed:
    """A batch of (prompt, response) id sequences in the layout of the module docstring."""

    input_ids: torch.Tensor  # [B, P + R] long
    attention_mask: torch.Tensor  # [B, P + R] long, 1 on real tokens
    position_ids: torch.Tensor  # [B, P + R] long
    response_mask: torch.Tensor  # [B, R] float, 1 on response tokens that count (loss mask)
    prompt_len: int  # P
    lengths: list[int]  # response length of each row (all its tokens, masked ones included)

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len:]

    @property
    def tokens(self) -> int:
        """Response tokens that count in the loss (the loss mask's sum)."""
        return int(self.response_mask.sum().item())


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position of every column counting only real tokens (pads get 0)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    # padded Python lists, then one tensor each: a tensor per row cost ~5 ms per 256 rows
    width = max((len(s) for s in seqs), default=0)
    ids = [[pad_id] * (width - len(s)) + list(s) for s in seqs]
    mask = [[0] * (width - len(s)) + [1] * len(s) for s in seqs]
    return (torch.tensor(ids, dtype=torch.long).reshape(len(seqs), width),
            torch.tensor(mask, dtype=torch.long).reshape(len(seqs), width))


def pack(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
         masks: list | None = None) -> Packed:
    """Prompts left-padded, responses right-padded, concatenated (see the module docstring).

    ``masks`` (optional, one entry per row: a 0/1 list as long as the response, or ``None`` for
    all ones) narrows ``response_mask`` to the tokens that count; attention is unchanged."""
    n = len(responses)
    pw = max((len(p) for p in prompts), default=0)
    rw = max((len(r) for r in responses), default=0)
    ids, att, loss = [], [], []
    masked = masks is not None and any(m is not None for m in masks)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        lp, lr = len(p), len(r)
        ids.append([pad_id] * (pw - lp) + list(p) + list(r) + [pad_id] * (rw - lr))
        att.append([0] * (pw - lp) + [1] * (lp + lr) + [0] * (rw - lr))
        m = masks[i] if masked else None
        if m is None:
            loss.append([1.0] * lr + [0.0] * (rw - lr))
        elif len(m) != lr:
            raise ValueError(f"row {i}: mask of {len(m)} for {lr} response tokens")
        else:
            loss.append([float(x) for x in m] + [0.0] * (rw - lr))
    ids_t = torch.tensor(ids, dtype=torch.long).reshape(n, pw + rw)
    mask_t = torch.tensor(att, dtype=torch.long).reshape(n, pw + rw)
    loss_t = torch.tensor(loss, dtype=torch.float32).reshape(n, rw)
    return Packed(ids_t, mask_t, positions(mask_t), loss_t, pw, [len(r) for r in responses])


def loss_masks(responses) -> list | None:
    """Per-row loss masks of a response column (``Text.mask`` where a row is masked, else
    ``None``); ``None`` when no row is masked, so unmasked batches take the plain path."""
    masks = [r.mask if getattr(r, "masked", False) else None for r in responses]
    return masks if any(m is not None for m in masks) else None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[target], per position. ``T <= 0`` (greedy) scores at T = 1."""
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position."""
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def restrict(probs: torch.Tensor, top_p: float, top_k: int = 0) -> torch.Tensor:
    """``probs`` [B, V] with the tokens a draw may not take set to 0 (not renormalised): those
    outside the ``top_k`` most probable (0: none), then outside the smallest prefix, by
    probability, whose mass reaches ``top_p`` (1: none) -- the order of Hugging Face's and
    vLLM's samplers."""
    if 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if 0 < top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        mass = cum[:, -1:] if top_k else 1.0  # of the mass top_k left
        drop = cum - sorted_p >= top_p * mass
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return probs


def draw(logp: torch.Tensor, probs: torch.Tensor, u: torch.Tensor):
    """Inverse-CDF draw: per row, against its cumulative mass of ``probs``, the uniform ``u``
    [B, 1] (exact; 15x faster than torch.multinomial on [256, 100], which was 10% of a
    rollout's time). With right=True the first column whose cumulative mass exceeds u is
    taken, so a column of zero mass (cut by top_k or top_p) is never drawn. Returns (tokens,
    their ``logp``)."""
    cum = probs.cumsum(-1)
    u = u.to(device=cum.device, dtype=cum.dtype) * cum[:, -1:]
    tokens = torch.searchsorted(cum, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def sample(logits: torch.Tensor, temperature: float, top_p: float,
           generator: torch.Generator, top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` [B, V]; returns (tokens [B], logprobs [B]).

    The log-prob is that of the temperature-scaled distribution over the whole vocabulary
    (``log softmax(logits / T)``), the quantity scorers and trainers recompute; ``top_k`` and
    ``top_p`` only restrict the draw (:func:`restrict`). ``temperature <= 0`` is greedy
    (log-prob at T = 1). ``logits`` may live on any device: the work runs there (no copy of
    [B, V] to the host per token), only the B uniforms come from ``generator`` (a CPU
    generator: the same draws on every device)."""
    if temperature <= 0:
        tokens = logits.argmax(-1)
        return tokens, token_logprobs(logits, tokens)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    probs = restrict(logp.exp(), top_p, top_k)
    return draw(logp, probs, torch.rand((probs.shape[0], 1), generator=generator,
                                        dtype=torch.float32))


def rows_to_lists(values: torch.Tensor, lengths: list[int]) -> list[list[float]]:
    """[B, R] -> one list of floats per row, cut to that row's length."""
    out = values.detach().cpu().tolist()
    return [row[:n] for row, n in zip(out, lengths)]


def pad_floats(rows: list, lengths: list[int], width: int) -> torch.Tensor:
    """Per-row float lists (or scalars, broadcast over the row) -> [B, width] float tensor."""
    out = []
    for i, (row, n) in enumerate(zip(rows, lengths)):
        if isinstance(row, (list, tuple)):
            if len(row) != n:
                raise ValueError(f"row {i}: {len(row)} per-token values for {n} response tokens")
            out.append([float(x) for x in row] + [0.0] * (width - n))
        else:
            out.append([float(row)] * n + [0.0] * (width - n))
    return torch.tensor(out, dtype=torch.float32).reshape(len(rows), width)


# ---------------------------------------------------------------------- train steps
# A train step is a sequence of micro-batches (all given at once by ``train_step``, or arriving
# one by one in ``train_stream``). Each micro-batch's loss is taken *unnormalised* (normaliser 1:
# the sum of its per-token or per-sequence terms), its gradient accumulated, and the sum of the
# gradients divided once, at the end, by the step's normaliser, which only then is known. Every
# aggregation of asyncflow.algos is linear in its normaliser (``total / max(normaliser, 1)``,
# normaliser >= 1 whenever a token counts), so this is the step's mean up to summation order.
# ``seq_sum_norm`` (Dr. GRPO) also divides by a length L, by default the padded width of the
# batch it is given; a micro-batch's width depends on the split, so the trainers pass it
# ``norm_length = 1`` and divide by ``sequences * L`` at the end, with L = ``norm_length`` or the
# longest response of the *step* (what one pass over all rows would use): the result no longer
# depends on how the step was split.

NORMALISED = frozenset({"loss", "pg_loss", "value_loss"})  # loss metrics: / normaliser
# metrics ``*_max`` are the step's maximum; metrics ``_*`` are raw sums for metrics that are not
# token-weighted means (the critic's explained variance), kept out of the result
EV_SUMS = ("_n", "_ret", "_ret2", "_err", "_err2")


def explained_variance_sums(values: torch.Tensor, returns: torch.Tensor,
                            mask: torch.Tensor) -> dict[str, float]:
    """Sums (float64) over the masked tokens from which the explained variance of a whole
    step, 1 - Var(R - v) / Var(R), follows exactly however it was split."""
    m = mask.double()
    r, e = returns.detach().double(), (returns - values).detach().double()
    return dict(zip(EV_SUMS, (float(m.sum()), float((m * r).sum()), float((m * r * r).sum()),
                              float((m * e).sum()), float((m * e * e).sum()))))


@dataclass
class Micro:
    """One micro-batch of a train step: its role-keyed columns and, per row, the prompt and
    response ids, the loss mask (``masks`` None: every token counts) and the tokens that count."""

    cols: dict
    prompts: list
    responses: list
    masks: list | None
    counted: list[int]

    def __len__(self) -> int:
        return len(self.responses)

    @property
    def tokens(self) -> int:
        return sum(self.counted)

    @property
    def lengths(self) -> list[int]:
        """Tokens per row, prompt + response (what a forward pass costs)."""
        return [len(p) + len(r) for p, r in zip(self.prompts, self.responses)]

    def take(self, rows) -> "Micro":
        rows = list(rows)
        return Micro({k: [v[i] for i in rows] for k, v in self.cols.items()},
                     [self.prompts[i] for i in rows], [self.responses[i] for i in rows],
                     [self.masks[i] for i in rows] if self.masks is not None else None,
                     [self.counted[i] for i in rows])

    def pack(self, pad_id: int) -> Packed:
        return pack(self.prompts, self.responses, pad_id, self.masks)


class StepSums:
    """What a train step accumulates over its micro-batches: rows, tokens that count, non-empty
    sequences, the longest response, and the metrics (loss metrics summed unnormalised, every
    other one summed weighted by the micro-batch's tokens)."""

    def __init__(self):
        self.rows = self.tokens = self.seqs = self.width = 0
        self.metrics: dict[str, float] = {}

    def add_rows(self, mb: Micro) -> None:
        self.rows += len(mb)
        self.tokens += mb.tokens
        self.seqs += sum(1 for c in mb.counted if c)
        self.width = max([self.width, *(len(r) for r in mb.responses)])

    def add_metrics(self, metrics: dict, tokens: int) -> None:
        for k, v in metrics.items():
            if k.endswith("_max"):
                self.metrics[k] = max(self.metrics.get(k, float("-inf")), float(v))
                continue
            self.metrics[k] = self.metrics.get(k, 0.0) + float(v) * (
                1 if k in NORMALISED or k == "tokens" or k.startswith("_") else tokens)

    def normaliser(self, agg: str, norm_length: int | None = None) -> float:
        """The step's loss normaliser under aggregation ``agg`` (>= 1; see the section note)."""
        if agg == "token_mean":
            denom = self.tokens
        elif agg == "seq_mean":
            denom = self.seqs
        else:  # seq_sum_norm
            denom = self.seqs * (norm_length if norm_length is not None else self.width)
        return float(max(denom, 1))

    @classmethod
    def merged(cls, parts: list["StepSums"]) -> "StepSums":
        """The sums of several replicas' parts of one step."""
        out = cls()
        for o in parts:
            out.rows += o.rows
            out.tokens += o.tokens
            out.seqs += o.seqs
            out.width = max(out.width, o.width)
            for k, v in o.metrics.items():
                if k.endswith("_max"):
                    out.metrics[k] = max(out.metrics.get(k, float("-inf")), v)
                else:
                    out.metrics[k] = out.metrics.get(k, 0.0) + v
        return out

    def result(self, normaliser: float, grad_norm: float, version: int) -> dict[str, float]:
        """The trainer's metrics: loss metrics of the step's mean, token-weighted means of the
        others, ``kl`` (``kl_ref`` else ``approx_kl``), ``grad_norm``, ``tokens``, ``rows``,
        ``version``."""
        m = self.metrics
        out = {k: v / normaliser if k in NORMALISED else v if k.endswith("_max")
               else v / max(self.tokens, 1)
               for k, v in m.items() if k != "tokens" and not k.startswith("_")}
        if "explained_var" in out and all(k in m for k in EV_SUMS):
            n = max(m["_n"], 1.0)
            var_r = m["_ret2"] / n - (m["_ret"] / n) ** 2
            var_e = m["_err2"] / n - (m["_err"] / n) ** 2
            out["explained_var"] = 1 - var_e / var_r if var_r > 0 else 0.0
        out.setdefault("kl", out.get("kl_ref", out.get("approx_kl", 0.0)))
        out.update(grad_norm=float(grad_norm), tokens=float(self.tokens), rows=float(self.rows),
                   version=float(version))
        return out


_CACHE_KW: dict = {}


def cache_kw(model) -> str:
    """The keyword a causal LM's ``forward`` takes its KV cache by: ``cache`` (transformers >=
    5.24, which warns on the old name on every call) or ``past_key_values`` (earlier)."""
    if hasattr(model, "get_base_model"):  # a peft model (LoRA) passes it on to its base
        model = model.get_base_model()
    kind = type(model)
    if kind not in _CACHE_KW:
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        _CACHE_KW[kind] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KW[kind]


def out_cache(out):
    """The KV cache of a model output, under either name (see :func:`cache_kw`)."""
    cache = out.get("cache") if hasattr(out, "get") else None
    return cache if cache is not None else out.past_key_values
