"""Running the tasks that are functions, not engines: reward, advantage, filter, custom.

Every runner maps a column batch (the task's input *fields* plus ``_row``/``_group``/``_version``)
to ``(outputs, keep)``: ``outputs`` the columns of the task's declared output fields, one value
per row; ``keep`` a ``list[bool]`` for filters (rows marked False are dropped from the store) or
None. Fields are the user's labels: what each one means comes from the plan's bindings (the
compiler's ``bind`` pass), never from its name.

- ``reward`` / ``custom``: ``fn`` ("module:function") is called once per row with the inputs
  in the declared order, ``fn(*inputs, **args)``, or -- with ``batched: true`` -- once per batch
  with one column per input, in the declared order. The task's ``args`` are passed as the
  keywords the function accepts. A row call returns one value (one output) or a tuple (several,
  in the declared order); a batched call returns a list, or a tuple of lists.
- ``advantage``: :func:`asyncflow.algos.estimate_columns` with the estimator name, the column
  bound to the ``reward`` role, ``_group``, the column bound to ``values`` (gae), and the task's
  ``args`` as the estimator's settings; its columns go to the outputs bound to their roles.
- ``filter``: ``fn(*input columns, groups=<group of each row>, **args)`` on whole groups returns
  one bool per row; each declared output is written as the keep flag of the rows kept.

A user function that raises (or calls ``sys.exit``) is a located AF610 error.
"""
from __future__ import annotations

import traceback
from typing import Any, Callable, Sequence

from asyncflow.refs import accepted, call_params, resolve
from asyncflow.runtime.contract import TaskError

Columns = dict[str, list]


def _n(batch: Columns) -> int:
    return len(batch.get("_row") or next(iter(batch.values()), []))


def _user_call(task, fn: Callable, rows: Sequence[int], *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)``; what it raises becomes AF610 naming the task and its first row."""
    try:
        return fn(*args, **kwargs)
    except (Exception, SystemExit) as e:
        raise TaskError("AF610", task, fn=task.fn or task.env,
                        error=f"{e.__class__.__name__}: {e}",
                        row=rows[0] if rows else 0, tb=traceback.format_exc()) from None


def _columns(result: Any, outputs: list[str], task, rows) -> Columns:
    """A batched result -> one column per output (a list for one output, a tuple for several)."""
    try:
        if len(outputs) == 1 and not isinstance(result, (tuple, str, dict)):
            return {outputs[0]: list(result)}
        if isinstance(result, tuple) and len(result) == len(outputs):
            return {o: list(c) for o, c in zip(outputs, result)}
    except TypeError:
        pass
    raise TaskError("AF611", task, field=", ".join(outputs), row=rows[0] if rows else 0,
                    problem=f"returned {type(result).__name__}; a batched function returns a "
                            f"list, or a tuple of {len(outputs)} lists (one per output)")


class FnRunner:
    """reward / custom: a user function over rows or batches, inputs in the declared order."""

    def __init__(self, task, paths: Sequence[str] = ()):
        self.task = task
        self.fn = resolve(task.fn, paths)
        self.kwargs = accepted(self.fn, task.args or {})

    def __call__(self, batch: Columns) -> tuple[Columns, None]:
        t, n = self.task, _n(batch)
        rows = batch.get("_row") or list(range(n))
        ins = [batch[f] for f in t.inputs]
        if t.batched:
            return _columns(_user_call(t, self.fn, rows, *ins, **self.kwargs), t.outputs, t, rows), None
        cols: Columns = {o: [] for o in t.outputs}
        many = len(t.outputs) > 1
        for i in range(n):
            out = _user_call(t, self.fn, rows[i:i + 1], *(c[i] for c in ins), **self.kwargs)
            if not many:
                cols[t.outputs[0]].append(out)
                continue
            if not isinstance(out, (tuple, list)) or len(out) != len(t.outputs):
                raise TaskError("AF611", t, field=", ".join(t.outputs), row=rows[i],
                                problem=f"returned {out!r:.40}; with {len(t.outputs)} outputs a "
                                        f"function returns a tuple of {len(t.outputs)} values")
            for o, v in zip(t.outputs, out):
                cols[o].append(v)
        return cols, None


class AdvantageRunner:
    """advantage: one of asyncflow.algos' estimators over a batch of whole groups (or a step)."""

    def __init__(self, task, paths: Sequence[str] = ()):
        from asyncflow.algos import estimate_columns
        # import the estimators while the workers start, not on the first call (step 0). They
        # compute with numpy and no longer import torch (which added 1.4 s locally to 3-5 s in
        # a fresh Ray process), so this is now cheap; kept so step 0 pays no import at all
        import asyncflow.algos.advantages  # noqa: F401

        self.task = task
        self.columns = estimate_columns
        self.field = {role: f for f, role in task.bind_in}  # role -> field
        self.out = [(f, role) for f, role in task.bind_out]

    def __call__(self, batch: Columns) -> tuple[Columns, None]:
        t = self.task
        values = batch[self.field["values"]] if "values" in self.field else None
        out = self.columns(t.estimator, batch[self.field["reward"]], batch["_group"], values,
                           **(t.args or {}))
        return {f: out[role] for f, role in self.out}, None


class FilterRunner:
    """filter: keep flags over whole groups; dropped rows leave the store."""

    def __init__(self, task, paths: Sequence[str] = ()):
        self.task = task
        self.fn = resolve(task.fn, paths)
        self.kwargs = accepted(self.fn, task.args or {})
        params = call_params(self.fn)
        self.groups = params is None or params.accepts("groups")

    def __call__(self, batch: Columns) -> tuple[Columns, list[bool]]:
        t, n = self.task, _n(batch)
        rows = batch.get("_row") or list(range(n))
        kw = dict(self.kwargs)
        if self.groups:
            kw["groups"] = list(batch.get("_group") or [0] * n)
        result = _user_call(t, self.fn, rows, *(batch[f] for f in t.inputs), **kw)
        try:
            keep = [bool(x) for x in result]
        except TypeError:
            keep = []
        if len(keep) != n:
            raise TaskError("AF611", t, field="keep flags", row=rows[0] if rows else 0,
                            problem=f"returned {len(keep)} flags for {n} rows")
        return {o: list(keep) for o in t.outputs}, keep


# a kind's ``runner`` in the kinds table -> the class that runs it
RUNNERS = {"fn": FnRunner, "estimator": AdvantageRunner, "filter": FilterRunner}


def runner_for(task, paths: Sequence[str] = ()) -> Callable[[Columns], tuple[Columns, list[bool] | None]]:
    """The runner of a function task (its kind's ``runner`` in :mod:`asyncflow.kinds`)."""
    from asyncflow.kinds import KINDS

    return RUNNERS[KINDS[task.kind].runner](task, paths)
