"""House habits, checked statically and by small direct calls.

- one exception hierarchy: the errors that leave asyncflow (TaskError, SweepError with the
  others) derive from :class:`asyncflow.errors.AsyncflowError`, and joining it changed no
  behaviour;
- no broad handler swallows an error: an ``except Exception`` / ``except BaseException`` / bare
  ``except`` whose body is only ``pass`` (or ``...``, a string, ``continue``) loses what went
  wrong without a word; a handler re-raises with a reason, reports, or logs once what was lost
  (as ``check``'s module look-up does for an import finder that raises).
"""
from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

from asyncflow.errors import AsyncflowError, InternalError, TaskError, UserError


def test_task_and_sweep_errors_join_the_hierarchy():
    from asyncflow.simulate.sweep import SweepError

    for cls in (TaskError, SweepError, UserError, InternalError):
        assert issubclass(cls, AsyncflowError), cls


def test_task_error_keeps_its_code_payload_and_message():
    class Task:
        name, loc = "reward", "p.yaml:7:3"

    e = TaskError("AF611", Task(), field="score", row=2)
    assert (e.code, e.loc) == ("AF611", "p.yaml:7:3")
    assert e.payload() == {"code": "AF611", "loc": "p.yaml:7:3",
                           "fields": {"task": "reward", "field": "score", "row": 2}}
    assert str(e) == "AF611 {'task': 'reward', 'field': 'score', 'row': 2}"
    with pytest.raises(AsyncflowError):
        raise e


def test_sweep_error_keeps_its_message():
    from asyncflow.simulate import sweep

    with pytest.raises(AsyncflowError) as ei:
        sweep.parse("steps")
    assert isinstance(ei.value, sweep.SweepError)
    assert str(ei.value).startswith("--sweep steps: expected KEY=v1,v2,...")


def test_a_task_error_through_the_pass_runner_is_not_an_internal_error():
    """The pass runner lets an AsyncflowError through unwrapped and wraps anything else as an
    internal error naming the pass; a TaskError (never raised by a pass today) now goes through
    as what it is."""
    from asyncflow.compiler.runner import Context, Pass, PassFailed, run_passes

    def boom(value, ctx):
        raise TaskError("AF610", "t", fn="f")

    def bug(value, ctx):
        raise KeyError("x")

    with pytest.raises(TaskError):
        run_passes([Pass("boom", boom)], None, Context())
    with pytest.raises(PassFailed):
        run_passes([Pass("bug", bug)], None, Context())


# -- broad handlers that swallow --------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
BROAD = {"Exception", "BaseException"}
#: (file, enclosing function) -> how many silent broad handlers it may still hold (none now:
#: every broad handler re-raises, reports or logs what was lost)
ALLOWED: dict[tuple[str, str], int] = {}


def _broad(h: ast.ExceptHandler) -> bool:
    if h.type is None:
        return True
    types = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
    return any((isinstance(t, ast.Name) and t.id in BROAD)
               or (isinstance(t, ast.Attribute) and t.attr in BROAD) for t in types)


def _silent(h: ast.ExceptHandler) -> bool:
    return all(isinstance(s, (ast.Pass, ast.Continue))
               or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)) for s in h.body)


def _handlers(node: ast.AST, scope: list[str]):
    """``(enclosing qualname, line)`` of every silent broad handler under ``node``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _handlers(child, scope + [child.name])
            continue
        if isinstance(child, ast.ExceptHandler) and _broad(child) and _silent(child):
            yield ".".join(scope) or "<module>", child.lineno
        yield from _handlers(child, scope)


def silent_handlers() -> list[tuple[str, str, int]]:
    out = []
    for base in ("asyncflow", "dsl"):
        for f in sorted((ROOT / base).rglob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            out += [(rel, q, line) for q, line in _handlers(ast.parse(f.read_text(), rel), [])]
    return out


def test_the_scan_finds_a_silent_handler():
    tree = ast.parse("def f():\n    try:\n        g()\n    except Exception:\n        pass\n"
                     "    try:\n        g()\n    except:\n        ...\n"
                     "    try:\n        g()\n    except (OSError, BaseException) as e:\n"
                     "        log(e)\n    try:\n        g()\n    except ValueError:\n        pass\n")
    assert list(_handlers(tree, [])) == [("f", 4), ("f", 8)]


def test_no_broad_handler_swallows_an_error():
    found = silent_handlers()
    per = Counter((f, q) for f, q, _ in found)
    over = [f"{f}:{line} ({q})" for f, q, line in found if per[f, q] > ALLOWED.get((f, q), 0)]
    assert not over, ("a broad except whose body only passes loses the error: re-raise with a "
                      "reason, report it, or log once what was lost:\n  " + "\n  ".join(over))


def test_the_allowed_handlers_are_still_there():
    """An entry whose handlers are gone (or fewer) shrinks or leaves ALLOWED."""
    per = Counter((f, q) for f, q, _ in silent_handlers())
    stale = {k: (n, per[k]) for k, n in ALLOWED.items() if per[k] < n}
    assert not stale, f"ALLOWED lists more than there are ((allowed, found)): {stale}"


def test_a_failing_import_finder_is_skipped_and_said_once(monkeypatch, caplog, tmp_path):
    """``check`` looks modules up without importing them; a third-party finder that raises is
    skipped (the module is looked up by the others), and the log says so once."""
    import sys

    from asyncflow import refs

    class Broken:
        @staticmethod
        def find_spec(name, path=None, target=None):
            raise RuntimeError("broken finder")

    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    with caplog.at_level("WARNING", logger="asyncflow.refs"):
        (tmp_path / "habits_mod.py").write_text("X = 1\n")
        assert refs.find_module("habits_mod", [str(tmp_path)]) is not None
        assert refs.find_module("habits_no_such_mod", [str(tmp_path)]) is None
    said = [r.getMessage() for r in caplog.records if "Broken" in r.getMessage()]
    assert len(said) == 1 and "RuntimeError: broken finder" in said[0], said
