"""The rows a run feeds: its data sources read, checked, and measured against what it needs.

:func:`load_rows` reads any named data source of the plan; :func:`load_prompts` reads the one the
training steps draw prompts from (the first source an ``eval:`` section does not name) and checks
that it has enough rows for the run. How a source is read is :mod:`asyncflow.datasets`' table: a
``module:factory`` is imported from the run's search path (:func:`asyncflow.refs.search_path`) as
``check`` finds it; a file or directory is looked up as the validate pass does (absolute, else
beside the pipeline file, else in the working directory); ``org/name[@revision]`` that is no such
directory is a hub data set (``split:`` picks a split). Rows come back as plain Python, so a chat
prompt (a list of ``{role, content}`` messages) reaches the tasks as written. Every problem is a
user error located in the pipeline at the data source (or in the data file, where the loader says
where):

=======  ==================================================================================
code     when
=======  ==================================================================================
AF601    the file, directory, hub data set or factory cannot be read (a factory that raises
         anything included; a hub data set not cached under ``HF_HUB_OFFLINE=1``)
AF602    it gives no rows
AF603    a row lacks a declared field (located at that field in ``fields:``)
AF605    a declared field is null in some row (located at that field)
AF606    ``epochs: E`` is declared but E passes over the rows are fewer than the run needs
AF607    ``split:`` names a split the source does not have, or it has several and none is named
         (located at ``split:``, else at the source)
=======  ==================================================================================

A source with fewer prompts than ``steps x prompts_per_step`` is read again from the start
(an *epoch*); without an ``epochs:`` key that saying so, the run warns with the number of passes.
"""
from __future__ import annotations

import math
import re
import sys
from typing import Callable

from asyncflow import refs
from asyncflow.plan import Plan
from asyncflow.runtime.faults import RunError


def train_source(plan: Plan):
    """The data source training prompts come from: the first one an ``eval:`` section (if the
    plan has one) does not name."""
    ev = getattr(plan, "eval", None)
    held_out = getattr(ev, "data", None) if ev is not None else None
    for src in plan.data:
        if src.name != held_out:
            return src
    return plan.data[0] if plan.data else None


def load_prompts(plan: Plan, paths: list[str] | None = None,
                 warn: Callable[[str], None] | None = None) -> list[dict]:
    """The rows of the plan's training data source (:func:`train_source`), restricted to its
    declared fields and checked to be enough for the run (AF606, or the epochs warning, which
    ``warn`` receives; default: stderr); see the module docstring for the errors."""
    src = train_source(plan)
    if src is None:
        raise RunError("the plan has no data source")
    rows, fail = _load(plan, src, paths)
    _check_epochs(plan, src, len(rows), warn, fail)
    return rows


def load_rows(plan: Plan, source: str, paths: list[str] | None = None) -> list[dict]:
    """The rows of the plan's data source named ``source``, restricted to its declared fields
    (no epochs check: an evaluation reads its rows once); see the module docstring for the
    errors. ``paths``: the search path (default: the pipeline's directory, then the CWD)."""
    src = next((d for d in plan.data if d.name == source), None)
    if src is None:
        raise RunError(f"the plan has no data source '{source}' (it has: "
                       f"{', '.join(d.name for d in plan.data) or 'none'})")
    return _load(plan, src, paths)[0]


def read_source(src, paths: list[str]) -> list:
    """The raw rows of data source ``src`` (a SourcePlan), read as :mod:`asyncflow.datasets`
    says; raises what the loader raises."""
    from asyncflow import datasets

    s, split = src.source, getattr(src, "split", None)
    found = refs.find_file(s, paths)
    is_file = found is None or not found.is_dir()
    if src.args and ((found is not None and datasets.saved_splits(found) is not None)
                     or (is_file and s.lower().endswith(datasets.DATA_SUFFIXES))):
        raise ValueError(f"args ({', '.join(src.args)}) apply to a \"module:function\" source or "
                         "to datasets.load_dataset (a hub data set, a data-files directory); "
                         f"{'a save_to_disk directory' if not is_file else 'a file'} takes none")
    if found is not None and found.is_dir():
        return datasets.directory(str(found), split, **(src.args or {}))
    if s.lower().endswith(datasets.DATA_SUFFIXES):
        path = str(found or s)
        if s.lower().endswith(".jsonl"):
            return datasets.jsonl(path)
        if s.lower().endswith(".parquet"):
            return datasets.parquet(path)
        return datasets.json_file(path)
    if found is None and datasets.HUB_DATA_ID.match(s):
        return datasets.hub(s, split, **(src.args or {}))
    return list(refs.resolve(s, paths)(**(src.args or {})))


def _load(plan: Plan, src, paths: list[str] | None):
    """``src``'s rows restricted to its declared fields, and the ``fail`` that makes its errors."""
    from asyncflow import datasets
    from asyncflow.diagnostics import error
    from asyncflow.loc import SourceLoc, Sources

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
        rows = read_source(src, paths)
    except datasets.SplitError as e:
        at = SourceLoc.parse(locs.get("split")) or at_source
        raise fail("AF607", at, problem=str(e)) from None
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
    return [{f: r[f] for f in fields} for r in rows], fail


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
