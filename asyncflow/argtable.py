"""The table of task ``args``: every arg of every built-in engine, loss and advantage estimator.

A task's ``args:`` mix settings of several owners: its engine (for the task's kind), its loss
(train) or estimator (advantage), the compiler's kind-generic args (``micro_batch``,
``batch_size``), and, for ``fn:`` tasks and rollouts with an ``env:``, the keywords the user
function accepts. This module declares the first four, one :class:`Arg` each (name, type,
default, one line of doc, the kinds it applies to, bounds), in the style of
:mod:`asyncflow.kinds`:

- :data:`ENGINE_ARGS`: engine name -> its args (``hf``, ``vllm``, ``deepspeed``, ``sim``);
- :data:`LOSS_ARGS`: loss name -> the :class:`asyncflow.algos.config.LossConfig` fields it reads;
- :data:`ESTIMATOR_ARGS`: estimator -> the :class:`~asyncflow.algos.config.AdvantageConfig`
  fields it reads;
- :data:`GENERIC_ARGS`: args the compiler itself reads, for any engine.

``asyncflow check`` (:mod:`asyncflow.compiler.passes.validate`, rule 6) reports an arg that no
owner of the task declares (AF210, with a did-you-mean), one of the wrong type (AF211), out of
its bounds (AF361), or one a user function does not accept (AF212). ``docs/language.md`` and
the JSON Schema list the table (:mod:`asyncflow.langdoc`, :mod:`asyncflow.schema`); a test reads
the engines' sources for every ``args.get("...")`` key and asserts each is declared here.

**Plug-in engines** (entry point group ``asyncflow.engines``) declare their args the same way, as
a class attribute of literal :class:`Arg` calls, which ``check`` reads from the engine's source
without importing it (:func:`declared_args`)::

    from asyncflow.argtable import Arg

    class EchoEngine:
        ARGS = (Arg("max_new_tokens", "int", 16, "cuts the echoed text", kinds=("rollout",),
                    min=1),)

An engine without ``ARGS`` is not checked (``check`` says so once, AF213); ``ARGS = ()``
declares that it takes none.

Pure data: imports nothing of asyncflow at import time, and never torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncflow.engines.base import BUILTIN_CAPABILITIES
from asyncflow.kinds import KINDS

# -- types: what an arg's value may be -----------------------------------------------------------
TYPES = {  # type -> how messages and docs say it
    "int": "an integer",
    "num": "a number",
    "bool": "true or false",
    "str": "a string",
    "choice": "one of",  # + the choices
    "list": "a list",
    "dict": "a mapping",
    "int|dist": "an integer or a distribution {dist: ...}",
    "num|dist": "a number or a distribution {dist: ...}",
}

ALL_KINDS = tuple(KINDS)  # every task kind of the kinds table


@dataclass(frozen=True)
class Arg:
    """One arg: its name, type (a key of :data:`TYPES`), default (``None``: none, or computed,
    said in ``doc``), one line of doc, the task kinds it applies to (``()``: every kind its
    owner runs) and the bounds of a number (``min``, exclusive when ``strict``; ``max``)."""

    name: str
    type: str
    default: Any = None
    doc: str = ""
    kinds: tuple[str, ...] = ()
    min: float | None = None
    strict: bool = False
    max: float | None = None
    choices: tuple = ()
    nullable: bool = False  # null is allowed (it means "off" or "the default")
    items: str = ""  # a list's item type ("num")
    length: int | None = None  # a list's length

    def applies(self, kind: str) -> bool:
        return not self.kinds or kind in self.kinds

    def describe(self) -> str:
        """``an integer >= 1``, ``one of k1, k2, k3``, ``a list of 2 numbers``..."""
        if self.type == "choice":
            text = "one of " + ", ".join(str(c) for c in self.choices)
        elif self.type == "list" and self.items:
            n = f"{self.length} " if self.length else ""
            text = f"a list of {n}{TYPES[self.items].split(' ', 1)[1]}s"
        else:
            text = TYPES[self.type.split("|")[0]]
        if self.min is not None:
            text += f" {'>' if self.strict else '>='} {self.min:g}"
        if self.max is not None:
            text += f"{' and' if self.min is not None else ''} <= {self.max:g}"
        if self.type.endswith("|dist"):
            text += ", or a distribution {dist: ...}"
        return text + (" (or null)" if self.nullable else "")

    def problem(self, v: Any) -> tuple[str, str] | None:
        """``("AF211", expected)`` when ``v`` is of the wrong type, ``("AF361", expected)`` when
        it is out of bounds, None when it fits. A distribution (a mapping) of a ``|dist`` arg,
        and any value of a ``num|dist`` one but a number, is the distribution reader's to check
        (:func:`asyncflow.costmodel.Distribution.from_spec`, AF362), not this one's."""
        if v is None and self.nullable:
            return None
        t = self.type
        if (t.endswith("|dist") and isinstance(v, dict)) or (t == "num|dist" and not _is_num(v)):
            return None
        ok = {"int": _is_int, "int|dist": _is_int, "num": _is_num, "num|dist": _is_num,
              "bool": lambda x: isinstance(x, bool), "str": lambda x: isinstance(x, str),
              "dict": lambda x: isinstance(x, dict),
              "choice": lambda x: x in self.choices and not isinstance(x, bool),
              "list": lambda x: isinstance(x, list) and (self.length is None or len(x) == self.length)
              and all(_is_num(i) if self.items == "num" else True for i in x)}[t](v)
        if not ok:
            return "AF211", self.describe()
        if _is_num(v) and not self._in_bounds(v):
            return "AF361", self.describe()
        return None

    def _in_bounds(self, v: float) -> bool:
        if self.min is not None and (v <= self.min if self.strict else v < self.min):
            return False
        return self.max is None or v <= self.max


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# -- args the compiler reads, whatever the engine -------------------------------------------------
_SCORING = ("logprob", "value", "train")
GENERIC_ARGS = (
    Arg("micro_batch", "int", None, "rows per forward pass (scorers) or per micro-batch of a "
        "train step, which streams them with stream: true (default: all rows, the whole step)",
        _SCORING, min=1),
    Arg("batch_size", "int", None, "rows a worker reads from the store per call (default: a "
        "step's samples; a rollout's slots when it has them)",
        tuple(k for k in ALL_KINDS if k != "train"), min=1),
)

# -- the built-in engines --------------------------------------------------------------------------
_R = ("rollout",)
_T = ("train",)
_HF_COMMON = (
    Arg("temperature", "num", 1.0, "sampling temperature; scorers and trainers take log-probs "
        "at it too (default: the pipeline's rollout's)", min=0),
    Arg("threads", "int", 2, "torch threads of the process (default: the replica's CPU slots "
        "when devices are CPU slots)", min=1),
)
_ADAMW = (
    Arg("lr", "num", 1e-4, "AdamW learning rate", _T, min=0, strict=True),
    Arg("weight_decay", "num", 0.0, "AdamW weight decay", _T, min=0),
    Arg("betas", "list", [0.9, 0.999], "AdamW betas", _T, items="num", length=2),
    Arg("adam_eps", "num", 1e-8, "AdamW epsilon", _T, min=0, strict=True),
    Arg("max_grad_norm", "num", 1.0, "gradient clipping by global norm (null: off)", _T,
        min=0, strict=True, nullable=True),
)
_LENGTH = Arg("max_new_tokens", "int|dist", 16, "response length cap (eos stops earlier): a "
              "number, or a distribution drawn per row", _R, min=1)
_TOP_P = Arg("top_p", "num", 1.0, "nucleus sampling (does not change log-probs)", _R,
             min=0, strict=True, max=1)
_TOP_K = Arg("top_k", "int", 0, "sample among the k most probable tokens (0: all; before top_p; "
             "does not change log-probs)", _R, min=0)
_TURNS = Arg("max_turns", "int", 16, "with env: agent turns at most per episode", _R, min=1)
_PROMPT = (
    Arg("max_prompt_tokens", "int", None, "the most tokens a prompt may have (default: the "
        "model's positions less the longest max_new_tokens)", _R, min=1),
    Arg("prompt_overflow", "choice", "error", "a longer prompt: error (AF657) or left (keep "
        "its last max_prompt_tokens tokens, TRL's truncation)", _R, choices=("error", "left")),
)

HF_ARGS = (
    _LENGTH, _TOP_P, _TOP_K, *_PROMPT,
    Arg("slots", "int", None, "schedule: queue: requests decoded at once (default: the step's "
        "samples, at least 32)", _R, min=1),
    _TURNS,
    *_HF_COMMON,
    Arg("device", "str", "cpu", "torch device (e.g. cuda:0; default: the worker's, from its "
        "placement: Ray's GPU, else the CPU)"),
    *_ADAMW,
    Arg("gradient_checkpointing", "bool", False, "recompute activations in the backward pass "
        "instead of keeping them (less memory, about a third more compute)", _T),
    Arg("fp32_master", "bool", False, "for a model in bfloat16 or float16: keep float32 master "
        "weights and AdamW state, step them and cast the result back (mixed precision: updates "
        "below the model dtype's resolution are not lost)", _T),
)

VLLM_ARGS = (
    _LENGTH, *_PROMPT,
    Arg("temperature", "num", 1.0, "sampling temperature; <= 0 is greedy (log-probs at T = 1)",
        _R),
    _TOP_P, _TOP_K,
    Arg("threads", "int", 2, "torch threads of the process (vLLM sets 1; put back)", _R, min=1),
    Arg("dtype", "str", "float32", "vLLM dtype", _R),
    Arg("kv_cache_gib", "num", 0.25, "CPU: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE, whole GiB, "
        "overrides it)", _R, min=0, strict=True),
    Arg("gpu_memory_utilization", "num", None, "GPU: the fraction of GPU memory vLLM may take "
        "(default: the plan's share of the device x 0.9, e.g. 0.45 where two workers share one)",
        _R, min=0, strict=True, max=1),
    Arg("enforce_eager", "bool", True, "no torch.compile or graph capture (start-up in "
        "seconds)", _R),
    Arg("max_num_seqs", "int", 256, "most sequences vLLM batches at once", _R, min=1),
    Arg("slots", "int", None, "schedule: queue: requests in flight at once (default: "
        "max_num_seqs)", _R, min=1),
    Arg("prefix_caching", "bool", None, "vLLM's automatic prefix caching (default: on, off "
        "with on_update: continue)", _R),
)

DEEPSPEED_ARGS = (
    *(a for a in HF_ARGS if a.kinds != _R),
    Arg("zero_stage", "choice", 1, "ZeRO stage: 1 (optimizer states partitioned), 2 (+ "
        "gradients) or 3 (+ parameters; gathered after each step for the sync, the export and "
        "checkpoints)", _T, choices=(1, 2, 3)),
    Arg("master_addr", "str", "127.0.0.1", "rendezvous host of the data-parallel group", _T),
    Arg("master_port", "int", None, "rendezvous port (default: a free port with 1 replica, "
        "29500 with more)", _T, min=1, max=65535),
    Arg("dist_backend", "str", None, "torch.distributed backend (default: gloo on CPU, nccl "
        "on GPU)", _T),
    Arg("dist_timeout", "num", 600, "seconds a collective may wait for the other replicas",
        _T, min=0, strict=True),
    Arg("ds_config", "dict", None, "merged over the generated DeepSpeed config (expert use)",
        _T),
)

SIM_ARGS = (
    Arg("slots", "int", 64, "samples one rollout replica works on at once; a cost hint for "
        "any kind", min=1),
    # (their values are checked by the distribution reader, AF362)
    Arg("latency", "num|dist", 0.01, "device seconds of one sample (a rollout's; a cost hint "
        "for any kind): a number >= 0 or a distribution"),
    Arg("response_tokens", "num|dist", 8, "length of a generated response: a number or a "
        "distribution", _R),
    Arg("seconds_per_sample", "num", None, "scorer / trainer: a call on n rows sleeps n * "
        "this / devices_per_replica (default 0.002, a trainer's 0.005)", min=0),
    Arg("seconds_per_call", "num", 0.0, "cost hint: fixed device seconds per call (the "
        "compiler's estimate and asyncflow simulate)", min=0),
    Arg("sync_seconds", "num", 0.0, "seconds update_weights takes (weight transfer), per call",
        min=0),
    Arg("time_scale", "num", 1.0, "multiplies every sleep (tests run a modelled second in 1 ms)",
        min=0, strict=True),
    _TURNS,
    Arg("env_threads", "int", None, "with env, schedule: queue: threads for resets and steps, "
        "and so the episodes in flight (default: 2 * slots)", _R, min=1),
)

# built-in engines that run only some kinds (the others, and plug-ins, may run any)
# the kinds a built-in engine runs (the others run every engine kind): its capabilities
ENGINE_RUNS = {n: c.runs for n, c in BUILTIN_CAPABILITIES.items() if c.runs}

ENGINE_ARGS: dict[str, tuple[Arg, ...]] = {
    "hf": HF_ARGS, "vllm": VLLM_ARGS, "deepspeed": DEEPSPEED_ARGS, "sim": SIM_ARGS}

# engines that stand in for others: the sim engine replaces a real one to time a pipeline written
# for it (`--set tasks.generate.engine=sim`), so it takes that engine's args for the same kind as
# well as its own, and models none of them (its own args set its timing)
STANDS_IN: dict[str, tuple[str, ...]] = {"sim": ("hf", "vllm", "deepspeed")}

# -- losses (asyncflow.algos.config.LossConfig) -----------------------------------------------------
_REGULARISERS = (
    Arg("kl_coef", "num", 0.0, "+ kl_coef * KL(pi || ref) per token (needs ref_logprobs)", min=0),
    Arg("kl_estimator", "choice", "k3", "the KL estimator (asyncflow.algos.kl)",
        choices=("k1", "k2", "k3")),
    Arg("entropy_coef", "num", 0.0, "- entropy_coef * entropy per token"),
)
_AGG = (
    Arg("loss_agg", "choice", None, "how per-token losses become one number (default: the "
        "loss's)", choices=("token_mean", "seq_mean", "seq_sum_norm"), nullable=True),
    Arg("norm_length", "int", None, "seq_sum_norm (Dr. GRPO): the fixed length L (default: the "
        "padded length)", min=1, nullable=True),
)
_CLAMP = Arg("log_ratio_clamp", "num", 20.0, "|log ratio| clamped before exp", min=0, strict=True)
_CLIP = Arg("clip_eps", "num", 0.2, "ratio clipped to [1 - clip_eps, 1 + clip_eps]", min=0)
_POLICY = (*_REGULARISERS, *_AGG, _CLAMP)

LOSS_ARGS: dict[str, tuple[Arg, ...]] = {
    "grpo": (_CLIP, *_POLICY),
    "ppo": (_CLIP, *_POLICY),
    "dapo": (_CLIP,
             Arg("clip_eps_low", "num", None, "lower epsilon (default: clip_eps)", min=0,
                 nullable=True),
             Arg("clip_eps_high", "num", 0.28, "clip-higher: ratio <= 1 + clip_eps_high", min=0),
             *_POLICY),
    "cispo": (Arg("cispo_eps_low", "num", 1.0, "IS weight >= 1 - eps_low (1.0: no lower bound)",
                  min=0),
              Arg("cispo_eps_high", "num", 2.0, "IS weight <= 1 + eps_high", min=0), *_POLICY),
    "tis": (_CLIP, Arg("tis_cap", "num", 2.0, "importance weight truncated at C", min=0,
                       strict=True), *_POLICY),
    "topr": (Arg("topr_cap", "num", 1.0, "negative-advantage tokens weighted by min(pi / "
                 "pi_behav, cap)", min=0, strict=True),
             Arg("topr_level", "choice", "token", "ratio per token or per sequence",
                 choices=("token", "sequence")), *_POLICY),
    "decoupled_ppo": (_CLIP, Arg("behav_weight_cap", "num", None, "drop tokens whose behaviour "
                                 "weight is above it (default: none dropped)", min=0,
                                 strict=True, nullable=True), *_POLICY),
    "value": (Arg("value_clip", "num", 0.2, "v clipped to old_v +- value_clip (null: plain MSE)",
                  min=0, strict=True, nullable=True), *_AGG),
}

# -- advantage estimators (asyncflow.algos.config.AdvantageConfig) ----------------------------------
_EPS = Arg("eps", "num", 1e-6, "added to a standard deviation before dividing by it", min=0)
_UNBIASED = Arg("unbiased_std", "bool", True, "standard deviations with Bessel's correction")
_ADV_KL = Arg("kl_coef", "num", 0.0, "per-token reward -kl_coef * kl_t (with a kl input)", min=0)
_GAMMA = Arg("gamma", "num", 1.0, "discount per token", min=0, max=1)
ESTIMATOR_ARGS: dict[str, tuple[Arg, ...]] = {
    "grpo": (_EPS, Arg("scale_by_std", "bool", True, "divide by the group's std (false: Dr. "
                       "GRPO)"), _UNBIASED),
    "rloo": (),
    "reinforce_pp": (_ADV_KL, _GAMMA, Arg("group_baseline", "bool", False, "subtract the group "
                                          "mean first (REINFORCE++-baseline)"), _EPS, _UNBIASED),
    "gae": (_ADV_KL, _GAMMA, Arg("lam", "num", 0.95, "GAE lambda", min=0, max=1),
            Arg("whiten", "bool", False, "normalise advantages over the batch's tokens"), _EPS),
}


# -- suggestions for an unknown arg ---------------------------------------------------------------
# names users bring from TRL, verl and elsewhere -> ours (a did-you-mean that spelling cannot find)
ALIASES = {
    "learning_rate": "lr", "lrate": "lr", "adam_epsilon": "adam_eps", "clip_grad_norm": "max_grad_norm",
    "grad_clip": "max_grad_norm", "max_tokens": "max_new_tokens", "max_length": "max_new_tokens",
    "max_completion_length": "max_new_tokens", "response_length": "max_new_tokens",
    "beta": "kl_coef", "kl_beta": "kl_coef", "init_kl_coef": "kl_coef", "epsilon": "clip_eps",
    "clip_ratio": "clip_eps", "cliprange": "clip_eps", "epsilon_high": "clip_eps_high",
    "clip_ratio_high": "clip_eps_high", "epsilon_low": "clip_eps_low",
    "clip_ratio_low": "clip_eps_low", "loss_type": "loss_agg", "loss_agg_mode": "loss_agg",
    "per_device_train_batch_size": "micro_batch", "ppo_micro_batch_size": "micro_batch",
    "mini_batch": "micro_batch", "temp": "temperature", "cliprange_value": "value_clip",
    "lambda": "lam", "gae_lambda": "lam", "max_num_batched_seqs": "max_num_seqs",
}


def suggest(key: str, names) -> str | None:
    """``did you mean 'x'?`` for an unknown arg ``key`` among ``names``: a known alias (TRL's
    ``learning_rate`` is ``lr``), a close spelling, or a name one is the start of; else None."""
    import difflib

    names = list(names)
    best = ALIASES.get(key) if ALIASES.get(key) in names else None
    if best is None:
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
        prefix = [n for n in names if min(len(n), len(key)) >= 2
                  and (n.startswith(key) or key.startswith(n))]
        best = close[0] if close else (prefix[0] if prefix else None)
    return f"did you mean '{best}'?" if best else None


# -- what a task may take ---------------------------------------------------------------------------
def owners(kind: str, engine: str | None = None, loss: str | None = None,
           estimator: str | None = None,
           engine_args: tuple[Arg, ...] | None = None) -> list[tuple[str, dict[str, Arg]]]:
    """The declared owners of a task's args: ``[(who, {name: Arg})]`` in order (engine, loss or
    estimator, the compiler's). ``engine_args``: a plug-in's declaration (else the table's)."""
    out: list[tuple[str, dict[str, Arg]]] = []
    if engine is not None:
        table = engine_args if engine_args is not None else ENGINE_ARGS.get(engine, ())
        out.append((f"the {engine} engine's {kind} args",
                    {a.name: a for a in table if a.applies(kind)}))
        stood = [e for e in STANDS_IN.get(engine, ()) if kind in ENGINE_RUNS.get(e, (kind,))]
        if stood:
            out.append((f"the {kind} args of the engines it stands in for ({', '.join(stood)})",
                        {a.name: a for e in stood for a in ENGINE_ARGS[e] if a.applies(kind)}))
    if kind == "train" and loss in LOSS_ARGS:
        out.append((f"the {loss} loss's", {a.name: a for a in LOSS_ARGS[loss]}))
    if kind == "advantage" and estimator in ESTIMATOR_ARGS:
        out.append((f"the {estimator} estimator's", {a.name: a for a in ESTIMATOR_ARGS[estimator]}))
    out.append(("the compiler's", {a.name: a for a in GENERIC_ARGS if a.applies(kind)}))
    return out


def declared(kind: str, engine: str | None = None, loss: str | None = None,
             estimator: str | None = None,
             engine_args: tuple[Arg, ...] | None = None) -> dict[str, Arg]:
    """Every arg a task of ``kind`` on ``engine`` with ``loss`` / ``estimator`` may take (besides
    its function's); where two owners declare one name, the first one's entry."""
    return merged(owners(kind, engine, loss, estimator, engine_args))


def merged(table: list[tuple[str, dict[str, Arg]]]) -> dict[str, Arg]:
    """The args of an :func:`owners` table in one map; where two owners declare one name, the
    first one's entry."""
    out: dict[str, Arg] = {}
    for _, args in table:
        for name, a in args.items():
            out.setdefault(name, a)
    return out


# -- plug-in engines: their ARGS, read from source ------------------------------------------------
def declared_args(target: str, paths=()) -> tuple[Arg, ...] | str:
    """The ``ARGS`` a plug-in engine class (``"module:Class"``) declares, read from its module's
    source without importing it; a string saying why there are none that can be read."""
    import ast
    import os

    from asyncflow.refs import find_module

    module, _, cls = target.partition(":")
    spec = find_module(module, list(paths))
    origin = getattr(spec, "origin", None) if spec is not None else None
    if not origin or not origin.endswith(".py") or not os.path.isfile(origin):
        return f"no Python source for module '{module}'"
    try:
        with open(origin, "rb") as f:
            tree = ast.parse(f.read(), origin)
    except (SyntaxError, OSError, ValueError) as e:
        return f"its module does not parse ({e.__class__.__name__})"
    node = next((s for s in tree.body if isinstance(s, ast.ClassDef) and s.name == cls), None)
    if node is None:
        return f"no class '{cls}' at the top of {module}"
    value = None
    for s in node.body:
        if isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ARGS"
                                             for t in s.targets):
            value = s.value
        elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) \
                and s.target.id == "ARGS":
            value = s.value
    if value is None:
        return f"class {cls} has no ARGS"
    if not isinstance(value, (ast.Tuple, ast.List)):
        return f"{cls}.ARGS is not a tuple of Arg(...) calls"
    out = []
    for item in value.elts:
        name = getattr(getattr(item, "func", None), "id", None) or getattr(
            getattr(item, "func", None), "attr", None)
        if not isinstance(item, ast.Call) or name != "Arg":
            return f"{cls}.ARGS holds something other than Arg(...) calls (line {item.lineno})"
        try:
            pos = [ast.literal_eval(a) for a in item.args]
            kw = {k.arg: ast.literal_eval(k.value) for k in item.keywords}
            for key in ("kinds", "choices"):
                if isinstance(kw.get(key), list):
                    kw[key] = tuple(kw[key])
            arg = Arg(*pos, **kw)
        except (ValueError, TypeError) as e:
            return f"{cls}.ARGS: Arg(...) at line {item.lineno} is not literal ({e})"
        if arg.type not in TYPES:
            return f"{cls}.ARGS: arg '{arg.name}' has an unknown type '{arg.type}'"
        out.append(arg)
    return tuple(out)


__all__ = ["Arg", "TYPES", "GENERIC_ARGS", "ENGINE_ARGS", "ENGINE_RUNS", "LOSS_ARGS", "ESTIMATOR_ARGS",
           "ALIASES", "owners", "declared", "declared_args", "suggest"]
