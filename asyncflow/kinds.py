"""The table of task kinds, estimators and losses: what each reads and writes, by meaning.

A field's name is the user's label; its meaning is the *role* of the slot that produces it
(docs/language.md, "Field names are the user's"). This module is the one place that says, for every
task kind and for every advantage estimator and loss:

- the keys the kind needs and takes (``needs`` / ``takes``), the scheduling keys among them
  (:data:`SCHED_KEYS`: their values and defaults, docs/language.md "Scheduling keys");
- the roles it writes, in the order its ``outputs`` list them (``outputs``), each with a type;
- the roles it reads (``inputs``): a slot per role, with the producer roles it accepts, whether
  it is optional, and whether it takes several fields (``many``); ``None`` for the kinds whose
  inputs go to a user function *in the declared order* (reward, filter, custom);
- its default input granularity, its worker loop and its runner.

The compiler's ``bind`` pass (:mod:`asyncflow.compiler.passes.bind`) infers every field's role
and type from its producer and binds every consumer's inputs to its slots; the plan carries the
bindings and the runtime renames columns by them, so no module looks a column up by a fixed
name. ``docs/language.md`` and ``asyncflow schema`` are generated from this table.

Pure data: importing it imports nothing else of asyncflow (the DSL, the compiler and the runtime
all read it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

# -- types: what one row of a column holds --------------------------------------------------------
TYPES = {  # type -> how messages and docs say it (one row of a column holds ...)
    "text": "text",  # a str; a rollout's is an asyncflow.tokens.Text carrying its token ids
    "token_floats": "per-token floats",  # one list of floats per sample
    "float": "one float per sample",
    "adv": "per-token floats or one float per sample",
    "flag": "a keep flag",  # one bool per sample
    "data": "a data column",  # any JSON value of a data source's rows
    "any": "any value",  # a user function's output
}


@dataclass(frozen=True)
class Role:
    """A role some slot produces: its name and type."""

    name: str
    type: str
    doc: str = ""


# -- roles a producer writes ---------------------------------------------------------------------
ROLES = {r.name: r for r in (
    Role("data", "data", "a column of a data source"),
    Role("response", "text", "the sampled response (with its prompt's and its own token ids)"),
    Role("logprobs", "token_floats", "behaviour log-probs of the response, from the rollout"),
    Role("ref_logprobs", "token_floats", "log-probs of the response under a frozen reference"),
    Role("prox_logprobs", "token_floats",
         "log-probs of the response under the current (proximal) policy weights"),
    Role("values", "token_floats", "a critic's per-token values V(s_t)"),
    Role("reward", "float", "a scalar reward of the sample"),
    Role("info", "any", "a further output of a reward function"),
    Role("advantages", "adv", "advantages (per sample, or per token for gae)"),
    Role("returns", "token_floats", "per-token returns (gae's value targets)"),
    Role("keep", "flag", "a filter's keep flag: rows without it never reach later tasks"),
    Role("custom", "any", "an output of a custom function"),
)}


@dataclass(frozen=True)
class Slot:
    """A role a consumer reads: which producer roles fit it, whether it may be left out, and
    whether it takes several fields (ordering-only inputs such as a filter's keep flags)."""

    role: str
    accepts: tuple[str, ...]
    optional: bool = False
    many: bool = False
    doc: str = ""

    @property
    def type(self) -> str:
        return ROLES[self.role if self.role in ROLES else self.accepts[0]].type


KEEP = Slot("keep", ("keep",), optional=True, many=True,
            doc="keep flags of filters upstream (read only to wait for them)")
PROMPT = Slot("prompt", ("data", "custom"), optional=True,
              doc="the prompt (scorers and trainers also find it in the response's tokens)")
RESPONSE = Slot("response", ("response",), doc="the response to score or train on")
REWARD = Slot("reward", ("reward", "info", "custom"), doc="the scalar reward of each sample")


@dataclass(frozen=True)
class Signature:
    """Roles read (``inputs``; None: a user function's positional arguments) and written."""

    inputs: tuple[Slot, ...] | None
    outputs: tuple[str, ...]  # roles of ``outputs`` by position
    more_outputs: str | None = None  # role of every further output (None: no more allowed)


# -- advantage estimators -------------------------------------------------------------------------
@dataclass(frozen=True)
class EstimatorInfo:
    target: str  # "module:function"
    scope: str  # group | batch | sample: how much of a step it must see at once
    needs_values: bool = False
    doc: str = ""

    @property
    def signature(self) -> Signature:
        slots = (REWARD,)
        if self.needs_values:
            slots += (Slot("values", ("values",), doc="the critic's per-token values"),)
        outs = ("advantages", "returns") if self.needs_values else ("advantages",)
        return Signature(slots + (KEEP,), outs)


# how much of a step an estimator's scope needs on its inputs (the rest: sample)
SCOPE_GRANULARITY = {"batch": "step", "group": "group"}

ESTIMATORS = {
    "grpo": EstimatorInfo("asyncflow.algos.advantages:grpo", "group",
                          doc="(r - mean(group)) / (std(group) + eps)"),
    "rloo": EstimatorInfo("asyncflow.algos.advantages:rloo", "group",
                          doc="r - mean of the other samples of the group"),
    "reinforce_pp": EstimatorInfo("asyncflow.algos.advantages:reinforce_pp", "batch",
                                  doc="r normalised over the whole step's batch"),
    "gae": EstimatorInfo("asyncflow.algos.advantages:gae", "sample", needs_values=True,
                         doc="generalised advantage estimation from per-token values"),
}


# -- losses ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LossInfo:
    target: str
    off_policy: bool = False  # corrects for stale samples (importance weights)
    critic: bool = False  # trains a value head
    doc: str = ""
    agg: str = "token_mean"  # default reduction of per-token losses (LossConfig.loss_agg wins)
    proximal: bool = False  # reads the proximal policy's log-probs when given

    @property
    def signature(self) -> Signature:
        if self.critic:
            slots = (PROMPT, RESPONSE,
                     Slot("values", ("values",), optional=True,
                          doc="the critic's values when the sample was made (clipping)"),
                     Slot("returns", ("returns",), doc="value targets (gae's returns)"))
        else:
            slots = (PROMPT, RESPONSE,
                     Slot("logprobs", ("logprobs",), doc="behaviour log-probs from the rollout"),
                     Slot("ref_logprobs", ("ref_logprobs",), optional=True,
                          doc="reference log-probs (the KL term)"))
            if self.proximal:
                slots += (Slot("prox_logprobs", ("prox_logprobs",), optional=True,
                               doc="proximal-policy log-probs"),)
            slots += (Slot("advantages", ("advantages",), doc="advantages"),)
        return Signature(slots + (KEEP,), ())


LOSSES = {
    "grpo": LossInfo("asyncflow.algos.ppo:grpo_loss", doc="clipped surrogate, sequence-mean",
                     agg="seq_mean"),
    "ppo": LossInfo("asyncflow.algos.ppo:ppo_loss", doc="clipped surrogate"),
    "dapo": LossInfo("asyncflow.algos.ppo:dapo_loss", doc="clip-higher, token-level mean"),
    "cispo": LossInfo("asyncflow.algos.offpolicy:cispo_loss", off_policy=True,
                      doc="clipped IS weight, stop-gradient, REINFORCE"),
    "tis": LossInfo("asyncflow.algos.offpolicy:tis_loss", off_policy=True,
                    doc="truncated importance sampling"),
    "topr": LossInfo("asyncflow.algos.offpolicy:topr_loss", off_policy=True,
                     doc="tapered off-policy REINFORCE"),
    "decoupled_ppo": LossInfo("asyncflow.algos.offpolicy:decoupled_ppo_loss", off_policy=True,
                              proximal=True, doc="behaviour vs proximal policy"),
    "value": LossInfo("asyncflow.algos.value:value_loss", critic=True, doc="clipped value MSE"),
}


# -- task kinds ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    name: str
    doc: str
    needs: tuple[str, ...]  # keys it must have
    takes: tuple[str, ...] = ()  # further keys it may have: references, scheduling keys
    signature: Signature | None = None  # None: from its estimator (advantage) or loss (train)
    granularity: str = "sample"  # what it needs on its inputs by default (overlap pass)
    loop: str = "batches"  # the worker loop: batches | serve (rollouts that can) | train
    runner: str = ""  # what a COMPUTE op calls
    engine: bool = False  # run by an engine on a pool's devices
    needs_outputs: bool = True
    fn_inputs: bool = False  # inputs go to a user function in the declared order
    order: int = 3  # position in a pool's time-sharing order (rollout first)
    # what gives its signature when ``signature`` is None: "estimator" (its granularity too)
    # or "loss"
    defined_by: str = ""
    # further data: "env_outputs" (its outputs with ``env``), "trained_outputs" (its outputs on
    # a model some train task updates)
    extra: dict = field(default_factory=dict)


_ROLLOUT_OUT = ("response", "logprobs")

KINDS = {k.name: k for k in (
    Kind("rollout", "samples responses to prompts with the policy",
         ("engine", "model", "pool"), ("env", "schedule", "redundancy", "on_update"),
         Signature((Slot("prompt", ("data", "custom", "response"),
                         doc="the prompt (the first input)"),
                    Slot("context", ("data", "custom", "reward", "info"), optional=True, many=True,
                         doc="with env: further row fields, passed to the environment's reset"
                             " after the prompt")),
                   _ROLLOUT_OUT),
         loop="serve", runner="engine.generate", engine=True, order=0,
         extra={"env_outputs": ("response", "logprobs", "reward")}),
    Kind("reward", "scores each sample with a user function",
         ("fn",), ("pool",), Signature(None, ("reward",), more_outputs="info"),
         runner="fn", fn_inputs=True),
    Kind("logprob", "log-probs of a response under a model (a reference, or the current policy)",
         ("engine", "model", "pool"), (),
         Signature((PROMPT, RESPONSE, KEEP), ("ref_logprobs",)),
         runner="engine.logprobs", engine=True, order=1,
         extra={"trained_outputs": ("prox_logprobs",)}),
    Kind("value", "a critic's per-token values of a response",
         ("engine", "model", "pool"), (),
         Signature((PROMPT, RESPONSE, KEEP), ("values",)),
         runner="engine.logprobs", engine=True, order=2),
    Kind("advantage", "advantages (and returns) from rewards with an estimator",
         ("estimator",), ("pool",), None, runner="estimator", defined_by="estimator"),
    Kind("train", "updates a model's weights with a loss; publishes new versions",
         ("engine", "model", "pool", "loss"), ("consume", "stream"), None,
         granularity="micro_batch", loop="train",
         runner="engine.train_step", engine=True, needs_outputs=False, order=4,
         defined_by="loss"),
    Kind("filter", "keeps or drops whole groups with a user function (e.g. DAPO's)",
         ("fn",), ("pool", "refill"), Signature(None, ("keep",), more_outputs="keep"),
         granularity="group", runner="filter", fn_inputs=True),
    Kind("custom", "any user function over rows or batches",
         ("fn",), ("pool",), Signature(None, ("custom",), more_outputs="custom"),
         runner="fn", fn_inputs=True, needs_outputs=False),
)}

TASK_KINDS = tuple(KINDS)
ENGINE_KINDS = tuple(k for k, v in KINDS.items() if v.engine)
REF_KEYS = ("engine", "model", "pool", "fn", "estimator", "loss", "env")


# -- scheduling keys (docs/language.md, "Scheduling keys") -----------------------------------------
@dataclass(frozen=True)
class SchedKey:
    """A scheduling key: its values (``choices``; () for a number or a bool) and its default
    where a kind takes it (None: computed, see :func:`asyncflow.compiler.passes.scheduling`).
    Which kinds take it: their ``takes``; what it means: ``asyncflow.schema.KEY_DOCS``."""

    name: str
    type: str  # choice | num | bool
    default: object = None
    choices: tuple[str, ...] = ()
    min: float | None = None


SCHED = {s.name: s for s in (
    SchedKey("schedule", "choice", "queue", ("queue", "batch")),  # rollout
    SchedKey("redundancy", "num", 1.0, min=1.0),  # rollout: groups launched / groups trained
    SchedKey("on_update", "choice", "finish", ("finish", "abort", "continue")),  # rollout
    SchedKey("consume", "choice", "in_order", ("in_order", "first_ready")),  # train
    SchedKey("stream", "bool", None),  # train: default args.micro_batch < samples_per_step
    SchedKey("refill", "bool", True),  # filter
)}
SCHED_KEYS = tuple(SCHED)


def sched_owners(key: str) -> tuple[str, ...]:
    """The kinds that take the scheduling key ``key``."""
    return tuple(k for k, v in KINDS.items() if key in v.needs + v.takes)


def signature(kind: str, estimator: str | None = None, loss: str | None = None,
              env: bool = False, trained: bool = False) -> Signature | None:
    """The signature of a task: its kind's, or its estimator's / loss's; None when unknown.

    ``env``: a multi-turn rollout (writes the episode's return as a third output).
    ``trained``: a logprob task whose model some train task updates (proximal log-probs)."""
    k = KINDS.get(kind)
    if k is None:
        return None
    if k.defined_by:
        info = (ESTIMATORS.get(estimator or "") if k.defined_by == "estimator"
                else LOSSES.get(loss or ""))
        return info.signature if info else None
    sig = k.signature
    if env and "env_outputs" in k.extra:
        return Signature(sig.inputs, k.extra["env_outputs"])
    if trained and "trained_outputs" in k.extra:
        return Signature(sig.inputs, k.extra["trained_outputs"])
    return sig


def granularity(kind: str, estimator: str | None = None) -> str:
    """The input granularity a kind needs by default (the overlap pass refines ``train``)."""
    k = KINDS.get(kind)
    if k is not None and k.defined_by == "estimator":
        info = ESTIMATORS.get(estimator or "")
        return SCOPE_GRANULARITY.get(info.scope if info else "", "sample")
    return k.granularity if k else "sample"


def describe_type(t: str) -> str:
    return TYPES.get(t, t)
