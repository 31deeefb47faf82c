"""Continuous batching for the ``hf`` engine (``schedule: queue``): :class:`HFTurnServer` and
:func:`serve` (the protocols in :mod:`asyncflow.engines.base`, section "scheduling").

``HFEngine.generate`` samples a whole batch in one KV-cache decode loop, so the batch lasts as
long as its longest response. Here every request is its own sequence in one shared batch:

- **One forward per step.** Each step runs one decode step over every running request (one
  batched forward over the shared KV cache, ``logits_to_keep=1``). A request that finishes
  (``eos``, or its own length cap) leaves the batch at once: its rows are removed from the cache.
- **Admission.** A free slot (at most ``engine.slots`` running) takes the next queued request in
  the same step: the new prompts are prefilled together (left-padded, attention mask, position
  ids counting real tokens only, as :mod:`asyncflow.engines.torch_common`), their first tokens
  sampled from the prefill, and their caches joined to the batch's, the shorter side
  left-padded with masked zero columns. Leading cache columns that are padding in every
  running row are trimmed after each step, so the cache is as wide as the longest live
  sequence, never wider.
- **Invariant.** The cache holds every token of a running request except its last sampled
  one, which is the next step's input (position = the number of tokens before it).
- **Sampling** is ``torch_common.sample``'s (temperature, ``top_p``, log-probs under
  ``log softmax(logits / T)``; ``T <= 0`` greedy), with one ``torch.Generator`` per request
  seeded from ``(spec.seed, key)``: a request's draws do not depend on what else is in the batch,
  on the replica, or on when it was admitted. At ``T <= 0`` the tokens are those of ``generate``
  and the log-probs agree to float rounding (padding differs).
- **Weights.** ``engine.update_weights`` (called from inside ``pull``) is noticed at the next
  step. With ``spec.extra["on_update"] == "abort"`` every running request restarts from its
  prompt (re-queued first, in order; its generator re-seeded; counted in ``engine.aborted``)
  and its version is the new one. Otherwise (``"continue"``, ``"finish"``) running requests keep
  their tokens and KV cache and go on with the new weights; a request's version stays the
  oldest among its tokens (the one it was admitted under).

Length caps: ``args.max_new_tokens`` is a number or a distribution spec
(:class:`asyncflow.costmodel.Distribution`, as the sim engine's ``latency``); a request's cap
is drawn from it by :func:`length_cap`, deterministically from its key (the store row for a
single-turn sample) and the distribution's ``seed``, rounded and clamped to ``>= 1``. The batch
path (``HFEngine._sample``) applies the same per-row caps.

Only caches made of plain full-attention layers (``transformers`` ``DynamicLayer``) can be
re-batched this way; a model with sliding-window or linear-attention layers is refused at its
first step.
"""
from __future__ import annotations

import hashlib
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from asyncflow import models
from asyncflow.engines import torch_common as tc
from asyncflow.tokens import Text

_SEED_MOD = 2**63 - 1


def length_spec(value: Any):
    """``args.max_new_tokens`` as a :class:`asyncflow.costmodel.Distribution` (a number, a
    numeric string, or a distribution mapping)."""
    from asyncflow.costmodel import Distribution

    if isinstance(value, str):
        value = int(value)
    return Distribution.from_spec(value)


def length_cap(dist, key: Any) -> int:
    """The length cap of the request ``key`` under ``dist``: a draw seeded only by the
    distribution's seed and ``key`` (stable across processes), rounded, at least 1."""
    if dist.dist == "constant":
        x = dist.params["value"]
    else:
        x = dist.sample(random.Random(f"max_new_tokens:{dist.seed}:{key}"))
    return max(1, int(round(x)))


def request_seed(seed: int, key: Any) -> int:
    """Seed of request ``key``'s generator: depends only on (``seed``, ``key``)."""
    digest = hashlib.sha256(f"{int(seed)}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % _SEED_MOD


def sample_rows(logits: torch.Tensor, temperature: float, top_p: float,
                generators: list[torch.Generator], top_k: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`asyncflow.engines.torch_common.sample` with one generator per row: row ``i`` draws
    its uniform from ``generators[i]`` (the same draw ``tc.sample`` makes for a one-row batch)."""
    if temperature <= 0:
        tokens = logits.argmax(-1)
        return tokens, tc.token_logprobs(logits, tokens)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    probs = tc.restrict(logp.exp(), top_p, top_k)
    return tc.draw(logp, probs, torch.cat([torch.rand((1, 1), generator=g, dtype=torch.float32)
                                           for g in generators]))


@dataclass
class _Request:
    key: Any
    prefix: list[int]
    cap: int
    seed: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version: int = 0  # the oldest policy version among its tokens (set at admission)
    generator: torch.Generator | None = None

    def reset(self) -> None:
        self.ids, self.logprobs, self.generator = [], [], None


class QueueServer:
    """What the turn servers share (:class:`HFTurnServer`, ``vllm.VLLMTurnServer``): the
    submit checks, ``poll`` over the subclass's ``step()``, and ``in_flight``. A subclass keeps
    ``queue`` (waiting requests), ``running`` (a sized collection), ``finished`` and ``_keys``."""

    def _check_new(self, key: Any, prefix_ids: list[int]) -> None:
        if key in self._keys:
            raise ValueError(f"request {key!r} is already in flight")
        if not prefix_ids:
            raise ValueError(f"request {key!r} has an empty prefix")

    def poll(self, timeout_s: float = 0.0) -> list[tuple[Any, list[int], list[float], int]]:
        """Step until a request finishes or ``timeout_s`` passes (at least one step when any
        request is in flight); return the finished ``(key, ids, logprobs, version)``."""
        deadline = time.monotonic() + max(0.0, float(timeout_s))
        while self.queue or self.running:
            self.step()
            if self.finished or time.monotonic() >= deadline:
                break
        else:
            left = deadline - time.monotonic()
            if left > 0 and not self.finished:
                time.sleep(left)  # nothing in flight: nothing can finish before the timeout
        out, self.finished = self.finished, []
        return out

    def cancel(self, keys) -> int:
        """Drop the queued or running requests among ``keys``; returns how many were."""
        drop = {k for k in keys if k in self._keys}
        if not drop:
            return 0
        self.queue = deque(r for r in self.queue if r.key not in drop)
        self._stop_running(drop)
        self._keys -= drop
        return len(drop)

    def _stop_running(self, keys: set) -> None:
        """Take the running requests among ``keys`` out of the engine (the subclass's)."""
        raise NotImplementedError

    def in_flight(self) -> int:
        return len(self.queue) + len(self.running)


class HFTurnServer(QueueServer):
    """A :class:`asyncflow.engines.base.TurnServer` over an ``HFEngine``'s model (module
    docstring): ``submit`` queues, ``poll`` steps the shared batch, ``cancel`` drops.

    ``submit(key, prefix_ids, max_new_tokens=None)``: the cap defaults to
    :func:`length_cap` of the engine's ``max_new_tokens`` for ``key``. Counters: ``steps``
    (decode forwards), ``prefills``, ``peak_running`` (most requests ever running at once);
    ``engine.aborted`` counts restarts (``engine.cancelled`` is :func:`serve`'s to count:
    a cancelled row, not a request)."""

    def __init__(self, engine, slots: int | None = None):
        self.engine = engine
        self.slots = max(1, int(slots if slots is not None else engine.slots))
        self.stops = set(models.stop_ids(engine.tokenizer))  # a request ends at the first
        self.on_update = engine.spec.extra.get("on_update")
        self.length_dist = getattr(engine, "length_dist", None) or length_spec(
            engine.args.get("max_new_tokens", 16))
        self.seed = int(engine.spec.seed)
        self.queue: deque[_Request] = deque()
        self.running: list[_Request] = []  # request i owns row i of the batch state
        self._keys: set = set()
        self.cache = None  # DynamicCache over the running rows
        self.mask: torch.Tensor | None = None  # [B, L] attention over cache columns
        self.pos: torch.Tensor | None = None  # [B] position of each row's pending token
        self.last: torch.Tensor | None = None  # [B] pending token (sampled, not yet cached)
        self.version = int(engine.version)  # the weights the batch state has seen last
        self.finished: list[tuple[Any, list[int], list[float], int]] = []
        self.steps = self.prefills = self.peak_running = 0
        for name in ("aborted", "cancelled"):
            if not hasattr(engine, name):
                setattr(engine, name, 0)

    # -- the protocol ------------------------------------------------------------------------
    def submit(self, key: Any, prefix_ids: list[int], max_new_tokens: int | None = None) -> None:
        self._check_new(key, prefix_ids)
        cap = (max(1, int(max_new_tokens)) if max_new_tokens is not None
               else length_cap(self.length_dist, key))
        self.queue.append(_Request(key, [int(t) for t in prefix_ids], cap,
                                   request_seed(self.seed, key)))
        self._keys.add(key)

    def _stop_running(self, keys: set) -> None:
        gone = [i for i, r in enumerate(self.running) if r.key in keys]
        if gone:
            self._retire(gone)

    # -- one step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Notice a weight update, run one decode step over the running requests, retire the
        finished ones, admit queued requests into the free slots."""
        version = int(self.engine.version)
        if version != self.version:
            self.version = version
            if self.on_update == "abort" and self.running:
                self.engine.aborted += len(self.running)
                for r in reversed(self.running):
                    r.reset()
                    self.queue.appendleft(r)
                self.running = []
                self._clear()
        if self.running:
            self._decode()
        free = self.slots - len(self.running)
        if free > 0 and self.queue:
            self._admit([self.queue.popleft() for _ in range(min(free, len(self.queue)))])
        self.peak_running = max(self.peak_running, len(self.running))

    def _model(self, **kw):
        e = self.engine
        return e.model(use_cache=True, logits_to_keep=1, **kw)

    def _draw(self, logits: torch.Tensor, reqs: list[_Request]):
        e = self.engine
        tokens, logps = sample_rows(logits, e.temperature, e.top_p, [r.generator for r in reqs],
                                    e.top_k)
        return tokens.cpu(), logps.cpu()  # on the device until here: B ids, not [B, V] logits

    def _take(self, reqs: list[_Request], tokens, logps) -> list[int]:
        """Append each request's new token; the indices of those now finished (emitted)."""
        stops = self.stops
        done = []
        for i, (r, t, lp) in enumerate(zip(reqs, tokens.tolist(), logps.tolist())):
            r.ids.append(int(t))
            r.logprobs.append(float(lp))
            if t in stops or len(r.ids) >= r.cap:
                done.append(i)
                self._keys.discard(r.key)
                self.finished.append((r.key, r.ids, r.logprobs, r.version))
        return done

    def _decode(self) -> None:
        dev = self.engine.device
        n = len(self.running)
        mask = torch.cat([self.mask, torch.ones((n, 1), dtype=self.mask.dtype, device=dev)], 1)
        out = self._model(input_ids=self.last[:, None], attention_mask=mask,
                          position_ids=self.pos[:, None],
                          **{tc.cache_kw(self.engine.model): self.cache})
        self.cache, self.mask = tc.out_cache(out), mask
        self.steps += 1
        tokens, logps = self._draw(out.logits[:, -1], self.running)
        done = self._take(self.running, tokens, logps)
        self.last = tokens.to(dev)
        self.pos = self.pos + 1
        if done:
            self._retire(done)

    def _admit(self, reqs: list[_Request]) -> None:
        """Prefill ``reqs`` together, sample their first tokens, join the live ones to the
        batch."""
        e = self.engine
        for r in reqs:
            r.version = self.version
            r.generator = torch.Generator().manual_seed(r.seed)
        ids, mask = tc.left_pad([r.prefix for r in reqs], e.tokenizer.pad_id)
        ids, mask = ids.to(e.device), mask.to(e.device)
        pos = tc.positions(mask)
        out = self._model(input_ids=ids, attention_mask=mask, position_ids=pos)
        self.prefills += 1
        tokens, logps = self._draw(out.logits[:, -1], reqs)
        done = set(self._take(reqs, tokens, logps))
        keep = [i for i in range(len(reqs)) if i not in done]
        if not keep:
            return
        layers = _layers(tc.out_cache(out))
        index = torch.tensor(keep, device=e.device)
        if len(keep) < len(reqs):
            layers = [(k[index], v[index]) for k, v in layers]
            mask = mask[index]
        last = tokens.to(e.device)[index]
        npos = pos[:, -1][index] + 1
        self.running += [reqs[i] for i in keep]
        if self.cache is None:
            self.cache, self.mask, self.last, self.pos = _cache(layers), mask, last, npos
        else:
            old = _layers(self.cache)
            width = max(self.mask.shape[1], mask.shape[1])
            self.cache = _cache([(torch.cat([_lpad(k0, width), _lpad(k1, width)]),
                                  torch.cat([_lpad(v0, width), _lpad(v1, width)]))
                                 for (k0, v0), (k1, v1) in zip(old, layers)])
            self.mask = torch.cat([_lpad_mask(self.mask, width), _lpad_mask(mask, width)])
            self.last = torch.cat([self.last, last])
            self.pos = torch.cat([self.pos, npos])
        self._trim()

    def _retire(self, rows: list[int]) -> None:
        """Remove batch rows ``rows`` (their requests leave ``running``)."""
        gone = set(rows)
        keep = [i for i in range(len(self.running)) if i not in gone]
        self.running = [self.running[i] for i in keep]
        if not keep:
            self._clear()
            return
        index = torch.tensor(keep, device=self.engine.device)
        self.cache = _cache([(k[index], v[index]) for k, v in _layers(self.cache)])
        self.mask, self.last, self.pos = self.mask[index], self.last[index], self.pos[index]
        self._trim()

    def _trim(self) -> None:
        """Drop leading cache columns that are padding in every running row."""
        live = self.mask.any(0)
        first = int(live.int().argmax())
        if first > 0:
            self.cache = _cache([(k[:, :, first:], v[:, :, first:])
                                 for k, v in _layers(self.cache)])
            self.mask = self.mask[:, first:]

    def _clear(self) -> None:
        self.cache = self.mask = self.last = self.pos = None


def _layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer of a cache of plain full-attention layers."""
    from transformers.cache_utils import DynamicLayer

    out = []
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise NotImplementedError(
                f"continuous batching re-batches full-attention KV caches only; this model's "
                f"cache has a {type(layer).__name__} (use schedule: batch)")
        out.append((layer.keys, layer.values))
    return out


def _cache(layers):
    from transformers import DynamicCache

    return DynamicCache(layers)


def _lpad(t: torch.Tensor, width: int) -> torch.Tensor:
    """[B, H, L, D] -> [B, H, width, D], zero columns on the left."""
    extra = width - t.shape[2]
    if extra <= 0:
        return t
    return torch.cat([t.new_zeros((t.shape[0], t.shape[1], extra, t.shape[3])), t], dim=2)


def _lpad_mask(m: torch.Tensor, width: int) -> torch.Tensor:
    extra = width - m.shape[1]
    return m if extra <= 0 else torch.cat([m.new_zeros((m.shape[0], extra)), m], dim=1)


# -- the engine's serve ------------------------------------------------------------------------

def serve(engine, pull: Callable[[int], Any], emit: Callable[[dict], Any],
          poll_s: float = 0.002, server: HFTurnServer | None = None) -> int:
    """``HFEngine.serve``: continuous batching across calls (base.py, "scheduling").

    Single turn: each pulled row (``prompt``, ``_row``, ``_group``) is one request of an
    :class:`HFTurnServer` keyed by its ``_row``; each step calls ``pull(k)`` once with ``k`` the
    free slots (``0`` when full), so ``pull`` runs between every two decode steps (and every
    ``poll_s`` seconds when idle). A ``"_cancel"`` list in what ``pull`` returns drops those
    rows (those in flight counted in ``engine.cancelled``; never emitted). Each finished sample
    is emitted at once as ``{"_row", "_group"?, "_version", response: Text, logprobs: [...]}``
    (the output roles of ``spec.outputs``). ``pull`` returning ``None`` means no more rows:
    the rows in flight are finished and emitted, then ``serve`` returns the number emitted; an
    exception from ``pull`` (the worker's stop) ends it at once.

    With an environment (``spec.extra["env"]``) episodes are driven by
    :func:`asyncflow.engines.multiturn.serve_episodes` over an :class:`HFTurnServer` (agent
    turn ``t`` of row ``r`` is request ``(r, t)``: its own length cap and generator); a
    cancelled episode counts once in ``engine.cancelled``.
    ``server``: the (fresh) server to use, e.g. to read its counters afterwards."""
    extra = engine.spec.extra
    if extra.get("env"):
        from asyncflow.engines import multiturn

        return multiturn.serve_episodes(
            pull, emit, server or HFTurnServer(engine), engine.tokenizer, extra["env"],
            extra.get("env_args"),
            int(engine.args.get("max_turns") or multiturn.DEFAULT_MAX_TURNS),
            engine.spec.outputs, extra.get("search_path", ()),
            on_cancel=lambda rows: _count_cancelled(engine, rows))
    names = list(engine.spec.outputs) or ["response", "logprobs"]
    tok = engine.tokenizer
    stops = set(models.stop_ids(tok))
    server = server or HFTurnServer(engine)
    meta: dict[Any, tuple[Any, list[int], str]] = {}  # row -> (group, prompt ids, prompt text)
    served = unnamed = 0
    exhausted = False
    while True:
        if not exhausted:
            got = pull(max(0, server.slots - server.in_flight()))
            if got is None:
                exhausted = True
            elif got:
                cancel = [int(r) for r in (got.get("_cancel") or ())]
                if cancel:
                    engine.cancelled += server.cancel(cancel)
                    for r in cancel:
                        meta.pop(r, None)
                prompts = got.get("prompt") or []
                rows = got.get("_row")
                if rows is None:  # rows without a store index: number them here
                    rows = list(range(unnamed, unnamed + len(prompts)))
                    unnamed += len(prompts)
                groups = got.get("_group")
                for i, p in enumerate(prompts):
                    row = int(rows[i])
                    ids, text = models.model_prompt(engine, p)  # a chat: its template
                    meta[row] = (groups[i] if groups is not None else None, ids, text)
                    server.submit(row, ids)
        if not server.in_flight():
            if exhausted:
                return served
            time.sleep(poll_s)
            continue
        for key, ids, lps, version in server.poll(0.0):
            group, prompt, text = meta.pop(key)
            row = {"_row": key, "_version": version}
            if group is not None:
                row["_group"] = group
            row[names[0]] = Text(tok.decode([t for t in ids if t not in stops]), ids, prompt,
                                 prompt_text=text)
            row[names[1]] = lps
            emit(row)
            served += 1


def _count_cancelled(engine, rows) -> None:
    engine.cancelled = getattr(engine, "cancelled", 0) + len(rows)
