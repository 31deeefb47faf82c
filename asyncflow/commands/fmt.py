"""``asyncflow fmt FILE [--to yaml|af]``: canonical form; converts YAML <-> DSL."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from asyncflow.console import SetOpt, out
from asyncflow.dsl.load import load_file


def register(app: typer.Typer) -> None:
    @app.command()
    def fmt(file: str = typer.Argument(..., help="pipeline file (.yaml, .yml, .af)"),
            to: Optional[str] = typer.Option(None, "--to", help="yaml or af (default: the file's own)"),
            output: Optional[str] = typer.Option(None, "-o", "--output", help="write here instead of stdout"),
            in_place: bool = typer.Option(False, "--in-place", "-i", help="rewrite FILE"),
            set_: Optional[List[str]] = SetOpt) -> None:
        """Print a pipeline in canonical form, as YAML or as the .af text DSL."""
        p = load_file(file, set_ or ())
        target = (to or ("af" if Path(file).suffix == ".af" else "yaml")).lower()
        if target in ("yaml", "yml"):
            from asyncflow.dsl.emit import emit_yaml

            text = emit_yaml(p)
        elif target == "af":
            from asyncflow.dsl.af_emit import emit_af

            text = emit_af(p)
        else:
            raise typer.BadParameter(f"--to must be yaml or af, not {to!r}")
        dest = file if in_place else output
        if dest:
            Path(dest).write_text(text)
        else:
            out.print(text, end="", markup=False)
