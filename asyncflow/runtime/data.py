"""The prompts a run feeds: its data source read, checked, and measured against what it needs.

:func:`load_prompts` reads the plan's (first) data source: a data file is looked up as the
validate pass does (absolute, else beside the pipeline file, else in the working directory) and
read by :mod:`asyncflow.datasets`; a ``module:factory`` is imported from the run's search path
(:func:`asyncflow.refs.search_path`), as ``check`` finds it. Every problem is a user error
located in the pipeline at the data source (or in the data file, where the loader says where):

=======  ==================================================================================
code     when
=======  ==================================================================================
AF601    the file or factory cannot be read (a factory that raises anything included)
AF602    it gives no rows
AF603    a row lacks a declared field (located at that field in ``fields:``)
AF605    a declared field is null in some row (located at that field)
AF606    ``epochs: E`` is declared but E passes over the rows are fewer than the run needs
=======  ==================================================================================

A source with fewer prompts than ``steps x prompts_per_step`` is read again from the start
(an *epoch*); without an ``epochs:`` key that saying so, the run warns with the number of passes.
"""
from __future__ import annotations

import json
import math
import re
import sys
from typing import Callable

from asyncflow import refs
from asyncflow.plan import Plan


def load_prompts(plan: Plan, paths: list[str] | None = None,
                 warn: Callable[[str], None] | None = None) -> list[dict]:
    """The rows of the plan's (first) data source, restricted to its declared fields; see the
    module docstring for the errors. ``warn`` receives the epochs warning (default: stderr)."""
    from asyncflow import datasets
    from asyncflow.diagnostics import error
    from asyncflow.loc import SourceLoc, Sources

    if not plan.data:
        from asyncflow.runtime.driver import RunError

        raise RunError("the plan has no data source")
    src = plan.data[0]
    s = src.source
    locs = src.locs or {}
    here = SourceLoc.parse(locs.get("")) or SourceLoc(plan.source_file or "<plan>", 1, 1)
    at_source = SourceLoc.parse(locs.get("source")) or here
    if paths is None:
        paths = refs.search_path(plan.source_file or None)
    sources = Sources()  # the texts an error may quote: the pipeline file, the data file
    sources.add_file(here.file)

    def fail(code: str, loc, **fmt):
        return error(code, loc, sources=sources, name=src.name, source=s, **fmt)

    try:
        if s.endswith((".jsonl", ".json", ".parquet")):
            path = str(refs.find_file(s, paths) or s)
            if s.endswith(".jsonl"):
                rows = datasets.jsonl(path)
            elif s.endswith(".parquet"):
                rows = datasets.parquet(path)
            else:
                with open(path) as f:
                    rows = json.load(f)
        else:
            rows = list(refs.resolve(s, paths)(**(src.args or {})))
    except (OSError, ValueError, ImportError, TypeError) as e:
        reason = str(e)
        m = re.match(r"^(.+?):(\d+): (.*)$", reason)
        loc = at_source
        if m:  # the loader named the file and line: point there, with the line quoted
            loc = SourceLoc(m.group(1), int(m.group(2)), 1)
            sources.add_file(m.group(1))
            reason = m.group(3)
        raise fail("AF601", loc, reason=reason) from None
    except Exception as e:  # a factory's own bug is still the user's, located at the source
        raise fail("AF601", at_source, reason=f"{e.__class__.__name__}: {e}") from None
    if not rows:
        raise fail("AF602", at_source)
    fields = list(src.fields) or list(rows[0])
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise fail("AF601", at_source, reason=f"row {i} is {type(r).__name__}, not a mapping")
        for j, f in enumerate(fields):
            at = SourceLoc.parse(locs.get(f"fields.{j}")) or here
            if f not in r:
                raise fail("AF603", at, row=i, field=f)
            if r[f] is None:
                raise fail("AF605", at, row=i, field=f)
    _check_epochs(plan, src, len(rows), warn, fail)
    return [{f: r[f] for f in fields} for r in rows]


def _check_epochs(plan: Plan, src, n: int, warn, fail) -> None:
    from asyncflow.loc import SourceLoc

    need = plan.step.steps * plan.step.prompts_per_step
    if n >= need:
        return
    passes = math.ceil(need / n)
    if src.epochs is None:
        (warn or _stderr)(f"warning: data source '{src.name}' has {n:,} prompts; {plan.step.steps} "
                          f"steps x {plan.step.prompts_per_step} prompts need {need:,}: the run "
                          f"reads them {passes} times (say `epochs: {passes}` to silence this)")
    elif src.epochs * n < need:
        raise fail("AF606", SourceLoc.parse((src.locs or {}).get("epochs")), rows=n, epochs=src.epochs,
                   have=src.epochs * n, need=need, steps=plan.step.steps, pps=plan.step.prompts_per_step,
                   passes=passes)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)
