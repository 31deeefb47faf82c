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

Reproducibility: initial weights depend only on the model's ``seed`` arg; sampling uses a
``torch.Generator`` seeded with ``spec.seed * 1_000_003 + spec.replica``.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import torch

from asyncflow import lora
from asyncflow.algos import loss_aggregation
from asyncflow.engines import torch_common as tc
from asyncflow.engines.base import BUILTIN_CAPABILITIES, Columns, EngineSpec
from asyncflow.tokens import Text

STATE_FILE = "engine_state.pt"
VALUE_HEAD = "value_head."


class HFEngine:
    """A transformers causal LM as rollout, scorer and trainer (see the module docstring)."""

    capabilities = BUILTIN_CAPABILITIES["hf"]

    def __init__(self, spec: EngineSpec):
        from asyncflow import models

        self.spec = spec
        args = dict(spec.args)
        self.args = args
        torch.set_num_threads(int(args.get("threads") or spec.extra.get("threads") or 2))
        # the task's device arg, else the worker's (asyncflow.runtime.devices: Ray's GPU or CPU)
        self.device = torch.device(args.get("device") or spec.extra.get("device") or "cpu")
        self.temperature = float(args.get("temperature", spec.extra.get("temperature", 1.0)))
        self.top_p = float(args.get("top_p", 1.0))
        # a number or a distribution: per-row length caps (hf_serve.length_cap)
        self.max_new_tokens = args.get("max_new_tokens", 16)
        from asyncflow.engines import hf_serve
        self.length_dist = hf_serve.length_spec(self.max_new_tokens)
        self.cancelled = self.aborted = 0  # serve: rows cancelled / restarts on weight updates
        self.micro_batch = int(args.get("micro_batch") or 0)
        self.version = 0
        self.generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + spec.replica)

        # from where the plan says, in the model's dtype (log-prob math stays float32)
        self.model, self.tokenizer = models.engine_load(spec)
        # a LoRA adapter (asyncflow.lora): the trainer trains it, a rollout applies what it gets
        self.lora = dict(spec.model.get("lora") or {})
        if self.lora:
            self.model = lora.wrap(self.model, spec, train=spec.kind == "train")
        self.model.to(self.device)
        self.critic = spec.kind == "value" or spec.loss == "value"
        self.value_head = None
        if self.critic:
            hidden = self.model.config.hidden_size
            with torch.random.fork_rng(devices=[]):
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
        return self._prompt(prompt)[0]

    def _prompt(self, prompt) -> tuple[list[int], str]:
        """(ids, text the model sees): a chat through the chat template, a string as is
        (:func:`asyncflow.models.encode_prompt`)."""
        if isinstance(prompt, Text) and prompt.ids:
            return list(prompt.ids), str(prompt)
        from asyncflow import models

        return models.engine_prompt(self.spec, self.tokenizer, prompt)

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
        from asyncflow.engines.batching import balance_micro_batches

        return balance_micro_batches(lengths, size, remainder=True)

    # ------------------------------------------------------------------ Rollout

    @torch.no_grad()
    def generate(self, batch: Columns) -> Columns:
        """Sample one response per row of ``batch["prompt"]`` (KV cache, left padding); with an
        environment (``spec.extra["env"]``) run one multi-turn episode per row instead
        (:mod:`asyncflow.engines.multiturn`, which adds the ``reward`` column when declared)."""
        out_names = list(self.spec.outputs) or ["response", "logprobs"]
        if self.spec.extra.get("env"):
            from asyncflow.engines import multiturn

            return multiturn.rollout_columns(
                batch, self._sample, self.tokenizer, self.spec.extra["env"],
                self.spec.extra.get("env_args"),
                int(self.args.get("max_turns") or multiturn.DEFAULT_MAX_TURNS), out_names,
                self.spec.extra.get("search_path", ()), keys=batch.get("_row"))
        encoded = [self._prompt(p) for p in batch["prompt"]]
        prompts = [ids for ids, _ in encoded]
        if not prompts:
            return {name: [] for name in out_names[:2]}
        tokens, logprobs = self._sample(prompts, batch.get("_row"))
        eos = self.tokenizer.eos_id
        responses = [Text(self.tokenizer.decode([t for t in ids if t != eos]), ids, prompt,
                          prompt_text=text)
                     for ids, (prompt, text) in zip(tokens, encoded)]
        return {out_names[0]: responses, out_names[1]: logprobs}

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], rows=None
                ) -> tuple[list[list[int]], list[list[float]]]:
        """Continue each id list in ``prompts`` (one batch, KV cache, left padding): per row the
        sampled ids (up to and including ``eos``, at most its length cap) and their log-probs.
        A row's cap is :func:`.hf_serve.length_cap` of ``max_new_tokens`` for its key: its
        ``rows`` entry (the store's ``_row``; ``(_row, turn)`` for an agent turn, the key
        ``serve`` gives the same turn), else its position in this call. The loop ends when
        every row has ``eos`` or its cap. Draws from ``self.generator``."""
        from asyncflow.engines.hf_serve import length_cap

        n = len(prompts)
        if n == 0:
            return [], []
        keys = list(rows) if rows is not None else range(n)
        caps = [length_cap(self.length_dist, k) for k in keys]
        dev = self.device  # sampling runs there: per token only one flag comes to the host
        cap_t = torch.tensor(caps, device=dev)
        pad, eos = self.tokenizer.pad_id, self.tokenizer.eos_id
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
            tok, lp = tc.sample(out.logits[:, -1], self.temperature, self.top_p, self.generator)
            tok = torch.where(done, torch.full_like(tok, pad), tok)
            tokens = torch.cat([tokens, tok[:, None]], dim=1)
            logps = torch.cat([logps, lp[:, None]], dim=1)
            done = done | (tok == eos) | (cap_t <= step + 1)
            if bool(done.all()):
                break
            step_ids = tok[:, None]
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], 1)
        out_ids, out_lps = [], []
        tokens, logps = tokens.cpu(), logps.cpu()
        for i in range(n):
            row = tokens[i].tolist()[:caps[i]]
            length = row.index(eos) + 1 if eos in row else len(row)
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
        from asyncflow.engines import hf_serve

        return hf_serve.serve(self, pull, emit)
    # -- end of hf_serve's block -----------------------------------------------------------

    def update_weights(self, weights, version: int) -> None:
        """Load a state dict from a trainer's :meth:`export_weights`; takes effect at once."""
        self._load_state(weights)
        self.version = int(version)

    def update_weights_stream(self, chunks, version: int, partial: bool = False) -> None:
        """Load a trainer's weights bucket by bucket as a collective delivers them
        (asyncflow.runtime.collective); ``partial``: only the tensors that changed (a delta
        sync), else the buckets together must cover the model."""
        seen: set = set()
        for chunk in chunks:
            self._load_state(chunk, partial=True)
            seen.update(chunk)
        if not partial:
            self._check_names(seen)
        self.version = int(version)

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

    # ------------------------------------------------------------------ Trainer

    def _params(self):
        params = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapter
        if self.value_head is not None:
            params += list(self.value_head.parameters())
        return params

    def _build_trainer(self) -> None:
        import dataclasses

        from asyncflow.algos.config import LossConfig

        a = self.args
        self.model.train()
        # dropout off: fp32 log-probs must be those the rollout saw (a LoRA adapter's own
        # dropout stays: the user asked for it, as peft and TRL apply it)
        for name, m in self.model.named_modules():
            if isinstance(m, torch.nn.Dropout) and "lora_dropout" not in name:
                m.p = 0.0
        self.loss_name = self.spec.loss or "grpo"
        self.loss_cfg = LossConfig.from_args(a)
        self.loss_agg = loss_aggregation(self.loss_name, self.loss_cfg)
        # micro-batch losses are taken unnormalised (normaliser 1) and the step's gradient divided
        # at the end (torch_common, "train steps"); seq_sum_norm's length goes there too
        self.micro_cfg = (dataclasses.replace(self.loss_cfg, norm_length=1)
                          if self.loss_agg == "seq_sum_norm" else self.loss_cfg)
        self.max_grad_norm = a.get("max_grad_norm", 1.0)
        if a.get("gradient_checkpointing"):  # non-reentrant: no input needs requires_grad (LoRA)
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        # fp32_master: AdamW over float32 copies of a low-precision model's trained weights
        self.masters = ([torch.nn.Parameter(p.detach().float().clone()) for p in self._params()]
                        if a.get("fp32_master") and self.model.dtype != torch.float32 else None)
        self.optimizer = torch.optim.AdamW(
            self.masters or self._params(), lr=float(a.get("lr", 1e-4)),
            betas=tuple(a.get("betas", (0.9, 0.999))), eps=float(a.get("adam_eps", 1e-8)),
            weight_decay=float(a.get("weight_decay", 0.0)))

    def train_step(self, batch: Columns) -> dict[str, float]:
        """One optimiser step on all rows of ``batch``: gradient accumulation over micro-batches
        of at most ``micro_batch`` rows, balanced by token count (prompt + response;
        :func:`asyncflow.engines.batching.balance_micro_batches`), then clipping and AdamW; the
        step's loss is the mean over its tokens (token-mean losses) or sequences (sequence-mean).
        ``train_stream`` over those micro-batches: one code path. Bumps ``version``. Metrics:
        ``loss``/``pg_loss`` of the step, token-weighted means of the loss's other metrics
        (``clip_frac``, ``entropy``, ``approx_kl``, ``kl_ref``...), ``kl`` (``kl_ref`` when
        reference log-probs are given, else ``approx_kl``), ``grad_norm`` (before clipping),
        ``tokens``, ``rows``, ``version``; ``*_max`` metrics are the step's maximum and the
        critic's ``explained_var`` is the whole step's (from sums), whatever the split."""
        self._require_trainer()
        return self._train(self._split(batch))

    def train_stream(self, micro_batches: Iterable[Columns]) -> dict[str, float]:
        """One optimiser step over micro-batches that arrive one by one (``stream: true``,
        :mod:`asyncflow.engines.base`, "scheduling"): forward and backward on each as it
        arrives (one larger than ``micro_batch`` rows is split, balanced), the gradients summed
        unnormalised and divided once by the step's normaliser when the iterable ends, then clip
        and step. Equals ``train_step`` on the concatenated rows up to summation order, whatever
        the order and sizes of the micro-batches; the same metrics."""
        self._require_trainer()
        return self._train(self._stream(micro_batches))

    def _require_trainer(self) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"task {self.spec.task!r} is not a train task")

    def _micro(self, cols: Columns) -> tc.Micro:
        prompts, resps = self._pairs(cols)
        masks, counted = self._counted(cols, resps)
        return tc.Micro(cols, prompts, resps, masks, counted)

    def _split(self, batch: Columns) -> list[tc.Micro]:
        """A whole step's rows as token-balanced micro-batches (see ``_chunks``)."""
        whole = self._micro(batch)
        chunks = self._chunks(len(whole), whole.lengths)
        return [whole] if len(chunks) == 1 else [whole.take(rows) for rows in chunks]

    def _stream(self, micro_batches: Iterable[Columns]) -> Iterator[tc.Micro]:
        for cols in micro_batches:
            yield from self._split(cols)

    def _train(self, micro_batches: Iterable[tc.Micro]) -> dict[str, float]:
        """The one step of ``train_step`` and ``train_stream`` (torch_common, "train steps")."""
        self.optimizer.zero_grad(set_to_none=True)
        step = tc.StepSums()
        for mb in micro_batches:
            step.add_rows(mb)
            if not mb.tokens:
                continue
            packed = mb.pack(self.tokenizer.pad_id)
            loss, metrics = self._micro_loss(packed, mb.cols, 1, self.micro_cfg)
            loss.backward()
            step.add_metrics(metrics, packed.tokens)
            del loss, packed  # the graph goes now, not when the next micro-batch arrives
        norm = step.normaliser(self.loss_agg, self.loss_cfg.norm_length)
        params = self._params()
        if self.masters is not None:  # the gradients move to the float32 masters
            for p, m in zip(params, self.masters):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
            params = self.masters
        for p in params:
            if p.grad is not None:
                p.grad.div_(norm)
        if self.max_grad_norm is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, float(self.max_grad_norm))
        else:
            grad_norm = torch.sqrt(sum(((p.grad.detach() ** 2).sum() for p in params
                                        if p.grad is not None), torch.zeros(())))
        self.optimizer.step()
        if self.masters is not None:
            with torch.no_grad():
                for p, m in zip(self._params(), self.masters):
                    p.copy_(m)  # cast to the model's dtype
        self.version += 1
        return step.result(norm, float(grad_norm), self.version)

    def _counted(self, batch: Columns, resps: list[list[int]]) -> tuple[list | None, list[int]]:
        """(loss masks or None, tokens that count per row). Multi-turn responses carry a loss
        mask (0 on environment observations): only the tokens it keeps count, in the loss and
        in every token count and token-weighted metric."""
        masks = tc.loss_masks(batch["response"])
        counted = [len(r) if masks is None or masks[i] is None else sum(masks[i])
                   for i, r in enumerate(resps)]
        return masks, counted

    def _micro_loss(self, packed: tc.Packed, cols: Columns, normalizer, cfg=None):
        """(loss, metrics) of one micro-batch, divided by ``normalizer``, under ``cfg`` (the
        loss settings; default ``self.loss_cfg``)."""
        cfg = self.loss_cfg if cfg is None else cfg
        mask = packed.response_mask.to(self.device)
        lengths, width = packed.lengths, mask.shape[1]
        if self.critic:
            values = self._forward(packed)
            returns = tc.pad_floats(cols["returns"], lengths, width).to(self.device)
            old = cols.get("values")
            old_values = (tc.pad_floats(old, lengths, width).to(self.device)
                          if old is not None else values.detach())
            loss, metrics = _loss("value", values, old_values, returns, mask, cfg,
                                  normalizer=normalizer)
            # explained variance is not a mean over tokens: exact over micro-batches from sums
            return loss, {**metrics, **tc.explained_variance_sums(values, returns, mask)}
        logits = self._forward(packed)
        logp = tc.token_logprobs(logits, packed.response_ids.to(self.device), self.temperature)
        with torch.set_grad_enabled(bool(cfg.entropy_coef)):  # a metric unless used
            ent = tc.entropy(logits, self.temperature)
        old = tc.pad_floats(cols["logprobs"], lengths, width).to(self.device)
        adv = tc.pad_floats(cols["advantages"], lengths, width).to(self.device)
        ref, prox = (cols.get(k) for k in ("ref_logprobs", "prox_logprobs"))  # optional roles
        ref = tc.pad_floats(ref, lengths, width).to(self.device) if ref is not None else None
        prox = tc.pad_floats(prox, lengths, width).to(self.device) if prox is not None else None
        return _loss(self.loss_name, logp, old, adv, mask, cfg, ref_logprobs=ref,
                     prox_logprobs=prox, entropy=ent, normalizer=normalizer)

    def export_weights(self) -> dict:
        """A CPU state dict of cloned tensors (value head under ``value_head.*``); with a LoRA
        adapter, the adapter's tensors only (what a sync sends: asyncflow.lora)."""
        if self.lora:
            state = lora.adapter_state(self.model)
        else:
            state = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        if self.value_head is not None:
            for k, v in self.value_head.state_dict().items():
                state[VALUE_HEAD + k] = v.detach().to("cpu", copy=True)
        return state

    def _check_names(self, names: set) -> None:
        """The names a streamed update sent cover the model (and nothing else)."""
        if self.lora:
            expected = set(lora.adapter_state(self.model))
        else:
            expected = set(self.model.state_dict())
        if self.value_head is not None:
            expected |= {VALUE_HEAD + k for k in self.value_head.state_dict()}
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        missing, unexpected = expected - names - tied, names - expected
        if missing or unexpected:
            raise KeyError(f"weights do not fit the model: missing {sorted(missing)}, "
                           f"unexpected {sorted(unexpected)}")

    def _load_state(self, state: dict, partial: bool = False) -> None:
        model_state = {k: v for k, v in state.items() if not k.startswith(VALUE_HEAD)}
        if self.lora:  # an adapter from a LoRA trainer (asyncflow.lora)
            lora.load_adapter(self.model, model_state)
            missing, unexpected = [], []
        else:
            missing, unexpected = self.model.load_state_dict(model_state, strict=False)
        if partial:
            missing = []
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise KeyError(f"weights do not fit the model: missing {sorted(set(missing) - tied)}"
                           f", unexpected {sorted(unexpected)}")
        if self.value_head is not None:
            head = {k[len(VALUE_HEAD):]: v for k, v in state.items() if k.startswith(VALUE_HEAD)}
            if head:
                self.value_head.load_state_dict(head, strict=not partial)

    def save(self, directory: str) -> None:
        """Model (as a local HF directory, usable as a model ``init``), value head, optimizer,
        version and sampling RNG state."""
        from asyncflow import models

        os.makedirs(directory, exist_ok=True)
        models.save((self._plain_model(), self.tokenizer), directory)
        self._save_adapter(directory)
        self._save_value_head(directory)
        torch.save({
            "weights": self.export_weights(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "masters": [m.detach() for m in self.masters] if self.masters is not None else None,
            "version": self.version,
            "generator": self.generator.get_state(),
        }, os.path.join(directory, STATE_FILE))

    def _save_value_head(self, directory: str) -> None:
        """A critic's value head beside the model, as the export writes it (the checkpoint's
        directory then exports like a final one: asyncflow.runtime.export)."""
        if self.value_head is not None:
            from asyncflow.hfdir import write_value_head

            write_value_head(directory, self.value_head)

    def export(self, directory: str, dtype: str = "float32") -> None:
        """The trained model as a Hugging Face directory in ``dtype`` (weights, config,
        tokenizer; a critic's value head beside it): :func:`asyncflow.hfdir.write_hf`.
        The engine's own weights are not changed."""
        from asyncflow.hfdir import write_hf

        write_hf(directory, self._plain_model(), self.tokenizer, dtype, value_head=self.value_head)
        self._save_adapter(directory)

    def _plain_model(self):
        """The model as transformers saves it: with a LoRA adapter, a copy with the adapter
        merged into its weights (loads without peft); the engine's own model is not changed."""
        return lora.merged_copy(self.model) if self.lora else self.model

    def _save_adapter(self, directory: str) -> None:
        """A LoRA adapter beside the model it was merged into: ``directory/adapter`` (peft's)."""
        if self.lora:
            lora.save_adapter(self.model, os.path.join(directory, "adapter"))

    def load(self, directory: str) -> None:
        state = torch.load(os.path.join(directory, STATE_FILE), weights_only=True)
        self._load_state(state["weights"])
        if self.masters is not None and state.get("masters") is not None:
            with torch.no_grad():
                for m, saved in zip(self.masters, state["masters"]):
                    m.copy_(saved)
        elif self.masters is not None:  # a checkpoint without masters: from the weights
            with torch.no_grad():
                for m, p in zip(self.masters, self._params()):
                    m.copy_(p)
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.generator.set_state(state["generator"])


# ---------------------------------------------------------------------- losses
# The one place the engine calls into asyncflow.algos.


def _loss(name: str, first, second, third, mask, cfg, **kw):
    """``asyncflow.algos.compute_loss``: (new_logprobs, old_logprobs, advantages) for a policy
    loss, (values, old_values, returns) for ``value``; returns (scalar loss, metrics)."""
    from asyncflow.algos import compute_loss

    return compute_loss(name, first, second, third, mask, cfg, **kw)
