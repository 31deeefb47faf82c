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

What an engine can do is its class's ``capabilities`` (:class:`Capabilities`), read by the
compiler, the runtime and the simulator through :func:`capabilities` (the built-ins' from
:data:`BUILTIN_CAPABILITIES`, without importing them). Adding an engine is one module (its class,
with its ``capabilities``) and an entry point.
"""
from __future__ import annotations

import os
import sys
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


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, as the compiler, the runtime and the simulator need to know it.

    An engine class declares it as its class attribute ``capabilities``; one that does not gets
    the defaults (``serves`` and ``train_stream`` then from whether it has those methods). The
    built-ins' are in :data:`BUILTIN_CAPABILITIES`, read without importing them (they import
    torch or vllm); their classes point at their entry, so there is one source."""

    serves: bool = False  # serve(pull, emit): continuous batching (a rollout's serve loop)
    serves_unless_told: bool = False  # a rollout without ``schedule:`` serves (queue)
    accelerator: bool = False  # needs a GPU: a pipeline running it on a pool compiles for GPUs
    uses_device: bool = True  # runs on a torch device (asyncflow.runtime.devices)
    tensors: bool = False  # its weights are torch tensors: a collective sync edge can carry them
    distributed: bool = False  # its replicas form one torch.distributed group
    data_parallel: bool = False  # a train task's replicas split each step between them
    train_stream: bool = False  # train_stream(micro_batches): a streaming optimiser step
    adapters: bool = False  # trains or applies a model's ``lora:`` adapter
    tokenizes: bool = True  # tokenizes prompts with the model's tokenizer (chat templates)
    cost_args: bool = False  # its ``args`` carry the cost hints (asyncflow.compiler.passes.cost)
    runs: tuple[str, ...] = ()  # the task kinds it runs; (): every kind that takes an engine

    def runs_kind(self, kind: str) -> bool:
        return not self.runs or kind in self.runs


BUILTIN_CAPABILITIES = {
    "hf": Capabilities(serves=True, tensors=True, train_stream=True, adapters=True),
    "vllm": Capabilities(serves=True, accelerator=True, tensors=True, adapters=True,
                         runs=("rollout",)),
    "deepspeed": Capabilities(accelerator=True, tensors=True, distributed=True,
                              data_parallel=True, train_stream=True,
                              runs=("train", "logprob", "value")),
    # sim stands in for the others (asyncflow.argtable.STANDS_IN), so it takes what they take
    # (a lora: adapter it does not model); it only sleeps, on no device
    "sim": Capabilities(serves=True, serves_unless_told=True, uses_device=False,
                        train_stream=True, adapters=True, tokenizes=False, cost_args=True),
}


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
#   at once, before the batch's new rows take theirs (so it has up to ``k`` new rows plus one
#   for each row it cancels), and are never emitted (count them in ``self.cancelled``).
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


_NAMES: dict = {}  # the last scan: {"key": what it was read from, "names": what it found}


def _path_key() -> tuple:
    """What the installed distributions are read from: the path and each entry's mtime (a
    directory's changes when a distribution is installed into it or removed)."""
    def mtime(p: str) -> int:
        try:
            return os.stat(p or ".").st_mtime_ns
        except OSError:
            return -1
    return tuple((p, mtime(p)) for p in sys.path)


def engine_names() -> dict[str, str]:
    """name -> "module:Class", built-ins first, then entry points (never imports an engine).

    A distribution whose metadata cannot be read is reported (a warning naming it and why, once
    per distribution) and skipped: its engines are then unknown, and the warning says why.
    Reading every distribution's metadata takes a tenth of a second or more, so the answer is
    kept until the path or a directory on it changes (an install, an uninstall)."""
    key = _path_key()
    if _NAMES.get("key") == key:
        return dict(_NAMES["names"])
    names = _scan_names()
    _NAMES.update(key=key, names=names)
    return dict(names)


def _scan_names() -> dict[str, str]:
    from importlib import metadata

    names = dict(BUILTIN)
    seen: set[str] = set()
    for dist in metadata.distributions():
        try:
            name = (dist.metadata["Name"] or "").lower().replace("_", "-")
            if name in seen:  # shadowed by an earlier one on the path (as entry_points does)
                continue
            seen.add(name)
            eps = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
        except Exception as exc:  # noqa: BLE001 -- any broken metadata: reported, not fatal
            _report_broken(dist, exc)
            continue
        for ep in eps:
            names.setdefault(ep.name, ep.value)
    return names


_REPORTED: set[str] = set()


def _report_broken(dist, exc: BaseException) -> None:
    """Warn once that a distribution's entry points could not be read (its engines are lost)."""
    import warnings

    where = str(dist.locate_file(""))
    if where in _REPORTED:
        return
    _REPORTED.add(where)
    warnings.warn(f"asyncflow: the installed distribution at {where} is broken and was skipped "
                  f"(its {ENTRY_POINT_GROUP} engines, if any, are unknown): "
                  f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3)


def capabilities(name: str | None, load: bool = True) -> Capabilities:
    """The capabilities of the engine registered as ``name``: a built-in's from
    :data:`BUILTIN_CAPABILITIES` (no import), a plug-in's from its class (imported here; the
    defaults when it declares none, or with ``load=False``: ``check`` never imports an engine).
    An unknown engine, or one that cannot be imported, has the defaults: its name is the
    check's AF323, its import error the run's AF6xx."""
    if not name:
        return Capabilities()
    if name in BUILTIN_CAPABILITIES:
        return BUILTIN_CAPABILITIES[name]
    if not load:
        return Capabilities()
    try:
        cls = load_engine_class(name)
    except (ImportError, AttributeError, KeyError):
        return Capabilities()
    return class_capabilities(cls)


def class_capabilities(cls: type) -> Capabilities:
    """An engine class's ``capabilities``; the defaults when it has none (``serves`` and
    ``train_stream`` from whether it has those methods, ``uses_device`` and ``distributed``
    from the class attributes of those names that plug-ins written before ``capabilities``
    declare)."""
    caps = getattr(cls, "capabilities", None)
    if isinstance(caps, Capabilities):
        return caps
    return Capabilities(serves=hasattr(cls, "serve"), train_stream=hasattr(cls, "train_stream"),
                        uses_device=bool(getattr(cls, "uses_device", True)),
                        distributed=bool(getattr(cls, "distributed", False)))


def load_engine_class(name: str):
    """The engine class registered as ``name`` (imports it)."""
    import importlib

    target = engine_names()[name]
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
