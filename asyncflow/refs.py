"""``module:name`` references: found the same way by ``check`` and by ``run``.

A reference (a reward's ``fn``, a data ``source``, a model ``init``, an ``env`` factory) names a
module and a top-level name in it. Both the compiler and the runtime look modules up on one
search path: ``sys.path``, then the pipeline file's directory, then the working directory
(:func:`search_path`) -- so a reward module kept next to its pipeline simply works, and a user's
``json.py`` or ``tokenizers.py`` beside a pipeline never shadows the installed module of that
name (the user's directories come *after* ``sys.path``, in every process).

- ``check`` finds the module and reads its source *without importing it* (:func:`find_module`,
  :func:`top_level_names`, :func:`function_params`): a broken or slow user module cannot break
  or stall the compiler, and the compiler imports no torch.
- ``run`` imports it (:func:`resolve`) with the same directories appended to ``sys.path``; the
  driver passes them to every worker, which may run in another process or on another node.
"""
from __future__ import annotations

import ast as pyast
import importlib
import logging
import os
import sys
import threading
from dataclasses import dataclass
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any, Callable, Sequence


def search_path(pipeline_file: str | os.PathLike | None) -> list[str]:
    """The user's directories: the pipeline's directory, then the CWD (absolute, without
    duplicates). Files (data, model directories) are looked up in them in this order; modules
    after ``sys.path`` (:func:`module_path`)."""
    out = [Path(pipeline_file).parent if pipeline_file else Path("."), Path(".")]
    return list(dict.fromkeys(str(x.resolve()) for x in out))


def find_file(path: str, paths: Sequence[str]) -> Path | None:
    """A data or model file as ``check`` and ``run`` both find it: as given when absolute, else
    the first of ``paths`` (:func:`search_path`) that has it; None when none does."""
    p = Path(path).expanduser()
    for c in ([p] if p.is_absolute() else [Path(b) / p for b in paths]):
        if c.exists():
            return c
    return None


_LOCK = threading.Lock()


def module_path(extra: Sequence[str]) -> list[str]:
    """Where top-level modules are looked up: ``sys.path``, then the ``extra`` directories it
    does not hold yet (the user's, :func:`search_path`), so that installed modules win."""
    return [*sys.path, *(p for p in dict.fromkeys(extra) if p not in sys.path)]


def resolve(target: str, paths: Sequence[str] = ()) -> Any:
    """Import ``module:attr`` (``attr`` may be dotted), looking in ``sys.path`` and then in
    ``paths`` (appended to ``sys.path``: :func:`module_path`)."""
    module, _, attr = target.partition(":")
    with _LOCK:
        for p in dict.fromkeys(paths):
            if p not in sys.path:
                sys.path.append(p)
        obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


_FAILED_FINDERS: set[str] = set()  # the import finders whose fault was logged (once each)


def _finder_failed(finder, module: str, e: Exception) -> None:
    """Log, once per finder, that it raised and was skipped: a module only it finds reads as
    not found (AF341) though ``run`` might import it."""
    name = getattr(finder, "__qualname__", None) or type(finder).__qualname__
    if name in _FAILED_FINDERS:
        return
    _FAILED_FINDERS.add(name)
    logging.getLogger(__name__).warning(
        "the import finder %s raised %s: %s while looking for module %r; it is skipped, so a "
        "module only it can find is reported as not found", name, e.__class__.__name__, e, module)


def find_module(name: str, extra: list[str]):
    """The spec of module ``name``, found without importing it or its parent packages.

    Top-level modules are looked up as :func:`resolve` imports them: through ``sys.meta_path``,
    with the ``extra`` directories after ``sys.path`` (:func:`module_path`)."""
    parts = name.split(".")
    spec = None
    for i in range(len(parts)):
        full = ".".join(parts[: i + 1])
        loaded = sys.modules.get(full)
        if loaded is not None and getattr(loaded, "__spec__", None) is not None:
            spec = loaded.__spec__
            continue
        path = None
        if i:
            path = spec.submodule_search_locations if spec is not None else None
            if not path:
                return None
            path = list(path)
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            where = path
            if finder is PathFinder and i == 0 and extra:  # sys.path, then `extra`
                where = module_path(extra)
            try:
                spec = find(full, where)
            except Exception as e:  # a third-party finder's fault must not break `check`
                _finder_failed(finder, full, e)
                spec = None
            if spec is not None:
                break
        if spec is None:
            return None
    return spec


_PARSED: dict[tuple[str, int], Any] = {}


def top_level_names(spec) -> set[str] | SyntaxError | None:
    """The names a module's source defines at top level; ``None`` when that cannot be known
    (no Python source, ``from x import *``, a module ``__getattr__``)."""
    origin = spec.origin
    if not origin or not origin.endswith(".py") or not os.path.isfile(origin):
        return None
    key = (origin, os.stat(origin).st_mtime_ns)
    if key not in _PARSED:
        try:
            tree = pyast.parse(Path(origin).read_bytes(), origin)
        except SyntaxError as exc:
            _PARSED[key] = exc
        except (OSError, ValueError):
            _PARSED[key] = None
        else:
            names: set[str] = set()
            _PARSED[key] = names if _collect(tree.body, names) else None
    return _PARSED[key]


def _collect(body: list, names: set[str]) -> bool:
    """Add the names ``body`` binds; False when they cannot all be known statically."""
    for s in body:
        if isinstance(s, (pyast.FunctionDef, pyast.AsyncFunctionDef, pyast.ClassDef)):
            names.add(s.name)
            if s.name == "__getattr__":
                return False
        elif isinstance(s, (pyast.Assign, pyast.AnnAssign, pyast.AugAssign)):
            targets = s.targets if isinstance(s, pyast.Assign) else [s.target]
            for tgt in targets:
                for n in pyast.walk(tgt):
                    if isinstance(n, pyast.Name):
                        names.add(n.id)
        elif isinstance(s, (pyast.Import, pyast.ImportFrom)):
            for a in s.names:
                if a.name == "*":
                    return False
                names.add(a.asname or a.name.split(".")[0])
        elif isinstance(s, (pyast.If, pyast.Try, pyast.With, pyast.For, pyast.While)):
            for part in ("body", "orelse", "finalbody"):
                if not _collect(getattr(s, part, []), names):
                    return False
            for h in getattr(s, "handlers", []):
                if not _collect(h.body, names):
                    return False
    return True


@dataclass(frozen=True)
class Params:
    """A function's parameters as its source states them."""

    positional: tuple[str, ...]  # positional-or-keyword and positional-only, in order
    required: int  # how many of ``positional`` have no default
    var_positional: bool  # takes ``*args``
    keyword_only: tuple[str, ...] = ()
    var_keyword: bool = False
    line: int = 0

    def accepts(self, name: str) -> bool:
        return self.var_keyword or name in self.positional or name in self.keyword_only


def function_params(target: str, paths: Sequence[str] = ()) -> Params | None:
    """The parameters of the top-level function ``target`` names, read from its module's source
    without importing it; None when that cannot be known statically (not a plain ``def``, no
    Python source, a class, a name bound by assignment or import)."""
    module, _, attr = target.partition(":")
    if "." in attr:
        return None
    spec = find_module(module, list(paths))
    origin = getattr(spec, "origin", None) if spec is not None else None
    if not origin or not origin.endswith(".py") or not os.path.isfile(origin):
        return None
    try:
        tree = pyast.parse(Path(origin).read_bytes(), origin)
    except (SyntaxError, OSError, ValueError):
        return None
    found = None
    for s in tree.body:  # the last top-level binding of the name wins, as at import
        if isinstance(s, (pyast.FunctionDef, pyast.AsyncFunctionDef)) and s.name == attr:
            found = s
        elif isinstance(s, (pyast.ClassDef, pyast.Assign, pyast.AnnAssign, pyast.Import,
                            pyast.ImportFrom)) and attr in _bound_names(s):
            found = None
    if found is None or found.decorator_list:
        return None
    a = found.args
    pos = [x.arg for x in a.posonlyargs + a.args]
    return Params(tuple(pos), len(pos) - len(a.defaults), a.vararg is not None,
                  tuple(x.arg for x in a.kwonlyargs), a.kwarg is not None, found.lineno)


def _bound_names(s) -> set[str]:
    names: set[str] = set()
    if isinstance(s, pyast.ClassDef):
        names.add(s.name)
    elif isinstance(s, (pyast.Import, pyast.ImportFrom)):
        names.update(a.asname or a.name.split(".")[0] for a in s.names)
    else:
        for tgt in (s.targets if isinstance(s, pyast.Assign) else [s.target]):
            names.update(n.id for n in pyast.walk(tgt) if isinstance(n, pyast.Name))
    return names


def call_params(fn: Callable) -> Params | None:
    """:class:`Params` of a live callable (the runtime's view), or None."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    P = inspect.Parameter
    pos = [p for p in sig.parameters.values() if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    return Params(tuple(p.name for p in pos), sum(p.default is P.empty for p in pos),
                  any(p.kind is P.VAR_POSITIONAL for p in sig.parameters.values()),
                  tuple(p.name for p in sig.parameters.values() if p.kind is P.KEYWORD_ONLY),
                  any(p.kind is P.VAR_KEYWORD for p in sig.parameters.values()))


def accepted(fn: Callable, args: dict | None) -> dict:
    """The ``args`` that ``fn`` accepts as keywords (all of them if it takes ``**kwargs``, or
    when its signature cannot be read)."""
    args = dict(args or {})
    params = call_params(fn)
    if params is None:
        return args
    return {k: v for k, v in args.items() if params.accepts(k)}


def arity_problem(params: Params, n_inputs: int, arg_names: Sequence[str],
                  reserved: Sequence[str] = ()) -> str | None:
    """Why ``n_inputs`` positional inputs do not fit ``params`` (None when they do). Names in
    ``arg_names`` (the task's ``args``, passed as keywords) and ``reserved`` (keywords the
    runtime passes, such as a filter's ``groups``) are not positional slots."""
    skip = set(arg_names) | set(reserved)
    free = [p for p in params.positional if p not in skip]
    # positional parameters filled by keywords must come after the ones inputs fill
    required = sum(1 for i, p in enumerate(params.positional) if p not in skip and i < params.required)
    if n_inputs < required:
        return (f"it needs {required} positional argument{'s' if required != 1 else ''} "
                f"({', '.join(free[:required])}) but the task passes {n_inputs}")
    if n_inputs > len(free) and not params.var_positional:
        return (f"it takes {len(free)} positional argument{'s' if len(free) != 1 else ''} "
                f"({', '.join(free) or 'none'}) but the task passes {n_inputs}")
    return None
