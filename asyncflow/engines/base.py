"""Engine service interfaces (DESIGN.md, Engines) and the registry.

Rows travel between tasks as *column batches*: ``dict[field, list]`` with one list entry per row,
all lists the same length. An engine gets the columns its task declared as ``inputs`` (plus the
bookkeeping columns below) and returns the columns it declared as ``outputs``.

Bookkeeping columns every batch carries (the store fills them, engines only read them):

============  ==============================================================
column        meaning
============  ==============================================================
``_row``      global row index in the sample store
``_group``    index of the prompt the row was generated from (a GRPO group)
``_version``  policy version the row was generated with (rollout output)
============  ==============================================================

Text produced by a rollout is a :class:`asyncflow.tokens.Text`: a ``str`` (so reward functions
read it as text) that also carries its token ids and its prompt's token ids for scorers and
trainers.

Three protocols; an engine class implements one or more of them:

- ``Rollout``: ``generate(batch) -> columns``; ``update_weights(weights, version)``.
- ``Scorer``: ``logprobs(batch) -> columns`` (log-probs of a given response, or values).
- ``Trainer``: ``train_step(batch) -> metrics``; ``export_weights() -> state``; ``save(dir)``;
  ``load(dir)``.

Engines are constructed as ``Engine(spec)`` where ``spec`` is an :class:`EngineSpec`.
They are looked up by name: the built-ins below, then the ``asyncflow.engines`` entry-point
group (``name = "package.module:Class"``). Names are known without importing any engine, so
``asyncflow check`` and ``compile`` never import torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Columns = dict[str, list]

BUILTIN = {
    "hf": "asyncflow.engines.hf:HFEngine",
    "vllm": "asyncflow.engines.vllm:VLLMEngine",
    "deepspeed": "asyncflow.engines.deepspeed:DeepSpeedEngine",
    "sim": "asyncflow.engines.sim:SimEngine",
}
ENTRY_POINT_GROUP = "asyncflow.engines"


@dataclass
class EngineSpec:
    """Everything an engine instance needs to start, as plain data."""

    task: str  # the task name
    kind: str  # rollout | logprob | value | train
    model: dict  # {"name", "init", "args", "frozen"} (copy_of already resolved)
    args: dict = field(default_factory=dict)  # the task's args
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    loss: str | None = None
    seed: int = 0
    replica: int = 0
    replicas: int = 1
    extra: dict = field(default_factory=dict)  # runtime-provided (e.g. samples_per_prompt)


@runtime_checkable
class Rollout(Protocol):
    def generate(self, batch: Columns) -> Columns: ...
    def update_weights(self, weights: Any, version: int) -> None: ...


@runtime_checkable
class Scorer(Protocol):
    def logprobs(self, batch: Columns) -> Columns: ...


@runtime_checkable
class Trainer(Protocol):
    def train_step(self, batch: Columns) -> dict[str, float]: ...
    def export_weights(self) -> Any: ...
    def save(self, directory: str) -> None: ...
    def load(self, directory: str) -> None: ...


def engine_names() -> dict[str, str]:
    """name -> "module:Class", built-ins first, then entry points (never imports an engine)."""
    names = dict(BUILTIN)
    try:
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            names.setdefault(ep.name, ep.value)
    except Exception:  # a broken third-party distribution must not break `check`
        pass
    return names


def load_engine_class(name: str):
    """The engine class registered as ``name`` (imports it)."""
    import importlib

    target = engine_names()[name]
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
