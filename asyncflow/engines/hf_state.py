"""The weights half of the ``hf`` engine (:class:`asyncflow.engines.hf.HFEngine`): what goes in
and out of it -- a weight sync's state dict (whole, or bucket by bucket), the export as a
Hugging Face directory, and checkpoints (``save`` / ``load``).

:class:`HFWeights` is a mixin: ``HFEngine`` inherits it, and so the ``deepspeed`` engine, which
wraps ``export_weights``, ``export``, ``save`` and ``load`` for ZeRO. It works on the engine's
``spec``, ``model``, ``tokenizer``, ``value_head``, ``lora``, ``version``, ``generator`` and,
for a trainer, ``optimizer``, ``masters`` and ``_params``
(:class:`asyncflow.engines.hf_train.HFTrainer`).
A value head's tensors travel under :data:`VALUE_HEAD`; a LoRA engine's sync and checkpoint carry
its adapter only (:mod:`asyncflow.lora`).
"""
from __future__ import annotations

import os

import torch

from asyncflow import lora, models
from asyncflow.hfdir import write_hf, write_value_head

STATE_FILE = "engine_state.pt"
VALUE_HEAD = "value_head."


class HFWeights:
    """Weight sync, export and checkpoints of a torch causal LM engine (module docstring)."""

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
            write_value_head(directory, self.value_head)

    def export(self, directory: str, dtype: str = "float32") -> None:
        """The trained model as a Hugging Face directory in ``dtype`` (weights, config,
        tokenizer; a critic's value head beside it): :func:`asyncflow.hfdir.write_hf`.
        The engine's own weights are not changed."""
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
