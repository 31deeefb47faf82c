"""ExecutionPlan: what the compiler emits and the runtime executes.

Plain dataclasses holding strings, numbers, lists and dicts only -- never live handles -- with a
versioned JSON form that round-trips (``Plan.to_json`` / ``Plan.from_json``). Workers are named
by string id (``"generate/0"``: task ``generate``, replica 0).

==============  ==================================================================
class           meaning
==============  ==================================================================
Plan            the whole plan: the pipeline's settings plus everything below
StepPlan        batch units: prompts_per_step, samples_per_prompt, samples_per_step
ModelPlan       a model: init+args (copy_of resolved), frozen, the train task that updates it
SourcePlan      a data source: factory or path, args, fields
PoolPlan        a pool: devices, device kind (GPU or CPU slot), its placement-group bundles
TaskPlan        a task with its resolved settings, bindings and staleness annotations
WorkerPlan      one replica of a task: its pool bundles and its op list
Op              one READ / COMPUTE / WRITE / PUBLISH / ADOPT / WAIT op of a worker
ChannelPlan     one data edge: fields, streaming granularity, staleness, capacity (rows)
SyncPlan        one weight-sync edge: max_staleness, deferred or blocking adoption
Estimate        predicted step time / throughput of this plan, its synchronous form, the ideal
EvalPlan        evaluation during training: the held-out source, the versions evaluated, the
                rollout worker that generates, the metric function and its inputs, sampling
==============  ==================================================================
"""
from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any

PLAN_FORMAT = 2

# streaming granularities of a channel (the overlap pass chooses one per data edge)
GRANULARITIES = ("sample", "group", "micro_batch", "step")
# op kinds of a worker's op list (the lower pass emits them)
OP_KINDS = ("READ", "COMPUTE", "WRITE", "PUBLISH", "ADOPT", "WAIT")


@dataclass(frozen=True)
class StepPlan:
    prompts_per_step: int
    samples_per_prompt: int
    samples_per_step: int
    steps: int
    # groups fed per step: ceil(prompts_per_step * redundancy) of the gated rollout (0: as
    # prompts_per_step); the trainer takes prompts_per_step of them, the rest are cancelled
    launch_groups: int = 0
    # drop reasons whose groups are replaced by new prompts ("filter" with refill: true,
    # "staleness" with consume: first_ready), so every step still trains prompts_per_step groups
    replace: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ModelPlan:
    name: str
    init: str | None
    args: dict = field(default_factory=dict)
    frozen: bool = False
    copy_of: str | None = None
    updated_by: str | None = None  # the train task that bumps its version
    # where it comes from, resolved once by the compiler (asyncflow.modelsrc); the runtime
    # never resolves ``init`` again: "factory" (source = module:factory), "directory" (source =
    # path = the absolute directory) or "hub" (source = org/name[@rev]; path = its cached
    # snapshot, "" when not cached: downloaded at start-up)
    source_kind: str = ""
    source: str = ""
    path: str = ""
    dtype: str = "float32"  # float32 | bfloat16 | float16
    loc: str = ""  # "file:line:col" of its init (of the model it copies), for run-time errors
    # its LoRA adapter, defaults filled in (asyncflow.lora.resolve); {}: the weights train
    lora: dict = field(default_factory=dict)
    trust_remote_code: bool = False  # run the checkpoint's own code (config.json auto_map)
    # parameters a weight sync moves, as written (``params:``); 0: not written (the simulator
    # counts an HF checkpoint's, else charges no transfer)
    params: float = 0


@dataclass(frozen=True)
class SourcePlan:
    name: str
    source: str
    args: dict = field(default_factory=dict)
    fields: list[str] = field(default_factory=list)
    epochs: int | None = None  # passes over the rows the run may make (None: as needed)
    locs: dict = field(default_factory=dict)  # "source", "fields.i", "epochs" -> "file:line:col"
    split: str | None = None  # the split of a data set directory or hub data set (None: its only one)


@dataclass(frozen=True)
class Bundle:
    index: int
    resources: dict  # Ray resources of one bundle: {"CPU": 1} or {"GPU": 1, "CPU": 1}, custom


@dataclass(frozen=True)
class PoolPlan:
    name: str
    devices: int
    device_kind: str  # "GPU" | "CPU"
    bundles: list[Bundle] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)  # in time-sharing order (colocated)
    loc: str = ""  # "file:line:col" where the pool is defined (for run-time errors)


@dataclass(frozen=True)
class TaskPlan:
    name: str
    kind: str
    inputs: list[str]
    outputs: list[str]
    replicas: int = 1
    devices_per_replica: int = 1
    engine: str | None = None
    model: str | None = None
    pool: str | None = None
    fn: str | None = None
    batched: bool = False
    estimator: str | None = None
    loss: str | None = None
    env: str | None = None
    keep: list[str] = field(default_factory=list)
    args: dict = field(default_factory=dict)
    cost: dict = field(default_factory=dict)
    version_lag: int = 0  # the most policy versions its inputs may lag the trainer
    run_ahead: int = 0  # how many steps ahead of the trainer it may run
    time_share: int = 0  # position in its pool's time-sharing order
    stage: int = 0  # number of step barriers before it within a step (overlap pass)
    read_rows: int = 0  # rows of one READ unit (overlap rule 9; the cost pass's calls per step)
    bind_in: list = field(default_factory=list)  # [field, role] of each input (bind pass)
    bind_out: list = field(default_factory=list)  # [field, role] of each output
    loc: str = ""  # "file:line:col" where the task is defined (for run-time errors)
    # scheduling keys (docs/language.md, "Scheduling keys"); "" / defaults where they do not apply
    schedule: str = ""  # rollout: "queue" (continuous batching) | "batch" (whole batches)
    redundancy: float = 1.0  # rollout: groups launched per step / groups trained per step
    on_update: str = ""  # rollout: "finish" | "abort" | "continue" (in-flight samples)
    consume: str = ""  # train: "in_order" | "first_ready"
    stream: bool = False  # train: forward/backward per micro-batch as its rows become ready
    refill: bool = False  # filter: filtered groups are replaced by new prompts


@dataclass(frozen=True)
class Op:
    """One op of a worker's per-step body. A READ says everything the worker needs to lease:
    up to ``rows`` rows (a fixed-size READ: ``min_rows == rows``), in whole units of ``unit`` rows
    (a group), waiting for at least ``min_rows``; ``granularity`` ``micro_batch`` / ``step`` reads
    stay inside one step, in step order. Consecutive READs (one per channel) are one lease: the
    store joins a row's fields from every channel."""

    kind: str  # one of OP_KINDS
    task: str
    channel: str | None = None  # READ/WRITE: the channel id
    fields: list[str] = field(default_factory=list)
    rows: int = 0  # READ: the most rows one READ takes; COMPUTE/WRITE: rows per call (0: as read)
    note: str = ""
    repeat: int = 1  # times per step, all replicas together (0: until the step's rows are done)
    model: str | None = None  # WAIT/ADOPT/PUBLISH: the model whose version it concerns
    max_lag: int | None = None  # WAIT: block until version >= step - max_lag
    granularity: str = ""  # READ: one of GRANULARITIES (the coarsest of the task's inputs)
    unit: int = 1  # READ: rows come in whole units of this many (a group: samples_per_prompt)
    min_rows: int = 1  # READ: the fewest rows it waits for (fewer only when a step has drops)
    chunk: int = 0  # READ of a continuous-batching loop: the most rows one pull leases
    # READ ``micro_batch``: the most micro-batches (leases of ``rows`` rows) one store read may
    # take -- every ready one in a round trip, not a round trip each (lower rule 1); 0: one
    per_read: int = 0
    # READ of a streaming ``first_ready`` trainer: the most rows of step n + 1 it leases while
    # its device computes step n's last micro-batch (lower rule 1; 0: none ahead)
    ahead: int = 0
    lease_s: float = 0.0  # READ: seconds before an unacked lease is re-issued (0: the run's)
    # READ of replica k of a data-parallel trainer's n replicas: [k, n], its share of every
    # step -- the step's groups g with g % n == k (lower rule 8); []: the whole step
    share: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class WorkerPlan:
    id: str  # "task/replica"
    task: str
    replica: int
    pool: str | None
    bundles: list[int] = field(default_factory=list)
    resources: dict = field(default_factory=dict)
    ops: list[Op] = field(default_factory=list)
    # the process it runs in (placement rule 6): workers that time-share a device share one;
    # "" (a plan written before processes): a process of its own
    process: str = ""
    # its devices counted over the pools in order (placement rule 7): cuda:N without Ray
    devices: list[int] = field(default_factory=list)
    # -- what the worker does, as the compiler decided it (lower rule 9): the runtime and the
    # simulator read these and derive none of them again
    loop: str = ""  # "batches" | "serve" (continuous batching) | "train"
    # the train task whose version the rollouts follow (a sync edge's source, else the first
    # trainer) and whose choice of a step's rows other trainers follow; None: no trainer
    primary: str | None = None
    # "leads" (records the rows of each step it trains) | "follows" (trains the rows the primary
    # chose) | "" (neither: one trainer, or every trainer reads every row in order)
    chooses: str = ""
    gate_alpha: int | None = None  # gate rule 2: its WAIT ops' max_lag (None: waits for none)
    accept_alpha: int = 0  # gate rule 4 (a trainer): the staleness its versions may carry
    publish_every: int = 1  # a trainer: publishes after every this many steps
    # a trainer: the field its reads carry for the step's reward_mean (a reward task's reward,
    # else a multi-turn rollout's episode return); None: no reward in the pipeline
    reward_field: str | None = None
    # how the rollout samples ({"temperature": t}): scorers and trainers compute log-probs at it
    sampling: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ChannelPlan:
    id: str  # "src->dst"
    src: str
    dst: str
    fields: list[str]
    granularity: str  # one of GRANULARITIES
    staleness: int  # the most policy versions a row on it may lag
    capacity: int  # rows it may hold before the producer waits
    unit_rows: int = 1  # rows of one granularity unit (group: samples_per_prompt, ...)


@dataclass(frozen=True)
class SyncPlan:
    src: str
    dst: str
    model: str
    max_staleness: int
    mode: str  # "deferred" (adopt between requests) | "blocking" (staleness 0: step barrier)
    publish_every: int = 1  # the trainer publishes after every this many steps
    # how the weights travel (asyncflow.runtime.collective): "store" (Ray's object store, or the
    # board itself without Ray) | "collective" (torch.distributed broadcasts, in buckets)
    via: str = "store"
    bucket_bytes: int = 128 << 20  # collective: one broadcast bucket at most
    delta: bool = False  # collective: only what changed since the receiver's version


@dataclass(frozen=True)
class Estimate:
    step_time: float  # seconds per train step of this plan (steady state)
    step_time_sync: float  # the same pipeline at staleness 0
    ideal_step_time: float  # the busiest pool's work per step
    samples_per_s: float
    samples_per_s_sync: float
    speedup: float
    per_task: dict = field(default_factory=dict)  # task -> seconds of work per step
    notes: list[str] = field(default_factory=list)
    bottleneck: str = ""  # the pool or task that bounds this plan's step time
    per_pool: dict = field(default_factory=dict)  # pool -> seconds of (time-shared) work per step


@dataclass(frozen=True)
class EvalPlan:
    """``eval:`` resolved (docs/language.md, "Evaluation"): the worker ``worker`` (replica 0 of
    the rollout task) evaluates when it adopts each version of ``versions`` (the first version
    at or after it, when the weight sync skips one), scores with ``fn`` called like a reward
    task's (``fn(*inputs, **args)`` per row, or per batch when ``batched``) and reports
    ``eval/<name>`` (the mean of fn's first output) with the version it ran on."""

    data: str  # the held-out data source
    versions: list[int]  # policy versions evaluated: 0, every, 2 every, ..., steps
    rollout: str  # the rollout task whose engine generates
    worker: str  # the rollout worker that evaluates ("generate/0")
    fn: str  # "module:function" of the metric
    inputs: list[str]  # fn's inputs in the declared order: source fields or rollout outputs
    outputs: list[str]  # fn's outputs (the metric task's, or [name]): the first is the metric
    name: str  # reported as eval/<name>
    every: int = 0  # 0: at step 0 and the end only
    metric_task: str = ""  # the reward task whose fn this is ("" for eval.fn)
    args: dict = field(default_factory=dict)
    batched: bool = False
    greedy: bool = True
    temperature: float = 1.0  # when not greedy
    samples_per_prompt: int = 1
    max_prompts: int = 0  # 0: every row of the source
    loc: str = ""  # "file:line:col" of the eval section


def eval_versions(every: int | None, steps: int) -> list[int]:
    """The policy versions an ``eval:`` evaluates (evalplan rule 5): 0, ``every``, 2 ``every``,
    ... and ``steps`` (without ``every``: 0 and ``steps``)."""
    out = set(range(0, steps + 1, every)) if every else {0}
    out.add(steps)
    return sorted(out)


@dataclass(frozen=True)
class Plan:
    pipeline: str
    source_file: str
    seed: int
    step: StepPlan
    models: list[ModelPlan] = field(default_factory=list)
    data: list[SourcePlan] = field(default_factory=list)
    pools: list[PoolPlan] = field(default_factory=list)
    tasks: list[TaskPlan] = field(default_factory=list)
    workers: list[WorkerPlan] = field(default_factory=list)
    channels: list[ChannelPlan] = field(default_factory=list)
    sync: list[SyncPlan] = field(default_factory=list)
    concurrency: list[list[str]] = field(default_factory=list)  # tasks that run at once
    estimate: Estimate | None = None
    format: int = PLAN_FORMAT
    device_kind: str = "CPU"  # what a pool device is: "GPU" or "CPU" (a CPU slot)
    fields: dict = field(default_factory=dict)  # field -> {role, type, producer} (bind pass)
    eval: EvalPlan | None = None  # evaluation during training (``eval:``), if any

    def task(self, name: str) -> TaskPlan:
        for t in self.tasks:
            if t.name == name:
                return t
        raise KeyError(name)

    def worker(self, wid: str) -> WorkerPlan:
        """The worker ``wid`` ("task/replica"); an index built once (10,000 workers each
        looking themselves up were quadratic)."""
        index = self.__dict__.get("_workers_by_id")
        if index is None or len(index) != len(self.workers):
            index = {w.id: w for w in self.workers}
            self.__dict__["_workers_by_id"] = index
        w = index.get(wid)
        if w is None or w.id != wid:
            w = next((x for x in self.workers if x.id == wid), None)
            if w is None:
                raise KeyError(wid)
        return w

    def with_steps(self, steps: int) -> "Plan":
        """This plan run for ``steps`` train steps (``--steps``): a new plan, this one unchanged;
        the versions an ``eval:`` evaluates follow (evalplan rule 5)."""
        out = dataclasses.replace(self, step=dataclasses.replace(self.step, steps=int(steps)))
        if self.eval is not None:
            out = dataclasses.replace(out, eval=dataclasses.replace(
                self.eval, versions=eval_versions(self.eval.every or None, int(steps))))
        return out

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if d.get("eval") is None:  # a plan without evaluation reads as it did before eval:
            d.pop("eval", None)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if d.get("format") != PLAN_FORMAT:
            raise ValueError(f"plan format {d.get('format')!r} is not {PLAN_FORMAT}")
        return _from(cls, d)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


def _from(tp: Any, v: Any) -> Any:
    """Rebuild dataclasses from plain data, following the type hints."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: _from(hints[f.name], v[f.name]) for f in dataclasses.fields(tp) if f.name in v})
    if origin is list:
        (arg,) = typing.get_args(tp)
        return [_from(arg, x) for x in v]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if v is None:
            return None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _from(args[0], v)
    return v
