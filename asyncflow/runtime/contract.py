"""What a task returns, checked against its signature (the kinds table) before it is written.

A user function or an engine that omits a declared output, returns the wrong number of rows, or a
value that does not fit its role's type (a string where a reward is needed, NaN anywhere a
number is needed) stops the run with a located AF6xx error naming the task, its ``file:line``
and the first bad row -- never a hang, and never a run that trains on NaN.

=======  ==================================================================================
code     raised when
=======  ==================================================================================
AF610    a user function (``fn:`` of a reward, filter or custom task; an environment) raised
AF611    an output is missing or has the wrong number of rows
AF612    a value does not fit its role's type, or is not finite
=======  ==================================================================================
"""
from __future__ import annotations

import math
from numbers import Real
from typing import Any, Sequence

from asyncflow.errors import TaskError  # defined there: engines raise it too




def _num(v: Any) -> bool:
    return isinstance(v, Real) or (hasattr(v, "item") and isinstance(getattr(v, "item")(), Real))


def problem(value: Any, type_: str) -> str | None:
    """Why ``value`` does not fit a column of type ``type_`` (None when it does)."""
    if type_ in ("any", "data"):
        return None
    if type_ == "text":
        return None if isinstance(value, str) else f"{_show(value)} where text is needed"
    if type_ == "flag":
        return None if isinstance(value, (bool, int)) or _num(value) else \
            f"{_show(value)} where a keep flag (bool) is needed"
    if type_ in ("float", "adv") and not isinstance(value, (str, bytes)) and _num(value):
        return None if math.isfinite(float(value)) else f"{_show(value)}, not a finite number"
    if type_ in ("token_floats", "adv"):
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            return f"{_show(value)} where per-token floats are needed"
        try:
            if math.isfinite(float(sum(value))):
                return None
        except (TypeError, ValueError, OverflowError):
            pass
        bad = next((x for x in value if not _num(x) or not math.isfinite(float(x))), None)
        return f"{_show(bad)} among its per-token values" + (
            "" if bad is None or not _num(bad) else ", not a finite number")
    return f"{_show(value)} where one float per sample is needed"


def _show(v: Any) -> str:
    s = repr(v)
    return (s[:40] + "...") if len(s) > 43 else s


def check_outputs(task, cols: dict, fields: Sequence[tuple[str, str]], rows: Sequence[int]) -> None:
    """Raise :class:`TaskError` when ``cols`` (field -> values) does not hold, for each declared
    output ``(field, type)``, one fitting value per row of ``rows``."""
    n = len(rows)
    for f, type_ in fields:
        col = cols.get(f)
        if col is None:
            raise TaskError("AF611", task, field=f, problem="returned no values", row=rows[0] if n else 0)
        if len(col) != n:
            raise TaskError("AF611", task, field=f, problem=f"returned {len(col)} values for {n} rows",
                            row=rows[0] if n else 0)
        for r, v in zip(rows, col):
            if v is None and type_ not in ("any", "data"):  # an engine that left a row out
                raise TaskError("AF611", task, field=f, problem="returned no value", row=r)
            why = problem(v, type_)
            if why is not None:
                raise TaskError("AF612", task, field=f, problem=why, row=r)
