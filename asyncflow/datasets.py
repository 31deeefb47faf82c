"""Data sources: generated verifiable tasks and file loaders (pure Python; no torch).

A source is ``module:factory`` in a pipeline's ``data:``; the factory returns a list of row dicts
(one dict per prompt, e.g. ``{"prompt": "3+4=", "answer": "7"}``). Every generator is
deterministic in its ``seed``.
"""
from __future__ import annotations

import json
import random

DIGITS_TASKS = ("add", "copy", "reverse")


def digits(n: int = 10000, seed: int = 0, task: str = "add", max_operand: int = 4,
           length: int = 3) -> list[dict]:
    """``n`` short digit problems, each ``{"prompt", "answer"}``.

    - ``add`` (default): ``"3+4="`` -> ``"7"``, operands in ``0..max_operand``. With the default
      4 the answers are single digits 0..8: from random init, GRPO (32 prompts x 8 samples,
      lr 1e-3, exact-match reward) takes a 2-layer, hidden-64 decoder from 0.4% to
      ~50% exact in ~160 steps on a CPU (~40 s). ``max_operand=9`` (answers 0..18) learns
      several times slower.
    - ``copy``: ``"copy 417="`` -> ``"417"`` (``length`` digits).
    - ``reverse``: ``"rev 417="`` -> ``"714"``.
    """
    if task not in DIGITS_TASKS:
        raise ValueError(f"digits task must be one of {DIGITS_TASKS}, got {task!r}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        if task == "add":
            a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
            rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
        else:
            s = "".join(rng.choice("0123456789") for _ in range(length))
            if task == "copy":
                rows.append({"prompt": f"copy {s}=", "answer": s})
            else:
                rows.append({"prompt": f"rev {s}=", "answer": s[::-1]})
    return rows


_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun")
_THINGS = ("apples", "books", "coins", "pens", "shells", "stamps", "cards", "marbles")


def math_qa(n: int = 1000, seed: int = 0, max_value: int = 20) -> list[dict]:
    """``n`` one-step word problems with an integer answer, ``{"prompt", "answer"}``; the
    prompt asks for the answer as ``\\boxed{}`` (what :func:`asyncflow.rewards.math_answer_match`
    reads first)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
        a, b = rng.randint(1, max_value), rng.randint(1, max_value)
        kind = rng.randrange(4)
        if kind == 0:
            q, ans = f"{name} has {a} {thing} and gets {b} more. How many {thing} now?", a + b
        elif kind == 1:
            a, b = max(a, b), min(a, b)
            q, ans = f"{name} has {a} {thing} and gives away {b}. How many are left?", a - b
        elif kind == 2:
            q, ans = f"{name} buys {a} boxes of {b} {thing}. How many {thing} in total?", a * b
        else:
            q, ans = f"{a} friends share {a * b} {thing} equally. How many does each get?", b
        rows.append({"prompt": q + " Put the answer in \\boxed{}.", "answer": str(ans)})
    return rows


def jsonl(path: str, fields: list[str] | None = None) -> list[dict]:
    """Rows of a JSON-lines file (blank lines skipped); ``fields`` keeps only those keys and
    requires them on every row."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e.msg}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: a row must be a JSON object")
            rows.append(_select(row, fields, f"{path}:{lineno}"))
    return rows


def parquet(path: str, fields: list[str] | None = None) -> list[dict]:
    """Rows of a Parquet file (needs ``pyarrow``)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    table = pq.read_table(path, columns=list(fields) if fields else None)
    return [_select(r, fields, path) for r in table.to_pylist()]


def _select(row: dict, fields, where: str) -> dict:
    if not fields:
        return row
    missing = [f for f in fields if f not in row]
    if missing:
        raise ValueError(f"{where}: row has no field(s) {', '.join(missing)}")
    return {f: row[f] for f in fields}
