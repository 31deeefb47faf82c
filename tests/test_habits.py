"""House habits, checked statically and by small direct calls.

- one exception hierarchy: every error asyncflow raises on purpose derives from
  :class:`asyncflow.errors.AsyncflowError`, and joining it changed no behaviour.
"""
from __future__ import annotations

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
