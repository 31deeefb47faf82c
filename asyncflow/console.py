"""What the command line and its commands share: the consoles, the ``--set`` option, how a user
error and a usage error are printed, and the per-invocation :class:`State` (``--debug``).

Below both :mod:`asyncflow.cli` and :mod:`asyncflow.commands` (it imports neither), so a command
never imports the CLI module that registers it.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import typer
from rich.console import Console

from asyncflow.errors import UserError

# piped output (logs, CI) gets a wide page instead of rich's 80 columns
_WIDTH = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 150
out = Console(highlight=False, soft_wrap=True, width=_WIDTH)
err = Console(stderr=True, highlight=False, soft_wrap=True, width=_WIDTH)

SetOpt = typer.Option(None, "--set", metavar="KEY.PATH=VALUE",
                      help="override a key, e.g. --set tasks.update.args.lr=3e-5 --set sync.0.max_staleness=0")


@dataclass
class State:
    """One invocation's global options; commands get it as ``ctx.obj`` (:func:`state`)."""

    debug: bool = False  # show tracebacks of internal errors and the details of run-time errors


def state(ctx: typer.Context | None) -> State:
    """The invocation's :class:`State` (a default one when the app was called without it)."""
    obj = getattr(ctx, "obj", None) if ctx is not None else None
    return obj if isinstance(obj, State) else State()


def report(e: UserError) -> None:
    """Print every diagnostic of ``e`` (with its source line and caret) and the count."""
    for d in e.diagnostics:
        err.print(d.render(), markup=False)
    n = len(e.diagnostics)
    err.print(f"{n} error{'s' if n != 1 else ''}", style="bold red", markup=False)


def usage_error(message: str) -> None:
    """Print a usage error and exit 2 (like click's, without relying on which click raised it)."""
    err.print(f"error: {message}", style="red", markup=False)
    raise SystemExit(2)
