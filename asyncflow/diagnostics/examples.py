"""The base pipeline the table's examples mutate, one mistake each."""
from __future__ import annotations

from asyncflow.diagnostics.code import Example

BASE = """\
pipeline: base
description: the base of the diagnostics examples
models:
  policy:
    init: asyncflow.models:tiny_decoder
    args: {layers: 2, hidden: 64}
  reference:
    copy_of: policy
    frozen: true
data:
  prompts:
    source: asyncflow.datasets:digits
    args: {n: 100, seed: 0}
    fields: [prompt, answer]
pools:
  rollout: {devices: 1}
  train: {devices: 1}
step:
  prompts_per_step: 4
  samples_per_prompt: 4
  steps: 2
tasks:
  generate:
    kind: rollout
    engine: hf
    model: policy
    pool: rollout
    inputs: [prompt]
    outputs: [response, logprobs]
    args: {max_new_tokens: 8}
  score:
    kind: reward
    fn: asyncflow.rewards:digits_match
    inputs: [prompt, answer, response]
    outputs: [reward]
  ref:
    kind: logprob
    engine: hf
    model: reference
    pool: train
    inputs: [prompt, response]
    outputs: [ref_logprobs]
  advantage:
    kind: advantage
    estimator: grpo
    inputs: [reward]
    outputs: [advantages]
  update:
    kind: train
    engine: hf
    model: policy
    pool: train
    loss: grpo
    inputs: [prompt, response, logprobs, ref_logprobs, advantages]
    args: {lr: 1.0e-4, micro_batch: 8}
sync:
  - {from: update, to: generate, max_staleness: 1}
"""


def mutate(old: str, new: str, at: str | None = None, count: int = 1, **kw) -> Example:
    """BASE with the first ``count`` occurrences of ``old`` replaced by ``new``; the diagnostic
    must point at ``at`` (default: ``new``) in the result."""
    if old not in BASE:
        raise AssertionError(f"{old!r} is not in the base example")
    return Example(BASE.replace(old, new, count), at if at is not None else new, **kw)
