"""Validate rule 6: batch arithmetic and the known task ``args`` (AF210-AF213, AF360-AF362).
Part of :mod:`asyncflow.compiler.passes.validate`."""
from __future__ import annotations

import re
from typing import Any

from asyncflow.argtable import ENGINE_ARGS, Arg, declared_args, merged, owners, suggest
from asyncflow.compiler.kinds import rules_of
from asyncflow.compiler.kinds.base import at as _at
from asyncflow.compiler.passes.validate_refs import bases
from asyncflow.diagnostics import Diagnostics
from asyncflow.dsl import ast
from asyncflow.dsl.loc import SourceLoc
from asyncflow.engines.base import engine_names
from asyncflow.kinds import KINDS
from asyncflow.refs import function_params

# the keys each kind needs and takes: the kinds table
KEYS = {k: (v.needs, v.takes) for k, v in KINDS.items()}
# task args that may be a number or a distribution ({dist: ..., seed: ...}): the sim engine's
# latency and lengths, and a rollout's per-row length cap (long-tailed response lengths)
DIST_ARGS = tuple(dict.fromkeys(a.name for t in ENGINE_ARGS.values() for a in t
                                if a.type.endswith("|dist")))


def check_batch(p: ast.Pipeline, d: Diagnostics) -> None:
    total = p.step.samples_per_step
    plugins: dict[str, tuple[Arg, ...] | str] = {}  # plug-in engine -> its ARGS, or why none
    for t in p.tasks.values():
        unknown = _args(p, t, d, plugins)
        for section, key in [("args", k) for k in DIST_ARGS if k not in unknown]:
            spec = getattr(t, section).get(key)
            problem = _distribution_problem(spec) if spec is not None else None
            if problem:
                d.add("AF362", _at(t, f"{section}.{key}"), key=f"{section}.{key}", task=t.name,
                      problem=problem)
        mb = t.args.get("micro_batch")
        if not (isinstance(mb, int) and not isinstance(mb, bool) and mb >= 1) or "micro_batch" in unknown:
            continue
        reps = t.replicas if rules_of(t.kind).trains else 1  # a trainer's replicas split a step
        unit = mb * reps
        if total % unit:
            what = f"micro_batch {mb}" if reps == 1 else f"replicas x micro_batch = {reps} x {mb} = {unit}"
            divs = [str(k) for k in range(1, total + 1) if total % (k * reps) == 0][:12]
            d.add("AF360", _at(t, "args.micro_batch"),
                  f"micro_batch values that fit: {', '.join(divs)}", total=total, what=what, task=t.name)


def _args(p: ast.Pipeline, t: ast.TaskDef, d: Diagnostics, plugins: dict) -> set[str]:
    """Every arg of ``t`` is declared by one of its owners (:func:`asyncflow.argtable.owners`:
    its engine for its kind, its loss or estimator, the compiler) or accepted by its user
    function (``fn:``, or a rollout's ``env:`` factory, read from source; a function that takes
    ``**kwargs`` or cannot be read accepts anything), and a declared one has its type (AF211)
    and bounds (AF361). An unknown arg is AF210, one a function does not take AF212. A plug-in
    engine without a readable ``ARGS`` leaves its tasks unchecked (AF213, once per engine).
    Returns the args reported (unknown, or of a wrong type or value)."""
    if not t.args:
        return set()
    takes = KEYS[t.kind][0] + KEYS[t.kind][1]
    engine = t.engine if "engine" in takes else None
    engine_args = None
    checked = True  # whether every owner is known, so an arg none declares is unknown
    if engine is not None and engine not in ENGINE_ARGS:
        target = engine_names().get(engine)
        if target is None:  # AF323 already
            checked = False
        else:
            if engine not in plugins:
                plugins[engine] = declared_args(target, bases(p))
                if isinstance(plugins[engine], str):
                    d.add("AF213", _at(t, "engine"), engine=engine, why=plugins[engine])
            if isinstance(plugins[engine], str):
                checked = False
            else:
                engine_args = plugins[engine]
    if not rules_of(t.kind).args_known(t):
        checked = False  # AF331 / AF330 / AF325 already
    table = owners(t.kind, engine, t.loss, t.estimator, engine_args)
    known = merged(table)
    fn_key = rules_of(t.kind).fn_key(t)
    ref = getattr(t, fn_key) if fn_key else None
    params = function_params(ref, bases(p)) if ref else None
    fn_open = ref is not None and (params is None or params.var_keyword)
    unknown: set[str] = set()
    for key, v in t.args.items():
        vloc = _at(t, f"args.{key}")
        loc = _key_at(d, vloc, key)
        a = known.get(key)
        if a is not None:
            found = a.problem(v)
            if found:  # a wrong type at the key (up to the value's end), a bound at the value
                code, expected = found
                if code == "AF211" and loc != vloc:
                    loc = SourceLoc(loc.file, loc.line, loc.col, vloc.end_line or vloc.line,
                                    vloc.end_col or vloc.col)
                d.add(code, loc if code == "AF211" else vloc, key=key, task=t.name,
                      expected=expected, got=_shown(v))
                unknown.add(key)  # reported: not again as a distribution (AF362)
            continue
        if fn_open or not checked or (params is not None and params.accepts(key)):
            continue
        unknown.add(key)
        names = list(known) + [n for n in (params.positional + params.keyword_only if params else ())
                               if n not in known]
        hint = suggest(key, names) or (f"it takes: {', '.join(names)}" if names
                                       else "it takes no args")
        if fn_key == "fn" and ref is not None:
            d.add("AF212", loc, hint, key=key, task=t.name, fn=ref)
            continue
        whose = [who for who, args in table if args]
        if ref is not None:
            whose.append(f"the parameters of env {ref}")
        d.add("AF210", loc, hint, key=key, task=t.name,
              owners=", ".join(whose[:-1]) + (" nor " if len(whose) > 1 else "") + whose[-1]
              if whose else "nothing: it takes no args")
    return unknown


def _key_at(d: Diagnostics, loc: SourceLoc, key: str) -> SourceLoc:
    """Where ``key`` is written before its value at ``loc`` (``key: v`` in YAML, ``key=v`` in the
    DSL and in ``--set``), on the value's line; the value's place when the key is elsewhere."""
    text = d.sources.line(loc) if loc.line else None
    if not text:
        return loc
    hits = [m for m in re.finditer(rf"(?<![\w-])['\"]?({re.escape(key)})['\"]?\s*[:=]", text)
            if m.end() <= loc.col - 1 + 1]
    if not hits:
        return loc
    col = hits[-1].start(1) + 1
    return SourceLoc(loc.file, loc.line, col, loc.line, col + len(key))


def _shown(v: Any) -> str:
    """A value as a message shows it: numbers, strings, bools and null by value, else its type."""
    if v is None or isinstance(v, (int, float, str, bool)):
        return repr(v)
    if isinstance(v, list):
        return f"a list of {len(v)}"
    return "a mapping" if isinstance(v, dict) else type(v).__name__


def _distribution_problem(v: Any) -> str | None:
    """What is wrong with a latency spec (a number of seconds or a distribution), if anything:
    the one reading the sim engine and the cost model share (:mod:`asyncflow.costmodel`)."""
    from asyncflow.costmodel import DISTS, Distribution

    if isinstance(v, dict) and "dist" in v and not isinstance(v["dist"], str):
        return f"'dist' must be one of {', '.join(DISTS)}, not {v['dist']!r}"
    try:
        Distribution.from_spec(v)
    except ValueError as exc:
        return str(exc)
    except TypeError:  # a value of a type the spec reader does not expect
        return "not a number of seconds nor a distribution {dist: NAME, ...}"
    return None


__all__ = ["check_batch"]
