"""The ``asyncflow`` command line (typer + rich).

Commands live in :mod:`asyncflow.commands`, one module each, and register themselves on ``app``.
User errors print ``file:line:col: AF### message`` with the source line and a caret and exit 2;
anything else is an internal fault: exit 1 with a one-line summary (``--debug`` shows the trace).
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import List, Optional

import typer
from rich.console import Console

from asyncflow.errors import AsyncflowError, InternalError, UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="asyncflow: compile and run asynchronous, streaming RL post-training pipelines.")
# piped output (logs, CI) gets a wide page instead of rich's 80 columns
_WIDTH = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 150
out = Console(highlight=False, soft_wrap=True, width=_WIDTH)
err = Console(stderr=True, highlight=False, soft_wrap=True, width=_WIDTH)

SetOpt = typer.Option(None, "--set", metavar="KEY.PATH=VALUE",
                      help="override a key, e.g. --set tasks.update.args.lr=3e-5 --set sync.0.max_staleness=0")

COMMANDS = ("check", "fmt", "compile", "viz", "run", "simulate")


def report(e: UserError) -> None:
    for d in e.diagnostics:
        err.print(d.render(), markup=False)
    n = len(e.diagnostics)
    err.print(f"{n} error{'s' if n != 1 else ''}", style="bold red", markup=False)


def _is_usage_error(e: Exception) -> bool:
    """A click usage error (typer >= 0.20 bundles its own click, so check both)."""
    classes = []
    for mod in ("click.exceptions", "typer._click.exceptions"):
        try:
            classes.append(importlib.import_module(mod).ClickException)
        except (ImportError, AttributeError):
            pass
    return isinstance(e, tuple(classes))


def main(argv: Optional[List[str]] = None) -> None:
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"asyncflow.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"asyncflow.commands.{name}":
                raise
            continue
        mod.register(app)
    debug = "--debug" in (argv if argv is not None else sys.argv)
    if debug:
        (argv if argv is not None else sys.argv).remove("--debug")
        os.environ["ASYNCFLOW_DEBUG"] = "1"
    try:
        rc = app(args=argv, standalone_mode=False)  # typer.Exit comes back as the return value
        sys.exit(rc if isinstance(rc, int) else 0)
    except UserError as e:
        report(e)
        sys.exit(2)
    except (typer.Exit, SystemExit) as e:
        code = getattr(e, "exit_code", getattr(e, "code", 0))
        sys.exit(code or 0)
    except KeyboardInterrupt:
        err.print("interrupted", style="yellow")
        sys.exit(130)
    except typer.Abort:
        err.print("aborted", style="yellow")
        sys.exit(130)
    except Exception as e:  # click usage errors and internal faults
        if _is_usage_error(e):
            e.show()
            sys.exit(2)
        if os.environ.get("ASYNCFLOW_DEBUG"):
            raise
        where = f" ({e.__class__.__name__})" if not isinstance(e, InternalError) else ""
        err.print(f"internal error{where}: {e}\nthis is a bug in asyncflow; rerun with --debug "
                  "for the traceback", style="red", markup=False)
        sys.exit(1)


if __name__ == "__main__":
    main()
