"""An example asyncflow engine, ``echo``: no model, no torch, deterministic.

- Rollout: ``generate`` answers every prompt with the prompt reversed, as an
  :class:`asyncflow.tokens.Text` (token ids from the character tokenizer), and made-up log-probs:
  one float per response token, ``-(1 + i % 3) / 4`` for token ``i``, shifted by ``-version/100``
  so a weight update is visible in the output.
- Scorer: ``logprobs`` gives the same made-up log-probs for any given response.
- Trainer: ``train_step`` counts steps (the "weights" are just the version number).

Registered in ``pyproject.toml`` as ``echo = "asyncflow_echo_engine:EchoEngine"`` in the
``asyncflow.engines`` entry-point group.
"""
from __future__ import annotations

import json
import os

from asyncflow.argtable import Arg  # plain data: importing it does not import torch
from asyncflow.engines.base import Columns, EngineSpec
from asyncflow.models import CharTokenizer  # pure Python: importing it does not import torch
from asyncflow.tokens import Text

__all__ = ["EchoEngine"]
STATE_FILE = "echo_engine.json"


def made_up_logprobs(n: int, version: int) -> list[float]:
    """One (negative) float per token; depends only on the token index and the version."""
    return [-(1 + i % 3) / 4 - version / 100 for i in range(n)]


class EchoEngine:
    """Rollout, Scorer and Trainer of :mod:`asyncflow.engines.base`, with no model at all.

    Task args: ``ARGS`` (``asyncflow check`` reads them from this source without importing it:
    an arg no owner declares is an error, AF210)."""

    ARGS = (
        Arg("max_new_tokens", "int", 16, "cuts the echoed text", kinds=("rollout",), min=1),
    )

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.max_new_tokens = int(spec.args.get("max_new_tokens", 16))
        self.tokenizer = CharTokenizer()
        self.version = 0

    # -- Rollout ----------------------------------------------------------------------------
    def generate(self, batch: Columns) -> Columns:
        """``prompt`` -> ``spec.outputs`` (default ``[response, logprobs]``), one row each."""
        names = list(self.spec.outputs) or ["response", "logprobs"]
        tok = self.tokenizer
        responses, logprobs = [], []
        for prompt in batch["prompt"]:
            text = str(prompt)[::-1][: self.max_new_tokens]
            ids = tok.encode(text) + [tok.eos_id]  # a response ends with eos, as the hf engine's
            responses.append(Text(text, ids, [tok.bos_id] + tok.encode(str(prompt))))
            logprobs.append(made_up_logprobs(len(ids), self.version))
        return {names[0]: responses, names[1]: logprobs}

    def update_weights(self, weights, version: int) -> None:
        self.version = int(version)

    # -- Scorer -----------------------------------------------------------------------------
    def logprobs(self, batch: Columns) -> Columns:
        """Made-up log-probs of the ``response`` column (one float per response token)."""
        name = self.spec.outputs[0] if self.spec.outputs else "logprobs"
        out = []
        for r in batch["response"]:
            n = len(r.ids) if isinstance(r, Text) and r.ids else len(self.tokenizer.encode(r))
            out.append(made_up_logprobs(n, self.version))
        return {name: out}

    # -- Trainer ----------------------------------------------------------------------------
    def train_step(self, batch: Columns) -> dict[str, float]:
        self.version += 1
        rows = len(next(iter(batch.values()), []))
        return {"loss": 0.0, "rows": float(rows), "version": float(self.version)}

    def export_weights(self) -> dict:
        return {"version": self.version}

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, STATE_FILE), "w") as f:
            json.dump({"version": self.version}, f)

    def load(self, directory: str) -> None:
        with open(os.path.join(directory, STATE_FILE)) as f:
            self.version = int(json.load(f)["version"])
