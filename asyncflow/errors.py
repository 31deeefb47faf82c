"""One exception hierarchy, rooted at :class:`AsyncflowError`.

``UserError`` carries located, coded diagnostics (exit code 2); ``InternalError`` is a fault of
asyncflow itself (exit code 1) and names where it happened (for the compiler: the pass);
``TaskError`` is a located, coded user error found while a task ran. Other modules derive their
own (``RunError``, ``StoreError``, ``SweepError``, ...) from ``AsyncflowError`` too.
"""
from __future__ import annotations

from typing import Any


class AsyncflowError(Exception):
    """Base of every error asyncflow raises on purpose."""


class UserError(AsyncflowError):
    """Something the user wrote is wrong; ``diagnostics`` says what and where."""

    def __init__(self, diagnostics):
        self.diagnostics = list(diagnostics)
        super().__init__("\n".join(d.headline() for d in self.diagnostics))


class InternalError(AsyncflowError):
    """A bug in asyncflow, not in the user's input."""


class TaskError(AsyncflowError):
    """A located user error found while a task ran (a user function, an engine's model or
    prompt); crosses process boundaries as a dict. Raised by the runtime's contract checks
    (:mod:`asyncflow.runtime.contract`) and by engines (:func:`asyncflow.prompts.located`)."""

    def __init__(self, code: str, task, **fields: Any):
        self.code, self.loc = code, getattr(task, "loc", "") or ""
        self.fields = {"task": getattr(task, "name", str(task)), **fields}
        super().__init__(f"{code} {self.fields}")

    def payload(self) -> dict:
        return {"code": self.code, "loc": self.loc, "fields": dict(self.fields)}
