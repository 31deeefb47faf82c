"""The JSON Schema of the YAML pipeline language, generated from the tables that define it.

The keys, their types, defaults, bounds and which are required come from the builder's tables
(:mod:`asyncflow.dsl.build`); the task kinds, estimators and losses, the keys each kind needs
and the roles each one reads and writes come from :mod:`asyncflow.kinds`. This module adds
only the words: one description per key (``KEY_DOCS``). ``asyncflow schema`` prints the schema,
``docs/asyncflow.schema.json`` is its copy in the repository (a test keeps the two equal), and
editors use it through a first line ``# yaml-language-server: $schema=...`` in a pipeline file.

The schema checks what one file can get wrong on its own: unknown keys, value types, names,
bounds, required keys, and the keys each task kind needs or may not have. Whether the names a
file uses exist (models, pools, fields, functions) is ``asyncflow check``'s job.
"""
from __future__ import annotations

from typing import Any

from asyncflow import argtable, kinds
from asyncflow.dsl import build
from asyncflow.engines.base import BUILTIN

DRAFT = "https://json-schema.org/draft/2020-12/schema"

# one description per key of every section of dsl/build.py (SECTIONS names the sections)
KEY_DOCS: dict[str, dict[str, str]] = {
    "pipeline": {
        "pipeline": "The pipeline's name.",
        "description": "One line on what the pipeline does.",
        "seed": "Seed of the run's random choices (data order, sampling, initial weights).",
        "models": "The models, by name: each is built by a factory or loaded from a checkpoint, "
                  "or is a copy of another model.",
        "data": "The data sources, by name: where the prompt rows come from and the fields each "
                "row has.",
        "pools": "The device pools, by name. Tasks on one pool are colocated and time-share its "
                 "devices; a task without a pool runs on a CPU worker outside the pools.",
        "step": "The size of a training step and how many steps the run has.",
        "tasks": "The tasks, by name: the nodes of the dataflow graph. Data edges come from "
                 "field names: a task that reads a field is fed by the task that writes it.",
        "sync": "Weight-sync edges: the only back edges. Each goes from a train task to a task "
                "that uses the model it trains, with the policy-version lag allowed.",
        "eval": "Evaluation during training: held-out prompts generated on the rollout engine "
                "and scored at step 0, every N steps and at the end; reported as eval/<metric>.",
    },
    "model": {
        "init": 'Where the model comes from: a "module:factory" reference; a Hugging Face '
                "checkpoint directory, relative to this file (then the working directory) or "
                "absolute; or a hub id org/name[@revision], read from the Hugging Face cache "
                "(downloaded at start-up when online; with HF_HUB_OFFLINE=1 it must be cached). "
                "`check` and `compile` say which. Give init or copy_of, not both.",
        "dtype": "The weights' dtype: float32, bfloat16 or float16 (default: the copied "
                 "model's, else bfloat16 on GPUs and float32 on CPU slots). Log-probabilities "
                 "are computed in float32.",
        "args": "Keyword arguments of the init factory.",
        "copy_of": "Start as a copy of this other model, with weights of its own (e.g. a "
                   "frozen reference).",
        "frozen": "Never trained: no train task may update it and no sync edge targets its "
                  "tasks.",
        "lora": "Train a LoRA adapter instead of the weights (peft): {r: rank >= 1 (8), alpha: "
                "scale > 0 (2 r), dropout: in [0, 1) (0), target_modules: a list of module "
                'names or "all-linear" (the default)}; {} takes every default. A sync sends the '
                "adapter only; the export writes the merged model and the adapter. hf engine.",
        "trust_remote_code": "Run the Python code a checkpoint ships (its config.json "
                             "auto_map: a custom architecture or tokenizer), as transformers' "
                             "trust_remote_code=True does, for the model and its tokenizer "
                             "(and vLLM's). Unset: the copied model's, else false; `check` "
                             "reports a checkpoint with code of its own without it (AF339).",
        "params": "How many parameters the model has (e.g. 7.6e9): what a weight sync moves, "
                  "times the dtype's bytes, in asyncflow simulate (docs/weight-sync.md). "
                  "Default: counted from a Hugging Face checkpoint's files; else unknown, and "
                  "the simulated sync costs no transfer. The runtime ignores it.",
    },
    "data source": {
        "source": 'Where the rows come from: a "module:function" reference; a .jsonl, .json '
                  "or .parquet file; a directory written by datasets' save_to_disk, or one "
                  "load_dataset reads (data files named by split); or a Hugging Face hub data set "
                  "org/name[@revision] (the datasets library; under HF_HUB_OFFLINE=1 only from the "
                  "cache). Paths are relative to the pipeline file, then the working directory; "
                  "a directory of that name wins over the hub.",
        "args": "Keyword arguments of the source function (of datasets.load_dataset for a hub "
                "data set or a data-files directory, e.g. name: a configuration).",
        "fields": "The fields of a row, as tasks name them (each has the role 'data'); they "
                  "are the row's keys in the source.",
        "epochs": "How many passes over the rows the run may make. Without it, a source with "
                  "fewer prompts than steps x prompts_per_step is read again from the start and "
                  "the run warns; with it, too few passes is an error (AF606).",
        "split": "The split of a data set directory or hub data set (train, test, or a slice "
                 "like train[:1000] or train[:10%]). Needed where the source has several; a "
                 "file or function has none (AF390).",
    },
    "pool": {
        "devices": "How many devices the pool has: GPUs, or CPU slots where there is no GPU.",
        "share_process": "Whether the workers that time-share one of the pool's devices run in "
                         "one process (true, the default, as verl's colocated workers: torch and "
                         "the engine libraries are imported once per device) or each in its own "
                         "(false: one task's crash cannot take the others down with it).",
        "resources": "Custom Ray resources each device needs, e.g. {my_label: 1} to place the "
                     "pool on the nodes started with that resource (not GPU or CPU).",
    },
    "step": {
        "prompts_per_step": "Prompts per training step.",
        "samples_per_prompt": "Samples drawn per prompt (the size of a group for grpo and "
                              "rloo).",
        "steps": "Training steps in the run.",
    },
    "task": {
        "kind": "What the task does; it decides the keys the task needs and the roles it reads "
                "and writes.",
        "engine": "The engine that runs the task's model (rollout, logprob, value and train "
                  "tasks). Engines are plug-ins: any registered name.",
        "model": "The model the task runs (a name from models).",
        "pool": "The pool whose devices the task runs on (a name from pools).",
        "replicas": "How many copies of the task run side by side, pulling rows from the store.",
        "devices_per_replica": "Devices of the pool each replica uses.",
        "inputs": "The fields the task reads. Names are labels: each is bound to one of the "
                  "kind's input slots by the role of the task that writes it.",
        "outputs": "The fields the task writes, by position: the kind's output roles in order.",
        "keep": "Outputs kept as final results though no task reads them.",
        "fn": 'The user function, "module:function" (reward, filter and custom tasks).',
        "batched": "Call fn once per batch with input columns instead of once per row.",
        "estimator": "The advantage estimator (advantage tasks).",
        "loss": "The loss the train task minimises.",
        "env": 'A multi-turn environment factory, "module:factory" (rollout tasks): one '
               "episode per sample instead of a single response.",
        "args": "Settings of the task: for its engine, its fn or env (which get the keywords "
                "they accept), its estimator or its loss.",
        "cost": "Cost hints: the device time of this task for the compiler's step-time "
                "estimate and for asyncflow simulate, e.g. {latency: ..., slots: ..., "
                "seconds_per_sample: ..., seconds_per_call: ...} (an engine: sim task's args "
                "serve when it has none).",
        "schedule": "Rollout tasks: how samples are generated. queue (the default): each sample "
                    "is its own request; a slot freed by a finished sample takes the next at once, "
                    "and the sample streams on to its reward. batch: whole batches per engine "
                    "call (the baseline).",
        "redundancy": "Rollout tasks: launch this many times the groups a step needs (1.25: 25% "
                      "more); the first finished are trained, the rest cancelled and counted. "
                      "Default 1.0: none; for a queue rollout on a trained model fed by a "
                      "consume: first_ready trainer at max_staleness >= 1, one group more than "
                      "prompts_per_step a step (the buffer's spare).",
        "on_update": "Rollout tasks: what in-flight samples do when new weights arrive. finish "
                     "(the default): finish with the old version; abort: restart with the new "
                     "weights; continue: keep the tokens and go on with the new weights (the "
                     "sample's version is its oldest). The default is continue instead for a "
                     "schedule: queue rollout whose weights come from a consume: first_ready "
                     "trainer at max_staleness >= 1 (finish would wait for the slowest sample "
                     "before each adoption, which defeats the buffer where no spare group is launched: AF329).",
        "consume": "Train tasks: which samples a train step takes. in_order (the default): step "
                   "n trains exactly step n's rows (deterministic; max_staleness 0 equals the "
                   "synchronous loop). first_ready: step n takes the first ready samples with "
                   "n - version <= max_staleness, from any step; each sample is still trained at "
                   "most once, and what grows too stale is dropped, counted and replaced.",
        "stream": "Train tasks: train on micro-batches as they become ready (forward and "
                  "backward per micro-batch), one optimiser step per train step. Default: true "
                  "when args.micro_batch is below the step's samples.",
        "refill": "Filter tasks: groups the filter drops are replaced by new prompts, so every "
                  "train step still gets prompts_per_step groups. Default true.",
    },
    "eval": {
        "data": "The held-out data source (a name under data:). It feeds no task and never "
                "enters the training store; its fields must include the rollout's inputs and "
                "what the metric reads that the rollout does not write.",
        "every": "Evaluate every N policy versions (train steps), besides step 0 and the end. "
                 "Default: at step 0 and at the end only.",
        "rollout": "The rollout task whose engine generates (replica 0 evaluates, between its "
                   "requests). Default: the one rollout task (on a trained model).",
        "metric": "The reward task whose fn scores, called as that task calls it. Default: the "
                  "one reward task.",
        "fn": 'Or a "module:function" scoring each sample like a reward fn: its inputs in the '
              "declared order (inputs:), returning a number (several: a tuple, the first is the "
              "metric).",
        "inputs": "The metric's inputs in the declared order: fields of the held-out source or "
                  "outputs of the rollout. Default: the metric task's inputs.",
        "name": "Reported as eval/<name>. Default: the metric task's first output (or fn's "
                "function name).",
        "greedy": "Greedy decoding (temperature 0). false: sampled at temperature. Default true.",
        "temperature": "The sampling temperature when greedy is false. Default: the rollout's.",
        "samples_per_prompt": "Samples generated per held-out prompt. Default 1.",
        "max_prompts": "Evaluate on the first N rows of the source only. Default: all rows.",
        "args": "Keyword arguments of the metric function. Default: the metric task's args.",
    },
    "sync edge": {
        "from": "The train task whose new weights are sent.",
        "to": "The task that receives them (it must use the model the train task updates).",
        "max_staleness": "How many versions behind a sample's policy may be when it is trained "
                         "on: 0 is synchronous, on-policy.",
        "via": "How the weights travel: collective (torch.distributed broadcasts in buckets "
               "from the trainer into the receiver's engine: NCCL between GPUs, gloo otherwise) "
               "or store (one copy in Ray's object store per version). Default: collective "
               "where both tasks run torch engines (hf, deepspeed, vllm) on the Ray backend, "
               "store otherwise; delta or bucket_mb written without via make it a collective.",
        "bucket_mb": "Collective only: the size of one broadcast bucket in MB. Default 128.",
        "delta": "Collective only: send per tensor only the elements that changed since the "
                 "version the receiver holds (nothing for an unchanged tensor). Default false.",
    },
}

# the top-level keys that are sections, and what each holds
SECTION_OF = {"models": ("named", "model"), "data": ("named", "data source"),
              "pools": ("named", "pool"), "step": ("one", "step"), "tasks": ("named", "task"),
              "sync": ("list", "sync edge"), "eval": ("one", "eval")}
_DEF = {"model": "model", "data source": "data_source", "pool": "pool", "step": "step",
        "task": "task", "sync edge": "sync_edge", "eval": "eval"}


# -- words for the kinds table (shared with docs/language.md) --------------------------------------
def slot_text(s: kinds.Slot) -> str:
    """``prompt (any, optional; from data|custom)``."""
    flags = [s.type] + ["optional"] * s.optional + ["many"] * s.many
    return f"{s.role} ({', '.join(flags)}; from {'|'.join(s.accepts)})"


def outputs_text(sig: kinds.Signature) -> str:
    """The roles a signature writes, by position."""
    typed = lambda r: f"{r} ({kinds.ROLES[r].type})"  # noqa: E731
    if sig.more_outputs and set(sig.outputs) <= {sig.more_outputs}:
        return f"{typed(sig.more_outputs)} for every output"
    outs = [typed(r) for r in sig.outputs]
    if sig.more_outputs:
        outs.append(f"then {typed(sig.more_outputs)} for each further output")
    return ", ".join(outs) or "no fields"


def signature_text(sig: kinds.Signature) -> str:
    """One line: the roles read and written."""
    reads = ("its inputs, passed to fn in the declared order" if sig.inputs is None
             else "; ".join(slot_text(s) for s in sig.inputs))
    return f"reads {reads}; writes {outputs_text(sig)}"


def kind_variants(name: str) -> dict[str, kinds.Signature]:
    """A kind's signature, and the variants :func:`kinds.signature` gives in special cases."""
    base = kinds.signature(name)
    out = {"": base} if base else {}
    for when, kw in (("with env", {"env": True}),
                     ("on a model a train task updates", {"trained": True})):
        sig = kinds.signature(name, **kw)
        if base and sig != base:
            out[when] = sig
    return out


def kind_text(name: str) -> str:
    """One line on a task kind: what it does, its keys, what it reads and writes."""
    k = kinds.KINDS[name]
    text = f"{name}: {k.doc}; needs {', '.join(k.needs)}"
    if k.takes:
        text += f", may take {', '.join(k.takes)}"
    variants = kind_variants(name)
    if not variants:
        what = "estimator" if name == "advantage" else "loss"
        return f"{text}; reads and writes the roles of its {what}."
    base = variants.pop("")
    text += f"; {signature_text(base)}"
    for when, sig in variants.items():
        same = sig.inputs == base.inputs
        text += f"; {when}: {'writes ' + outputs_text(sig) if same else signature_text(sig)}"
    return text + "."


def estimator_text(name: str) -> str:
    """One line on an advantage estimator and its signature."""
    e = kinds.ESTIMATORS[name]
    return f"{name}: {e.doc} (sees a {e.scope} at once); {signature_text(e.signature)}."


def loss_text(name: str) -> str:
    """One line on a loss and its signature."""
    info = kinds.LOSSES[name]
    return f"{name}: {info.doc}; {signature_text(info.signature)}."


# -- the schema ----------------------------------------------------------------------------------
def _value(spec: build.Key, doc: str) -> dict[str, Any]:
    """The schema of one key's value, from its builder spec."""
    t = spec.type
    if t in ("name", "ref", "names"):
        s: dict[str, Any] = {"$ref": f"#/$defs/{t}"}
    elif t == "choice":
        s = {"enum": list(spec.choices)}
    else:
        s = {"type": {"str": "string", "int": "integer", "num": "number", "bool": "boolean",
                      "map": "object"}[t]}
    if spec.min is not None:
        s["minimum"] = int(spec.min) if t == "int" else spec.min
    s["description"] = doc
    if spec.default is not None and not (t == "names" and not spec.default):
        s["default"] = list(spec.default) if isinstance(spec.default, tuple) else spec.default
    return s


def _section(what: str) -> dict[str, Any]:
    """An object with exactly the keys of one builder table (which rejects any other)."""
    table, docs = build.SECTIONS[what], KEY_DOCS[what]
    s: dict[str, Any] = {"type": "object", "additionalProperties": False,
                         "properties": {k: _value(spec, docs[k]) for k, spec in table.items()}}
    required = [k for k, spec in table.items() if spec.required]
    if required:
        s["required"] = required
    return s


def _task() -> dict[str, Any]:
    """The task section, with what each kind needs and may not have."""
    s = _section("task")
    props = s["properties"]
    props["kind"] = {"enum": list(kinds.TASK_KINDS),
                     "description": props["kind"]["description"] + "\n" +
                     "\n".join(kind_text(k) for k in kinds.TASK_KINDS)}
    props["engine"]["examples"] = list(BUILTIN)
    for key, table, text in (("estimator", kinds.ESTIMATORS, estimator_text),
                             ("loss", kinds.LOSSES, loss_text)):
        props[key] = {"enum": list(table), "description": props[key]["description"] + "\n" +
                      "\n".join(text(n) for n in table)}
    for key, spec in kinds.SCHED.items():  # the default where a kind takes the key
        if spec.default is not None:
            props[key]["default"] = spec.default
    rules = []
    for name, k in kinds.KINDS.items():
        then: dict[str, Any] = {
            "description": kind_text(name),
            "required": list(k.needs) + ["outputs"] * k.needs_outputs,
            "properties": {key: False for key in kinds.REF_KEYS + kinds.SCHED_KEYS
                           if key not in k.needs + k.takes}}
        if k.needs_outputs:
            then["properties"]["outputs"] = {"minItems": 1}
        rules.append({"if": {"properties": {"kind": {"const": name}}, "required": ["kind"]},
                      "then": then})
    props["args"] = _args_property(props["args"]["description"])
    s["allOf"] = rules + _args_rules()
    return s


# -- task args (asyncflow.argtable) ----------------------------------------------------------------
_ARG_JSON = {"int": {"type": "integer"}, "num": {"type": "number"}, "bool": {"type": "boolean"},
             "str": {"type": "string"}, "list": {"type": "array"}, "dict": {"type": "object"},
             "int|dist": {"anyOf": [{"type": "integer"}, {"type": "object"}]},
             "num|dist": {"anyOf": [{"type": "number"}, {"type": "object"}]}}


def _arg(a: argtable.Arg, who: str) -> dict[str, Any]:
    """The schema of one declared arg: its type, bounds and doc (said by its owner)."""
    s: dict[str, Any] = ({"enum": list(a.choices)} if a.type == "choice"
                         else dict(_ARG_JSON[a.type]))
    if a.min is not None or a.max is not None:
        bounds: dict[str, Any] = {}
        if a.min is not None:
            bounds["exclusiveMinimum" if a.strict else "minimum"] = a.min
        if a.max is not None:
            bounds["maximum"] = a.max
        if "anyOf" in s:
            s["anyOf"][0].update(bounds)
        else:
            s.update(bounds)
    if a.nullable:
        s = {"anyOf": [s, {"type": "null"}]}
    kinds_ = f" ({', '.join(a.kinds)} tasks)" if a.kinds else ""
    s["description"] = f"{who}{kinds_}: {a.doc}."
    if a.default is not None:
        s["default"] = a.default
    return s


def _args_rules() -> list[dict[str, Any]]:
    """One rule per built-in engine, loss and estimator: the args it declares, with their types
    and docs, for editors. Not closed (additionalProperties stays open): a task's args also go
    to its fn or env, and which owners a task has depends on several keys at once; `asyncflow
    check` reports unknown args (AF210)."""
    rules = []
    for key, table, what in (("engine", argtable.ENGINE_ARGS, "engine"),
                             ("loss", argtable.LOSS_ARGS, "loss"),
                             ("estimator", argtable.ESTIMATOR_ARGS, "estimator")):
        for name, args in table.items():
            if not args:
                continue
            rules.append({"if": {"properties": {key: {"const": name}}, "required": [key]},
                          "then": {"properties": {"args": {"properties": {
                              a.name: _arg(a, f"the {name} {what}'s") for a in args}}}}})
    return rules


def _args_property(doc: str) -> dict[str, Any]:
    """``args``: a mapping; the compiler's own args by name (every engine's, loss's and
    estimator's come in through :func:`_args_rules`)."""
    names = sorted({a.name for t in (*argtable.ENGINE_ARGS.values(), *argtable.LOSS_ARGS.values(),
                                     *argtable.ESTIMATOR_ARGS.values()) for a in t})
    return {"type": "object", "description": doc + " Declared args (docs/language.md, 'Args'): "
            + ", ".join(names) + "; and the keywords a fn or env takes.",
            "properties": {a.name: _arg(a, "the compiler's") for a in argtable.GENERIC_ARGS}}


def _top_key(key: str, spec: build.Key) -> dict[str, Any]:
    doc = KEY_DOCS["pipeline"][key]
    if key not in SECTION_OF:
        return _value(spec, doc)
    shape, what = SECTION_OF[key]
    ref = {"$ref": f"#/$defs/{_DEF[what]}"}
    if shape == "one":
        return {**ref, "description": doc}
    if shape == "list":
        return {"type": "array", "items": ref, "description": doc}
    return {"type": "object", "propertyNames": {"$ref": "#/$defs/name"},
            "additionalProperties": ref, "description": doc}


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a YAML pipeline file."""
    defs: dict[str, Any] = {
        "name": {"type": "string", "pattern": build.NAME_RE.pattern,
                 "description": "A name: letters, digits and _, not starting with a digit."},
        "ref": {"type": "string", "pattern": build.REF_RE.pattern,
                "description": 'A "module:function" reference (an importable module, a '
                               "top-level function or class)."},
        "names": {"type": "array", "items": {"$ref": "#/$defs/name"}, "uniqueItems": True,
                  "description": "A list of distinct names."},
    }
    for what, key in _DEF.items():
        defs[key] = _task() if what == "task" else _section(what)
    return {
        "$schema": DRAFT,
        "title": "asyncflow pipeline",
        "description": "An asyncflow RL post-training pipeline (YAML). Generated by `asyncflow "
                       "schema`; the reference is docs/language.md.",
        "type": "object",
        "additionalProperties": False,
        "properties": {k: _top_key(k, spec) for k, spec in build.TOP.items()},
        "required": [k for k, spec in build.TOP.items() if spec.required],
        "$defs": defs,
    }
