"""The ``asyncflow`` command line (typer + rich).

Commands live in :mod:`asyncflow.commands`, one module each, and register themselves on ``app``;
what they share with this module (consoles, ``--set``, error printing, the ``--debug`` state they
receive as ``ctx.obj``) is :mod:`asyncflow.console`. User errors print
``file:line:col: AF### message`` with the source line and a caret and exit 2; anything else is an
internal fault: exit 1 with a one-line summary (``--debug``, anywhere on the line, shows the trace).
"""
from __future__ import annotations

import importlib
import sys
from typing import List, Optional

import typer

from asyncflow.console import State, err, report
from asyncflow.errors import InternalError, UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="asyncflow: compile and run asynchronous, streaming RL post-training pipelines.")
COMMANDS = ("check", "fmt", "compile", "viz", "run", "simulate", "schema", "export")


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
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args  # anywhere on the line, before or after the command
    if debug:
        args.remove("--debug")
    try:
        # the state reaches every command as ctx.obj; typer.Exit comes back as the return value
        rc = app(args=args, standalone_mode=False, obj=State(debug=debug))
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
        if debug:
            raise
        where = f" ({e.__class__.__name__})" if not isinstance(e, InternalError) else ""
        err.print(f"internal error{where}: {e}\nthis is a bug in asyncflow; rerun with --debug "
                  "for the traceback", style="red", markup=False)
        sys.exit(1)


if __name__ == "__main__":
    main()
