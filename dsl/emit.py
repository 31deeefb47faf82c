"""AST -> canonical plain data -> canonical YAML text (``asyncflow fmt --to yaml``).

``to_plain`` gives the pipeline as ordered plain data with defaults left out; both emitters
(YAML here, .af in :mod:`asyncflow.dsl.af_emit`) print that, so ``parse(fmt(x)) == parse(x)``.
"""
from __future__ import annotations

from typing import Any

import yaml

from asyncflow.dsl import ast
from asyncflow.dsl.build import DATA, EVAL, MODEL, POOL, STEP, SYNC, TASK, TOP, Key


def _section(obj: Any, schema: dict[str, Key]) -> dict:
    out: dict = {}
    for key, spec in schema.items():
        if spec.type == "section":
            continue
        v = getattr(obj, spec.attr or key)
        if isinstance(v, tuple):
            v = list(v)
        default = list(spec.default) if isinstance(spec.default, tuple) else spec.default
        if v is None or (not spec.required and v == default):
            continue
        out[key] = v
    return out


def to_plain(p: ast.Pipeline) -> dict:
    out = _section(p, TOP)
    if p.models:
        out["models"] = {n: _section(m, MODEL) for n, m in p.models.items()}
    if p.data:
        out["data"] = {n: _section(d, DATA) for n, d in p.data.items()}
    if p.pools:
        out["pools"] = {n: _section(x, POOL) for n, x in p.pools.items()}
    out["step"] = _section(p.step, STEP)
    out["tasks"] = {n: _section(t, TASK) for n, t in p.tasks.items()}
    if p.eval is not None:
        out["eval"] = _section(p.eval, EVAL)
    if p.sync:
        out["sync"] = [_section(s, SYNC) for s in p.sync]
    return out


def scalar(v: Any) -> str:
    """One value in YAML flow syntax."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{scalar(k)}: {scalar(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(scalar(x) for x in v) + "]"
    text = yaml.safe_dump(v, default_flow_style=True, width=10**9, allow_unicode=True).strip()
    if text.endswith("\n..."):
        text = text[:-4].strip()
    elif text.endswith("..."):
        text = text[:-3].strip()
    return text


def emit_yaml(p: ast.Pipeline) -> str:
    d = to_plain(p)
    lines: list[str] = []
    for key, value in d.items():
        if key in ("models", "data", "pools", "tasks"):
            lines.append(f"{key}:")
            for name, body in value.items():
                if key == "pools":
                    lines.append(f"  {name}: {scalar(body)}")
                    continue
                lines.append(f"  {name}:")
                for k, v in body.items():
                    lines.append(f"    {k}: {scalar(v)}")
        elif key in ("step", "eval"):
            lines.append(f"{key}:")
            lines.extend(f"  {k}: {scalar(v)}" for k, v in value.items())
        elif key == "sync":
            lines.append("sync:")
            lines.extend(f"  - {scalar(s)}" for s in value)
        else:
            lines.append(f"{key}: {scalar(value)}")
        if key in ("description", "models", "data", "pools", "step", "tasks", "eval") or key == "seed":
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"
