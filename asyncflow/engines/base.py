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


# -- scheduling (docs/language.md, "Scheduling keys") ----------------------------------------
#
# Optional methods; the worker uses them when an engine has them and the plan asks for them.
#
# Rollout, ``schedule: queue``:
#   ``serve(pull, emit)``: continuous batching across calls. ``pull(k)`` returns a role-keyed
#   column batch of at most ``k`` new rows (``_row``, ``_group`` included; ``{}`` when none is
#   ready yet) or raises to stop; ``emit(row)`` receives each finished sample as one dict
#   ``{"_row", "_version", role: value, ...}`` the moment it finishes. ``_version`` is the
#   *oldest* policy version that produced any of its tokens. ``self.slots``: requests in flight.
#   ``pull`` is called at least every few milliseconds even when no slot is free (then with
#   ``k = 0``). The batch it returns may carry ``"_cancel"``: in-flight rows dropped elsewhere
#   (a redundant group the step did not need, a sample grown too stale); they leave their slots
#   at once and are never emitted (count them in ``self.cancelled``).
#   ``update_weights(weights, version)`` may be called from inside ``pull`` while samples are in
#   flight; ``spec.extra["on_update"]`` says what happens to them: ``"continue"`` (keep their
#   tokens and KV cache, go on with the new weights; ``_version`` stays the oldest), ``"abort"``
#   (restart them from their prompt with the new weights; ``_version`` the new one; counted in
#   ``self.aborted``). ``"finish"``: the worker calls ``update_weights`` only when nothing is in
#   flight (it stops admitting and drains first), so an engine need do nothing special.
#
# Trainer, ``stream: true``:
#   ``train_stream(micro_batches) -> metrics``: one optimiser step over an *iterable* of
#   role-keyed micro-batches that the worker yields as their rows become ready (it blocks on the
#   store between them): forward and backward per micro-batch as it arrives, then one clip and
#   step. The loss normaliser (the step's token or sequence count) is known only at the end, so
#   gradients are accumulated unnormalised and scaled once; the result equals ``train_step`` on
#   the concatenated rows up to floating-point summation order. Same metrics as ``train_step``.


@runtime_checkable
class TurnServer(Protocol):
    """A queue of generation requests served by continuous batching (one agent turn or one
    single-turn sample each): what :func:`asyncflow.engines.multiturn.serve_episodes` drives.

    ``submit(key, prefix_ids)`` queues a request (``key`` any hashable); ``poll(timeout_s)``
    advances generation (admitting queued requests into free slots) and returns the requests
    finished since, as ``(key, ids, logprobs, version)`` (``version``: the oldest policy version
    among its tokens), waiting at most ``timeout_s`` when none finished; ``cancel(keys)`` drops
    queued or running requests; ``in_flight()`` counts queued + running; ``slots`` is how many
    run at once."""

    slots: int

    def submit(self, key: Any, prefix_ids: list[int]) -> None: ...
    def poll(self, timeout_s: float) -> list[tuple[Any, list[int], list[float], int]]: ...
    def cancel(self, keys: list) -> int: ...
    def in_flight(self) -> int: ...


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


#: the built-in engines that serve requests by continuous batching (a ``serve`` method), known
#: without importing them (they import torch or vllm)
SERVING = frozenset({"sim", "hf", "vllm"})


def engine_serves(name: str | None) -> bool:
    """Whether the engine registered as ``name`` serves requests (has ``serve``): the built-ins
    from :data:`SERVING`, a plug-in from its class (imported here); an engine that cannot be
    imported does not serve (its import error is the run's AF6xx when a worker builds it)."""
    if not name:
        return False
    if name in BUILTIN:
        return name in SERVING
    try:
        return hasattr(load_engine_class(name), "serve")
    except (ImportError, AttributeError, KeyError):
        return False


def load_engine_class(name: str):
    """The engine class registered as ``name`` (imports it)."""
    import importlib

    target = engine_names()[name]
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
