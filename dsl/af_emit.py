"""AST -> canonical .af text (``asyncflow fmt --to af``).

Printed from :func:`asyncflow.dsl.emit.to_plain` (ordered plain data, defaults left out), so
``parse(emit_af(p)) == p`` for every pipeline. Each statement takes one line when it fits in
:data:`WIDTH` columns; a longer one puts its ``{ ... }`` keys on their own lines. Values keep
their types: a string that would read as a number, a keyword or anything but a bare word is
quoted.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from asyncflow.dsl import ast
from asyncflow.dsl.emit import to_plain

WIDTH = 100
INDENT = "  "
KEYWORDS = frozenset({"pipeline", "seed", "model", "data", "pool", "step", "task", "sync", "copy",
                      "frozen", "true", "false", "null", "eval"})
_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
_REF = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$")
# characters that JSON leaves raw but that end a line for str.splitlines()
_LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


# -- values -------------------------------------------------------------------------------
def quote(s: str) -> str:
    text = json.dumps(s, ensure_ascii=False)
    for ch, esc in _LINE_BREAKS.items():
        text = text.replace(ch, esc)
    return text


def string(s: str) -> str:
    """A string value: bare when it reads back as the same string, quoted otherwise."""
    if (_WORD.fullmatch(s) and s not in KEYWORDS) or _REF.fullmatch(s):
        return s
    return quote(s)


def key(k: Any, top: bool = False) -> str:
    """A key; after ``step``/``sync`` (``top``) a keyword must be quoted."""
    k = str(k)
    if _WORD.fullmatch(k) and not (top and k in KEYWORDS):
        return k
    return quote(k)


def name(s: str) -> str:
    """A name in a statement's head (always a valid name in a built AST)."""
    return s if _WORD.fullmatch(s) else quote(s)


def number(v: int | float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return ".nan"
    if math.isinf(v):
        return ".inf" if v > 0 else "-.inf"
    text = repr(v)  # always has a '.' or an exponent: reads back as a float
    for digits in range(17):  # the shortest exact scientific form, when shorter: 1e-4, 3e-5
        mant, _, exp = f"{v:.{digits}e}".partition("e")
        sci = f"{mant}e{int(exp)}"
        if float(sci) == v:
            return sci if len(sci) < len(text) else text
    return text


def inline(v: Any) -> str:
    """``v`` on one line."""
    if isinstance(v, dict):
        return "{ " + " ".join(f"{key(k)}={inline(x)}" for k, x in v.items()) + " }" if v else "{}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(inline(x) for x in v) + "]"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return number(v)
    return string(str(v))


def block(v: Any, indent: str, used: int) -> str:
    """``v`` inline when it fits after ``used`` columns, else one item per line."""
    text = inline(v)
    if used + len(text) <= WIDTH or not isinstance(v, (dict, list, tuple)) or not v:
        return text
    inner = indent + INDENT
    if isinstance(v, dict):
        rows = [f"{inner}{key(k)}={block(x, inner, len(inner) + len(key(k)) + 1)}"
                for k, x in v.items()]
        return "{\n" + "\n".join(rows) + f"\n{indent}}}"
    rows = [f"{inner}{block(x, inner, len(inner))}," for x in v]
    return "[\n" + "\n".join(rows) + f"\n{indent}]"


def args(d: dict, indent: str, used: int) -> str:
    """``(k=v, ...)`` after a factory or a pool name."""
    text = "(" + ", ".join(f"{key(k)}={inline(x)}" for k, x in d.items()) + ")"
    if used + len(text) <= WIDTH:
        return text
    inner = indent + INDENT
    rows = [f"{inner}{key(k)}={block(x, inner, len(inner) + len(key(k)) + 1)}," for k, x in d.items()]
    return "(\n" + "\n".join(rows) + f"\n{indent})"


def pairs(d: dict, top: bool = False) -> list[str]:
    return [f"{key(k, top)}={inline(v)}" for k, v in d.items()]


# -- statements ---------------------------------------------------------------------------
def statement(head: str, body: dict) -> str:
    """``head { k=v ... }``: on one line when it fits, else scalars first, maps after."""
    if not body:
        return head
    one = f"{head} {{ {' '.join(pairs(body))} }}"
    if len(one) <= WIDTH and "\n" not in one:
        return one
    lines = [head + " {"]
    row = INDENT
    for k, v in body.items():
        if isinstance(v, dict) and v:
            continue
        item = f"{key(k)}={block(v, INDENT, len(row) + len(key(k)) + 1)}"
        if row.strip() and len(row) + 1 + len(item) > WIDTH:
            lines.append(row)
            row = INDENT
        row = f"{row} {item}" if row.strip() else row + item
    if row.strip():
        lines.append(row)
    for k, v in body.items():
        if isinstance(v, dict) and v:
            lines.append(f"{INDENT}{key(k)} {block(v, INDENT, len(INDENT) + len(key(k)) + 1)}")
    lines.append("}")
    return "\n".join(lines)


def names(items: list[str]) -> str:
    return ", ".join(name(x) for x in items)


def call(value: Any, a: dict | None, used: int) -> str:
    text = inline(value)
    return text + args(a, "", used + len(text)) if a else text


def model(n: str, m: dict) -> str:
    m = dict(m)
    head = f"model {name(n)}"
    if "init" in m:
        head += " = "
        head += call(m.pop("init"), m.pop("args", None), len(head))
    elif "copy_of" in m:
        head += f" = copy({name(m.pop('copy_of'))})" if isinstance(m["copy_of"], str) else ""
    if m.get("frozen") is True:
        del m["frozen"]
        head += " frozen"
    return statement(head, m)


def data(n: str, d: dict) -> str:
    d = dict(d)
    head = f"data {name(n)}"
    if "source" in d:
        head += " = "
        head += call(d.pop("source"), d.pop("args", None), len(head))
    if d.get("fields"):
        head += " -> " + names(d.pop("fields"))
    return statement(head, d)


def pool(n: str, p: dict) -> str:
    head = f"pool {name(n)}"
    return head + args(p, "", len(head)) if p else head


def task(n: str, t: dict) -> str:
    t = dict(t)
    head = f"task {name(n)}: {name(t.pop('kind'))}({names(t.pop('inputs', []))})"
    if t.get("outputs"):
        head += " -> " + names(t.pop("outputs"))
    return statement(head, t)


def sync(s: dict) -> str:
    s = dict(s)
    head = f"sync {name(s.pop('from'))} -> {name(s.pop('to'))}"
    return " ".join([head, *pairs(s, top=True)])


def emit_af(p: ast.Pipeline) -> str:
    d = to_plain(p)
    blocks: list[list[str]] = []
    first = f"pipeline {name(d['pipeline'])}"
    if d.get("description"):
        first += " " + quote(d["description"])
    top = [first]
    if "seed" in d:
        top.append(f"seed {number(d['seed'])}")
    blocks.append(top)
    blocks.append([model(n, m) for n, m in d.get("models", {}).items()])
    blocks.append([data(n, x) for n, x in d.get("data", {}).items()])
    blocks.append([pool(n, x) for n, x in d.get("pools", {}).items()])
    blocks.append([" ".join(["step", *pairs(d["step"], top=True)])])
    tasks: list[str] = []
    for n, t in d["tasks"].items():
        text = task(n, t)
        if "\n" in text and tasks and tasks[-1] != "":
            tasks.append("")  # a task written over several lines stands apart
        tasks.append(text)
        if "\n" in text:
            tasks.append("")
    while tasks and tasks[-1] == "":
        tasks.pop()
    blocks.append(tasks)
    if "eval" in d:  # `eval { data=test every=10 }`: braces, since `data` is a keyword
        blocks.append([statement("eval", d["eval"]) if d["eval"] else "eval {}"])
    blocks.append([sync(s) for s in d.get("sync", [])])
    return "\n\n".join("\n".join(b) for b in blocks if b) + "\n"
