"""The trainer half of the ``hf`` engine (:class:`asyncflow.engines.hf.HFEngine`): the AdamW
optimiser (over float32 master copies with ``fp32_master``), the train step over micro-batches
and the micro-batch loss, which calls :func:`asyncflow.algos.compute_loss`.

:class:`HFTrainer` is a mixin: ``HFEngine`` inherits it, and so the ``deepspeed`` engine, which
replaces its optimiser loop. It works on the engine's ``spec``, ``args``, ``model``,
``tokenizer``, ``device``, ``value_head``, ``critic``, ``temperature``, ``micro_batch`` and
``version``, and on the engine's batch layout (``_pairs``, ``_chunks``, ``_forward``). The train
step's arithmetic -- unnormalised micro-batch losses, one division by the step's normaliser --
is :mod:`asyncflow.engines.torch_common`'s ("train steps"). Task args it reads are declared in
:data:`asyncflow.argtable.HF_ARGS`; the loss's in :data:`asyncflow.argtable.LOSS_ARGS`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from asyncflow.algos import compute_loss, loss_aggregation
from asyncflow.algos.config import LossConfig
from asyncflow.engines import torch_common as tc
from asyncflow.engines.base import Columns


class HFTrainer:
    """Optimiser, train step and loss of a torch causal LM engine (module docstring)."""

    def _params(self):
        params = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapter
        if self.value_head is not None:
            params += list(self.value_head.parameters())
        return params

    def _build_trainer(self) -> None:
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
            loss, metrics = compute_loss("value", values, old_values, returns, mask, cfg,
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
        return compute_loss(self.loss_name, logp, old, adv, mask, cfg, ref_logprobs=ref,
                            prox_logprobs=prox, entropy=ent, normalizer=normalizer)
