"""The ``hf`` engine: transformers + torch, fp32, CPU (or one GPU via ``args.device``).

``HFEngine(spec)`` implements all three service interfaces; ``spec.kind`` says which one a task
uses (rollout | logprob | value | train). Weights come from ``spec.model["init"]`` through
:func:`asyncflow.models.load` (a ``module:factory`` or a local directory; never a download).

Task args: every one it reads is declared, with its type, default, bounds and the kinds it
applies to, in :data:`asyncflow.argtable.HF_ARGS` (``asyncflow check`` checks them; listed in
docs/language.md, "Args"); a trainer also reads its loss's settings
(:data:`asyncflow.argtable.LOSS_ARGS`, :class:`asyncflow.algos.config.LossConfig`).

Columns are keyed by *role* (:mod:`asyncflow.kinds`), never by the user's field names: the worker
renames the store's fields to roles before a call and back after it. A rollout reads ``prompt``
and writes ``spec.outputs`` = ``[response, logprobs]``
(``response`` a :class:`~asyncflow.tokens.Text`, ``logprobs`` one float per response token under
``log softmax(logits / temperature)``). A ``logprob`` scorer writes ``spec.outputs[0]`` (e.g.
``ref_logprobs``), one float per response token; a ``value`` scorer writes per-token values
``V(s_t)`` from a linear value head on the last hidden state at the position that predicts
token t. A trainer reads ``response``, ``logprobs`` (behaviour), ``advantages`` (one per sample,
or one per token) and optional ``ref_logprobs``; the ``value`` loss reads ``returns`` and
``values`` instead.

The engine is split by responsibility: this module builds it, samples (``generate``; ``serve``
in :mod:`asyncflow.engines.hf_serve`) and scores; the trainer (optimiser, train step, loss) is
:class:`asyncflow.engines.hf_train.HFTrainer`'s and the weights' way in and out (sync, export,
checkpoints) :class:`asyncflow.engines.hf_state.HFWeights`', two mixins ``HFEngine`` inherits.

Reproducibility: initial weights depend only on the model's ``seed`` arg; sampling uses a
``torch.Generator`` seeded with ``spec.seed * 1_000_003 + spec.replica``.
"""
from __future__ import annotations

import torch

from asyncflow import lora, models, prompts
from asyncflow.engines import hf_serve, multiturn
from asyncflow.engines import torch_common as tc
from asyncflow.engines.base import BUILTIN_CAPABILITIES, Columns, EngineSpec
from asyncflow.engines.batching import balance_micro_batches
from asyncflow.engines.hf_state import STATE_FILE, VALUE_HEAD, HFWeights
from asyncflow.engines.hf_train import HFTrainer
from asyncflow.tokens import Text

__all__ = ["HFEngine", "STATE_FILE", "VALUE_HEAD"]


class HFEngine(HFTrainer, HFWeights):
    """A transformers causal LM as rollout, scorer and trainer (see the module docstring)."""

    capabilities = BUILTIN_CAPABILITIES["hf"]

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        args = dict(spec.args)
        self.args = args
        torch.set_num_threads(int(args.get("threads") or spec.extra.get("threads") or 2))
        # the task's device arg, else the worker's (asyncflow.runtime.devices: Ray's GPU or CPU)
        self.device = torch.device(args.get("device") or spec.extra.get("device") or "cpu")
        self.temperature = float(args.get("temperature", spec.extra.get("temperature", 1.0)))
        self.top_p = float(args.get("top_p", 1.0))
        self.top_k = int(args.get("top_k") or 0)
        # a number or a distribution: per-row length caps (hf_serve.length_cap)
        self.max_new_tokens = args.get("max_new_tokens", 16)
        self.length_dist = hf_serve.length_spec(self.max_new_tokens)
        self.cancelled = self.aborted = 0  # serve: rows cancelled / restarts on weight updates
        self.micro_batch = int(args.get("micro_batch") or 0)
        self.version = 0
        self.generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + spec.replica)

        # from where the plan says, in the model's dtype (log-prob math stays float32)
        self.model, self.tokenizer = models.engine_load(spec)
        self.max_positions = prompts.positions(self.model.config)  # a prompt's limit (fit_prompt)
        self.vocab_rows = prompts.embedding_rows(self.model)  # the ids a prompt may hold
        # a LoRA adapter (asyncflow.lora): the trainer trains it, a rollout applies what it gets
        self.lora = dict(spec.model.get("lora") or {})
        if self.lora:
            self.model = lora.wrap(self.model, spec, train=spec.kind == "train")
        self.model.to(self.device)
        self.critic = spec.kind == "value" or spec.loss == "value"
        self.value_head = None
        if self.critic:
            hidden = self.model.config.hidden_size
            # seeded, under the load lock: never interleaved with a colocated engine's draws
            with models.LOAD_LOCK, torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(spec.model.get("args", {}).get("seed", 0)) + 1)
                self.value_head = torch.nn.Linear(hidden, 1).to(self.device)
                torch.nn.init.normal_(self.value_head.weight, std=0.02)
                torch.nn.init.zeros_(self.value_head.bias)
        self.optimizer = None
        self.masters = None  # fp32_master: float32 copies of the trained weights
        if spec.kind == "train":
            self._build_trainer()
        else:
            self.model.eval()
            self.model.requires_grad_(False)

    # ------------------------------------------------------------------ shared

    def _prompt_ids(self, prompt) -> list[int]:
        """The ids the model sees for ``prompt`` (:func:`asyncflow.models.model_prompt`)."""
        return models.model_prompt(self, prompt)[0]

    def _pairs(self, batch: Columns) -> tuple[list[list[int]], list[list[int]]]:
        """(prompt ids, response ids) per row; re-tokenizes only text that is not a Text."""
        responses = batch["response"]
        prompts_col = batch.get("prompt", [None] * len(responses))
        prompts, resps = [], []
        for p, r in zip(prompts_col, responses):
            if isinstance(r, Text) and (r.ids or r.prompt_ids):
                prompts.append(list(r.prompt_ids))
                resps.append(list(r.ids))
            else:
                prompts.append(self._prompt_ids(p))
                resps.append(self.tokenizer.encode(str(r)))
        return prompts, resps

    def _forward(self, packed: tc.Packed):
        """Logits [B, R, V] (policy) or values [B, R] (critic) for the response tokens."""
        ids = packed.input_ids.to(self.device)
        mask = packed.attention_mask.to(self.device)
        pos = packed.position_ids.to(self.device)
        if self.critic:
            base = getattr(self.model, self.model.base_model_prefix)
            hidden = base(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
            p, r = packed.prompt_len, packed.response_mask.shape[1]
            return self.value_head(hidden[:, p - 1:p - 1 + r].float()).squeeze(-1)
        # responses end the layout: the last R + 1 logits cover them (the last one predicts
        # nothing), so the LM head never runs over the prompt columns
        r = packed.response_mask.shape[1]
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                            logits_to_keep=r + 1).logits
        return logits[:, :r]

    def _chunks(self, n: int, lengths: list[int] | None = None):
        """Row indices of ``n`` rows in micro-batches of at most ``micro_batch`` rows (all rows
        when unset): consecutive, or, given per-row token ``lengths``, balanced by their sums
        (:func:`asyncflow.engines.batching.balance_micro_batches`, ``ceil(n / micro_batch)``
        micro-batches of sizes differing by at most one)."""
        size = self.micro_batch if self.micro_batch > 0 else max(n, 1)
        if lengths is None or n <= size:
            return [range(i, min(i + size, n)) for i in range(0, n, size)]
        return balance_micro_batches(lengths, size, remainder=True)

    # ------------------------------------------------------------------ Rollout

    @torch.no_grad()
    def generate(self, batch: Columns) -> Columns:
        """Sample one response per row of ``batch["prompt"]`` (KV cache, left padding); with an
        environment (``spec.extra["env"]``) run one multi-turn episode per row instead
        (:mod:`asyncflow.engines.multiturn`, which adds the ``reward`` column when declared)."""
        out_names = list(self.spec.outputs) or ["response", "logprobs"]
        if self.spec.extra.get("env"):
            return multiturn.rollout_columns(
                batch, self._sample, self.tokenizer, self.spec.extra["env"],
                self.spec.extra.get("env_args"),
                int(self.args.get("max_turns") or multiturn.DEFAULT_MAX_TURNS), out_names,
                self.spec.extra.get("search_path", ()), keys=batch.get("_row"))
        encoded = [models.model_prompt(self, p) for p in batch["prompt"]]
        prompts = [ids for ids, _ in encoded]
        if not prompts:
            return {name: [] for name in out_names[:2]}
        tokens, logprobs = self._sample(prompts, batch.get("_row"))
        stops = set(models.stop_ids(self.tokenizer))
        responses = [Text(self.tokenizer.decode([t for t in ids if t not in stops]), ids, prompt,
                          prompt_text=text)
                     for ids, (prompt, text) in zip(tokens, encoded)]
        return {out_names[0]: responses, out_names[1]: logprobs}

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], rows=None
                ) -> tuple[list[list[int]], list[list[float]]]:
        """Continue each id list in ``prompts`` (one batch, KV cache, left padding): per row the
        sampled ids (up to and including the first stop id -- ``eos`` or another end id of the
        model, :func:`asyncflow.models.stop_ids` -- at most its length cap) and their log-probs.
        A row's cap is :func:`.hf_serve.length_cap` of ``max_new_tokens`` for its key: its
        ``rows`` entry (the store's ``_row``; ``(_row, turn)`` for an agent turn, the key
        ``serve`` gives the same turn), else its position in this call. The loop ends when
        every row has ``eos`` or its cap. Draws from ``self.generator``."""
        n = len(prompts)
        if n == 0:
            return [], []
        keys = list(rows) if rows is not None else range(n)
        caps = [hf_serve.length_cap(self.length_dist, k) for k in keys]
        dev = self.device  # sampling runs there: per token only one flag comes to the host
        cap_t = torch.tensor(caps, device=dev)
        pad, stops = self.tokenizer.pad_id, models.stop_ids(self.tokenizer)
        stop_t = torch.tensor(stops, device=dev)
        ids, mask = tc.left_pad(prompts, pad)
        ids, mask = ids.to(dev), mask.to(dev)
        pos = tc.positions(mask)
        tokens = torch.empty((n, 0), dtype=torch.long, device=dev)
        logps = torch.empty((n, 0), dtype=torch.float32, device=dev)
        done = torch.zeros(n, dtype=torch.bool, device=dev)
        cache, step_ids, step_pos = None, ids, pos
        for step in range(max(caps)):
            out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                             use_cache=True, logits_to_keep=1, **{tc.cache_kw(self.model): cache})
            cache = tc.out_cache(out)
            tok, lp = tc.sample(out.logits[:, -1], self.temperature, self.top_p, self.generator,
                                self.top_k)
            tok = torch.where(done, torch.full_like(tok, pad), tok)
            tokens = torch.cat([tokens, tok[:, None]], dim=1)
            logps = torch.cat([logps, lp[:, None]], dim=1)
            done = done | torch.isin(tok, stop_t) | (cap_t <= step + 1)
            if bool(done.all()):
                break
            step_ids = tok[:, None]
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], 1)
        out_ids, out_lps = [], []
        tokens, logps = tokens.cpu(), logps.cpu()
        for i in range(n):
            row = tokens[i].tolist()[:caps[i]]
            length = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
            out_ids.append(row[:length])
            out_lps.append(logps[i, :length].tolist())
        return out_ids, out_lps

    # -- continuous batching (schedule: queue): asyncflow/engines/hf_serve.py ---------------
    # (this block belongs to hf_serve's owner: serve delegates, nothing else here)
    @property
    def slots(self) -> int:
        """Requests in flight (default: a whole step's samples, at least 32)."""
        return int(self.args.get("slots") or max(32, int(self.spec.extra.get("samples_per_step")
                                                         or 0)))

    def serve(self, pull, emit):
        return hf_serve.serve(self, pull, emit)
    # -- end of hf_serve's block -----------------------------------------------------------

    # ------------------------------------------------------------------ Scorer

    @torch.no_grad()
    def logprobs(self, batch: Columns) -> Columns:
        """Per-token log-probs of the given responses (or values, for ``kind: value``)."""
        prompts, resps = self._pairs(batch)
        out: list = []
        for rows in self._chunks(len(resps)):
            packed = tc.pack([prompts[i] for i in rows], [resps[i] for i in rows],
                             self.tokenizer.pad_id)
            if packed.response_mask.shape[1] == 0:
                out.extend([] for _ in rows)
                continue
            res = self._forward(packed)
            if not self.critic:
                res = tc.token_logprobs(res, packed.response_ids.to(self.device), self.temperature)
            out.extend(tc.rows_to_lists(res, packed.lengths))
        name = "values" if self.critic else "logprobs"
        if self.spec.kind in ("logprob", "value") and self.spec.outputs:
            name = self.spec.outputs[0]
        return {name: out}
