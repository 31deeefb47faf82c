"""Located tree -> typed AST, driven by one schema table per section.

Checks here are *local*: unknown keys (with a did-you-mean), value types, missing keys, names,
choices and ranges. Cross-references (does ``model: policy`` exist?) are the rules' job
(:mod:`asyncflow.dsl.rules`). Errors are collected, not raised one by one, so a file's
independent errors are all reported at once.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from asyncflow.diagnostics import Diagnostics, did_you_mean
from asyncflow.dsl import ast
from asyncflow.dsl.loc import SourceLoc
from asyncflow.dsl.tree import Map, Node, Scalar, Seq, plain, type_name
from asyncflow.kinds import SCHED, TASK_KINDS

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
REF_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclass(frozen=True)
class Key:
    """One key of a section: its type, whether it is required, its default."""

    type: str  # name | str | ref | int | num | bool | names | map | choice
    required: bool = False
    default: Any = None
    choices: tuple[str, ...] = ()
    min: float | None = None
    attr: str | None = None  # AST attribute, when it differs from the key


MODEL = {
    "init": Key("str"), "args": Key("map", default={}), "copy_of": Key("name"),
    "frozen": Key("bool", default=False),
    # the weights' dtype (asyncflow.modelsrc.DTYPES); unset: the copied model's, else float32
    "dtype": Key("choice", choices=("float32", "bfloat16", "float16")),
    # a LoRA adapter the trainer trains instead of the weights (asyncflow.lora: keys, defaults)
    "lora": Key("map"),
    # run the code a checkpoint ships (config.json auto_map); unset: the copied model's, else no
    "trust_remote_code": Key("bool"),
    # parameters a weight sync moves (asyncflow simulate's transfer cost; unset: from an HF
    # checkpoint's files, else unknown and the sync costs nothing there)
    "params": Key("num", min=1),
}
DATA = {
    "source": Key("str", required=True), "args": Key("map", default={}),
    "fields": Key("names", required=True),
    "epochs": Key("int", min=1),  # passes over the data the run may make (default: as needed, warned)
    "split": Key("str"),  # a data set directory's or hub data set's split (default: its only one)
}
POOL = {"devices": Key("int", required=True, min=1), "resources": Key("map", default={}),
        "share_process": Key("bool", default=True)}
STEP = {
    "prompts_per_step": Key("int", required=True, min=1),
    "samples_per_prompt": Key("int", default=1, min=1),
    "steps": Key("int", required=True, min=1),
}
TASK = {
    "kind": Key("choice", required=True, choices=TASK_KINDS),
    "engine": Key("name"), "model": Key("name"), "pool": Key("name"),
    "replicas": Key("int", default=1, min=1), "devices_per_replica": Key("int", default=1, min=1),
    "inputs": Key("names", default=()), "outputs": Key("names", default=()),
    "keep": Key("names", default=()),
    "fn": Key("ref"), "batched": Key("bool", default=False),
    "estimator": Key("name"), "loss": Key("name"), "env": Key("ref"),
    # scheduling keys: types and values from asyncflow.kinds.SCHED; unset is None (the compiler
    # fills in the kind's default), so `fmt` keeps exactly what was written
    **{k: Key(s.type, choices=s.choices, min=s.min) for k, s in SCHED.items()},
    "args": Key("map", default={}), "cost": Key("map", default={}),
}
SYNC = {
    "from": Key("name", required=True, attr="src"), "to": Key("name", required=True, attr="dst"),
    "max_staleness": Key("int", required=True, min=0),
    # how the weights travel (asyncflow.runtime.collective): unset is resolved by the compiler
    "via": Key("choice", choices=("collective", "store")),
    "bucket_mb": Key("num", min=0.001), "delta": Key("bool", default=False),
}
# evaluation during training (docs/language.md, "Evaluation"): cross-references are AF384-AF389
EVAL = {
    "data": Key("name", required=True), "every": Key("int", min=1),
    "rollout": Key("name"), "metric": Key("name"), "fn": Key("ref"),
    "inputs": Key("names", default=()), "name": Key("name"),
    "greedy": Key("bool", default=True), "temperature": Key("num", min=0),
    "samples_per_prompt": Key("int", default=1, min=1), "max_prompts": Key("int", min=1),
    "args": Key("map", default={}),
}
TOP = {
    "pipeline": Key("name", required=True, attr="name"), "description": Key("str", default=""),
    "seed": Key("int", default=0, min=0),
    "models": Key("section"), "data": Key("section"), "pools": Key("section"),
    "step": Key("section", required=True), "tasks": Key("section", required=True),
    "eval": Key("section"), "sync": Key("section"),
}
# the schema of every section, by the name users see in messages
SECTIONS = {"model": MODEL, "data source": DATA, "pool": POOL, "step": STEP, "task": TASK,
            "sync edge": SYNC, "eval": EVAL, "pipeline": TOP}

_EXPECTED = {
    "name": "a name (letters, digits, _)", "str": "a string", "ref": 'a "module:function" reference',
    "int": "an integer", "num": "a number", "bool": "true or false",
    "names": "a list of names", "map": "a mapping", "choice": "one of {choices}",
}


def _finite(v: int | float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


class Builder:
    def __init__(self, diags: Diagnostics):
        self.d = diags

    # -- values ---------------------------------------------------------------------------
    def value(self, key: str, spec: Key, node: Node, locs: dict[str, SourceLoc], path: str) -> Any:
        """The checked value of ``key``, or ``spec.default`` after reporting an error."""
        locs[path] = node.loc
        t = spec.type
        bad = lambda: self.d.add("AF202", node.loc, key=key, got=type_name(node),  # noqa: E731
                                 expected=_EXPECTED[t].format(choices=", ".join(spec.choices)))
        if t == "map":
            if not isinstance(node, Map):
                bad()
                return spec.default
            for k, e in node.entries.items():
                locs[f"{path}.{k}"] = e.value.loc
            return plain(node)
        if t == "names":
            if not isinstance(node, Seq):
                bad()
                return tuple(spec.default or ())
            out: list[str] = []
            for i, item in enumerate(node.items):
                locs[f"{path}.{i}"] = item.loc
                if not isinstance(item, Scalar) or not isinstance(item.value, str):
                    self.d.add("AF202", item.loc, key=f"{key}[{i}]", got=type_name(item),
                               expected=_EXPECTED["name"])
                elif not NAME_RE.match(item.value):
                    self.d.add("AF204", item.loc, value=item.value)
                elif item.value in out:
                    self.d.add("AF208", item.loc, value=item.value, key=key)
                else:
                    out.append(item.value)
            return tuple(out)
        if not isinstance(node, Scalar):
            bad()
            return spec.default
        v = node.value
        if t in ("name", "str", "ref", "choice"):
            if not isinstance(v, str):
                bad()
                return spec.default
            if t == "name" and not NAME_RE.match(v):
                self.d.add("AF204", node.loc, value=v)
                return spec.default
            if t == "ref" and not REF_RE.match(v):
                self.d.add("AF207", node.loc, value=v, key=key)
                return spec.default
            if t == "choice" and v not in spec.choices:
                self.d.add("AF205", node.loc, did_you_mean(v, spec.choices), value=v, key=key,
                           choices=", ".join(spec.choices))
                return spec.default
            return v
        if t == "bool":
            if not isinstance(v, bool):
                bad()
                return spec.default
            return v
        if t in ("int", "num"):
            ok = isinstance(v, int) and not isinstance(v, bool)
            if t == "num":
                ok = ok or isinstance(v, float)
            if not ok:
                bad()
                return spec.default
            if t == "num" and not _finite(v):
                bound = "a finite number" + (f" >= {spec.min:g}" if spec.min is not None else "")
                self.d.add("AF206", node.loc, key=key, value=v, bound=bound)
                return spec.default
            if spec.min is not None and v < spec.min:
                self.d.add("AF206", node.loc, key=key, value=v, bound=f">= {spec.min:g}")
                return spec.default
            return v
        raise AssertionError(t)

    def fields(self, what: str, schema: dict[str, Key], node: Node, owner: SourceLoc,
               skip: tuple[str, ...] = ()) -> tuple[dict[str, Any], dict[str, SourceLoc]] | None:
        """Check one section's mapping: its keys and their values."""
        if not isinstance(node, Map):
            self.d.add("AF209", node.loc, what=what, got=type_name(node))
            return None
        out: dict[str, Any] = {}
        locs: dict[str, SourceLoc] = {}
        for k, e in node.entries.items():
            if k in skip:
                continue
            spec = schema.get(k)
            if spec is None:
                self.d.add("AF201", e.key_loc, did_you_mean(k, schema), key=k, where=what)
                continue
            out[spec.attr or k] = self.value(k, spec, e.value, locs, spec.attr or k)
        for k, spec in schema.items():
            if k in skip or k in node.entries:
                continue
            if spec.required:
                self.d.add("AF203", owner, key=k, where=what)
            # a missing list is an empty one, so later stages never meet None
            out[spec.attr or k] = () if spec.type == "names" else spec.default
        return out, locs

    def named(self, what: str, node: Node | None, make: Callable[[str, Node, SourceLoc], Any]) -> dict:
        """A section of named entries (models, data, pools, tasks)."""
        if node is None:
            return {}
        if not isinstance(node, Map):
            self.d.add("AF209", node.loc, what=f"the {what}s section", got=type_name(node))
            return {}
        out = {}
        for name, e in node.entries.items():
            if not NAME_RE.match(name):
                self.d.add("AF204", e.key_loc, value=name)
                continue
            item = make(name, e.value, e.key_loc)
            if item is not None:
                out[name] = item
        return out

    # -- sections -------------------------------------------------------------------------
    def model(self, name: str, node: Node, kloc: SourceLoc):
        r = self.fields(f"model '{name}'", MODEL, node, kloc)
        return r and ast.ModelDef(name=name, **r[0], loc=kloc, locs=r[1])

    def data(self, name: str, node: Node, kloc: SourceLoc):
        r = self.fields(f"data source '{name}'", DATA, node, kloc)
        return r and ast.DataDef(name=name, **r[0], loc=kloc, locs=r[1])

    def pool(self, name: str, node: Node, kloc: SourceLoc):
        r = self.fields(f"pool '{name}'", POOL, node, kloc)
        return r and ast.PoolDef(name=name, **r[0], loc=kloc, locs=r[1])

    def task(self, name: str, node: Node, kloc: SourceLoc):
        r = self.fields(f"task '{name}'", TASK, node, kloc)
        if not r:
            return None
        vals = r[0]
        if vals["kind"] is None:
            return None
        return ast.TaskDef(name=name, **vals, loc=kloc, locs=r[1])

    def step(self, node: Node, kloc: SourceLoc):
        r = self.fields("step", STEP, node, kloc)
        if not r:
            return None
        v = r[0]
        if v["prompts_per_step"] is None or v["steps"] is None:
            return None
        return ast.StepDef(**v, loc=kloc, locs=r[1])

    def eval(self, node: Node, kloc: SourceLoc) -> ast.EvalDef | None:
        r = self.fields("eval", EVAL, node, kloc)
        if not r or r[0]["data"] is None:
            return None
        return ast.EvalDef(**r[0], loc=kloc, locs=r[1])

    def sync(self, node: Node | None) -> tuple[ast.SyncDef, ...]:
        if node is None:
            return ()
        if not isinstance(node, Seq):
            self.d.add("AF209", node.loc, what="the sync section (a list)", got=type_name(node))
            return ()
        out = []
        for i, item in enumerate(node.items):
            r = self.fields(f"sync edge {i}", SYNC, item, item.loc)
            if r and None not in (r[0]["src"], r[0]["dst"], r[0]["max_staleness"]):
                out.append(ast.SyncDef(**r[0], loc=item.loc, locs=r[1]))
        return tuple(out)

    def pipeline(self, root: Node, path: str) -> ast.Pipeline | None:
        top = self.fields("the pipeline", TOP, root, SourceLoc(path, 1, 1),
                          skip=("models", "data", "pools", "step", "tasks", "sync", "eval"))
        if top is None:
            return None
        assert isinstance(root, Map)
        vals, locs = top
        for k in ("step", "tasks"):
            if k not in root.entries:
                self.d.add("AF203", SourceLoc(path, 1, 1), key=k, where="the pipeline")
        for k in ("models", "data", "pools", "step", "tasks", "sync", "eval"):
            if k in root.entries:
                locs[k] = root.entries[k].key_loc
        models = self.named("model", root.get("models"), self.model)
        data = self.named("data source", root.get("data"), self.data)
        pools = self.named("pool", root.get("pools"), self.pool)
        tasks = self.named("task", root.get("tasks"), self.task)
        step_node = root.entries.get("step")
        step = self.step(step_node.value, step_node.key_loc) if step_node else None
        sync = self.sync(root.get("sync"))
        eval_node = root.entries.get("eval")
        evaluation = self.eval(eval_node.value, eval_node.key_loc) if eval_node else None
        if vals.get("name") is None or step is None or "tasks" not in root.entries:
            return None
        return ast.Pipeline(models=models, data=data, pools=pools, tasks=tasks, step=step,
                            sync=sync, eval=evaluation, loc=SourceLoc(path, 1, 1), locs=locs,
                            path=path, **vals)


def build(root: Node, path: str, diags: Diagnostics) -> ast.Pipeline | None:
    return Builder(diags).pipeline(root, path)
