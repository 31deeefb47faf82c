"""The typed AST of a pipeline (both front ends build it; see ``docs/language.md``).

Every node carries ``loc`` (where it is defined: its key in the source) and ``locs`` (where each
attribute's value is written, keyed by attribute path: ``"model"``, ``"inputs.1"``,
``"args.lr"``). Neither takes part in equality, so two pipelines that say the same thing compare
equal wherever they were written.

=============  =============================================================
node           holds
=============  =============================================================
Pipeline       name, description, seed and the sections below
ModelDef       ``models.NAME``: init + args, or copy_of; frozen
DataDef        ``data.NAME``: source + args, the fields (columns) it provides
PoolDef        ``pools.NAME``: devices, custom Ray resources
StepDef        ``step``: prompts_per_step, samples_per_prompt, steps
TaskDef        ``tasks.NAME``: kind, engine/model/pool or fn, inputs/outputs, args,
               scheduling keys
SyncDef        one ``sync`` item: from (a train task), to, max_staleness
EvalDef        ``eval``: a held-out data source, how often, the metric, how to sample
=============  =============================================================
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from asyncflow.dsl.loc import SourceLoc

NOWHERE = SourceLoc("<none>", 0, 0)



def _loc() -> Any:
    return field(default=NOWHERE, compare=False, repr=False)


def _locs() -> Any:
    return field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class ModelDef:
    name: str
    init: str | None = None
    args: dict = field(default_factory=dict)
    copy_of: str | None = None
    frozen: bool = False
    dtype: str | None = None  # float32 | bfloat16 | float16 (None: the copied model's, else float32)
    lora: dict | None = None  # {r, alpha, dropout, target_modules}: train an adapter (asyncflow.lora)
    # run the checkpoint's own code (None: the copied model's)
    trust_remote_code: bool | None = None
    params: float | None = None  # parameters a sync moves (the simulator's transfer cost)
    loc: SourceLoc = _loc()
    locs: Mapping[str, SourceLoc] = _locs()


@dataclass(frozen=True)
class DataDef:
    name: str
    source: str
    args: dict = field(default_factory=dict)
    fields: tuple[str, ...] = ()
    epochs: int | None = None  # passes over the rows the run may make (None: as many as needed)
    split: str | None = None  # the split of a data set directory or hub data set (None: its only one)
    loc: SourceLoc = _loc()
    locs: Mapping[str, SourceLoc] = _locs()


@dataclass(frozen=True)
class PoolDef:
    name: str
    devices: int
    resources: dict = field(default_factory=dict)  # extra Ray resources each device needs
    share_process: bool = True  # workers time-sharing a device run in one process
    loc: SourceLoc = _loc()
    locs: Mapping[str, SourceLoc] = _locs()


@dataclass(frozen=True)
class StepDef:
    prompts_per_step: int
    steps: int
    samples_per_prompt: int = 1
    loc: SourceLoc = _loc()
    locs: Mapping[str, SourceLoc] = _locs()

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


@dataclass(frozen=True)
class TaskDef:
    name: str
    kind: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    engine: str | None = None
    model: str | None = None
    pool: str | None = None
    replicas: int = 1
    devices_per_replica: int = 1
    fn: str | None = None  # reward / filter / custom: "module:function"
    batched: bool = False  # fn called once per batch of rows instead of once per row
    estimator: str | None = None  # advantage
    loss: str | None = None  # train
    env: str | None = None  # rollout: "module:factory" of a multi-turn environment
    keep: tuple[str, ...] = ()  # outputs kept as final results though nothing consumes them
    args: dict = field(default_factory=dict)
    cost: dict = field(default_factory=dict)  # cost hints for the compiler's estimate
    # scheduling keys (asyncflow.kinds.SCHED); None: not written, the kind's default applies
    schedule: str | None = None  # rollout: queue | batch
    redundancy: float | None = None  # rollout: groups launched / groups trained per step, >= 1
    on_update: str | None = None  # rollout: finish | abort | continue
    consume: str | None = None  # train: in_order | first_ready
    stream: bool | None = None  # train: forward/backward per micro-batch as rows become ready
    refill: bool | None = None  # filter: filtered groups are replaced by new prompts
    loc: SourceLoc = _loc()
    locs: Mapping[str, SourceLoc] = _locs()


@dataclass(frozen=True)
class SyncDef:
    src: str  # written `from`
    dst: str  # written `to`
    max_staleness: int
    via: str | None = None  # collective | store; None: the compiler's default (lower)
    bucket_mb: float | None = None  # collective: bucket size in MB; None: 128
    delta: bool = False  # collective: send only what changed since the replica's version
    loc: SourceLoc = _loc()
    locs: Mapping[str, SourceLoc] = _locs()


@dataclass(frozen=True)
class EvalDef:
    """``eval:`` evaluation during training on the rollout engine (docs/language.md, "Evaluation")."""

    data: str  # the held-out data source (never fed to the training store)
    every: int | None = None  # policy versions between evaluations (None: step 0 and the end)
    rollout: str | None = None  # the rollout task whose engine generates (None: the one there is)
    metric: str | None = None  # the reward task whose fn scores (None: the one there is)
    fn: str | None = None  # or a "module:function" scoring like a reward task's fn
    inputs: tuple[str, ...] = ()  # fn's inputs in the declared order (default: the metric's)
    name: str | None = None  # reported as eval/<name> (default: the metric's first output / fn)
    greedy: bool = True  # greedy decoding; false: sampled at `temperature`
    temperature: float | None = None  # when greedy is false (default: the rollout's)
    samples_per_prompt: int = 1
    max_prompts: int | None = None  # the first N rows of the source (None: all)
    args: dict = field(default_factory=dict)  # keywords for fn (default: the metric task's args)
    loc: SourceLoc = _loc()
    locs: Mapping[str, SourceLoc] = _locs()


@dataclass(frozen=True)
class Pipeline:
    name: str
    tasks: dict[str, TaskDef]
    step: StepDef
    description: str = ""
    seed: int = 0
    models: dict[str, ModelDef] = field(default_factory=dict)
    data: dict[str, DataDef] = field(default_factory=dict)
    pools: dict[str, PoolDef] = field(default_factory=dict)
    sync: tuple[SyncDef, ...] = ()
    eval: EvalDef | None = None
    loc: SourceLoc = _loc()
    locs: Mapping[str, SourceLoc] = _locs()
    path: str = field(default="", compare=False)
