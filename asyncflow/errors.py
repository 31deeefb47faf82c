"""One exception hierarchy, rooted at :class:`AsyncflowError`.

``UserError`` carries located, coded diagnostics (exit code 2); ``InternalError`` is a fault of
asyncflow itself (exit code 1) and names where it happened (for the compiler: the pass).
"""
from __future__ import annotations


class AsyncflowError(Exception):
    """Base of every error asyncflow raises on purpose."""


class UserError(AsyncflowError):
    """Something the user wrote is wrong; ``diagnostics`` says what and where."""

    def __init__(self, diagnostics):
        self.diagnostics = list(diagnostics)
        super().__init__("\n".join(d.headline() for d in self.diagnostics))


class InternalError(AsyncflowError):
    """A bug in asyncflow, not in the user's input."""
