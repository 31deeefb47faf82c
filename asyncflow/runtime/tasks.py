"""Running the tasks that are functions, not engines: reward, advantage, filter, custom.

Every runner maps a column batch (the task's inputs plus ``_row``/``_group``/``_version``) to
``(outputs, keep)``: ``outputs`` the columns the task declared, one value per row; ``keep`` a
``list[bool]`` for filters (rows marked False are dropped from the store) or None.

- ``reward`` / ``custom``: ``fn`` ("module:function") is called once per row with the input
  fields as keyword arguments, or -- with ``batched: true`` -- once per batch with the column
  dict. The task's ``args`` are passed as keyword arguments the function accepts. A row call
  returns one value (one output) or a tuple/dict (several); a batched call returns a list, or a
  dict of columns.
- ``advantage``: :func:`asyncflow.algos.advantages.estimate_columns` with the estimator name,
  the ``reward`` column (or the first input), ``_group``, ``values`` / ``kl`` when they are
  inputs, and the task's ``args`` as the estimator's settings.
- ``filter``: ``fn`` called batched on whole groups (``asyncflow/filters.py`` convention) returns
  one bool per row; each declared output is written as the keep flag of the rows kept.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable

Columns = dict[str, list]


@functools.lru_cache(maxsize=None)
def resolve(target: str) -> Callable:
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _accepted(fn: Callable, args: dict) -> dict:
    """The ``args`` that ``fn`` accepts as keywords (all of them if it takes ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return dict(args)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(args)
    return {k: v for k, v in args.items() if k in params}


def _n(batch: Columns) -> int:
    return len(batch.get("_row") or next(iter(batch.values()), []))


def _to_columns(result: Any, outputs: list[str], n: int, what: str) -> Columns:
    if isinstance(result, dict):
        missing = [o for o in outputs if o not in result]
        if missing:
            raise ValueError(f"{what} returned no column {missing[0]!r}")
        cols = {o: list(result[o]) for o in outputs}
    elif len(outputs) == 1:
        cols = {outputs[0]: list(result)}
    else:
        raise ValueError(f"{what} must return a dict of columns for its outputs {outputs}")
    for o, col in cols.items():
        if len(col) != n:
            raise ValueError(f"{what} returned {len(col)} values of {o!r} for {n} rows")
    return cols


class FnRunner:
    """reward / custom: a user function over rows or batches."""

    def __init__(self, task):
        self.task = task
        self.fn = resolve(task.fn)
        self.kwargs = _accepted(self.fn, task.args or {})

    def __call__(self, batch: Columns) -> tuple[Columns, None]:
        t, n = self.task, _n(batch)
        what = f"{t.kind} task {t.name!r} ({t.fn})"
        if t.batched:
            return _to_columns(self.fn(batch, **self.kwargs), t.outputs, n, what), None
        cols: Columns = {o: [] for o in t.outputs}
        inputs = [f for f in t.inputs if f in batch]
        for i in range(n):
            out = self.fn(**{f: batch[f][i] for f in inputs}, **self.kwargs)
            if len(t.outputs) == 1:
                cols[t.outputs[0]].append(out)
            elif isinstance(out, dict):
                for o in t.outputs:
                    cols[o].append(out[o])
            else:
                for o, v in zip(t.outputs, out, strict=True):
                    cols[o].append(v)
        return cols, None


class AdvantageRunner:
    """advantage: one of asyncflow.algos' estimators over a batch of whole groups (or a step)."""

    def __init__(self, task):
        from asyncflow.algos import advantages

        self.task = task
        self.columns = advantages.estimate_columns

    def __call__(self, batch: Columns) -> tuple[Columns, None]:
        t = self.task
        reward = "reward" if "reward" in batch else next(
            (f for f in t.inputs if "reward" in f), t.inputs[0])
        values = batch.get("values")
        kl = batch.get("kl") if "kl" in t.inputs else None
        out = self.columns(t.estimator, batch[reward], batch["_group"], values, kl=kl,
                           **(t.args or {}))
        names = list(out)  # "advantages", then "returns" (gae)
        cols = {o: out[names[i]] for i, o in enumerate(t.outputs) if i < len(names)}
        return cols, None


class FilterRunner:
    """filter: keep flags over whole groups; dropped rows leave the store."""

    def __init__(self, task):
        self.task = task
        self.fn = resolve(task.fn)
        self.kwargs = _accepted(self.fn, task.args or {})

    def __call__(self, batch: Columns) -> tuple[Columns, list[bool]]:
        t, n = self.task, _n(batch)
        result = self.fn(batch, **self.kwargs)
        if isinstance(result, dict):
            keep = [bool(x) for x in result.get("keep", [True] * n)]
            cols = {o: list(result[o]) if o in result else list(keep) for o in t.outputs}
        else:
            keep = [bool(x) for x in result]
            cols = {o: list(keep) for o in t.outputs}
        if len(keep) != n:
            raise ValueError(f"filter {t.name!r} ({t.fn}) returned {len(keep)} flags for {n} rows")
        return cols, keep


RUNNERS = {"reward": FnRunner, "custom": FnRunner, "advantage": AdvantageRunner,
           "filter": FilterRunner}


def runner_for(task) -> Callable[[Columns], tuple[Columns, list[bool] | None]]:
    try:
        return RUNNERS[task.kind](task)
    except KeyError:
        raise ValueError(f"task {task.name!r} of kind {task.kind!r} needs an engine") from None
