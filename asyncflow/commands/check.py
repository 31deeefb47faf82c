"""``asyncflow check FILE...``: diagnostics only."""
from __future__ import annotations

from typing import List, Optional

import typer

from asyncflow.check import check_file
from asyncflow.console import SetOpt, err, out
from asyncflow.diagnostics import Diagnostics
from asyncflow.errors import UserError


def model_lines(p) -> list[str]:
    """One line per model: where it will come from (asyncflow.modelsrc, the rule run uses)."""
    from asyncflow.modelsrc import DEFAULT_DTYPE, SourceError, locate
    from asyncflow.refs import search_path

    out = []
    for m in p.models.values():
        dtype = f", {m.dtype}" if m.dtype and m.dtype != DEFAULT_DTYPE else ""
        if m.copy_of:
            out.append(f"model {m.name}: a copy of {m.copy_of}{dtype}")
            continue
        try:
            where = locate(m.init, search_path(p.path or None)).describe()
        except SourceError:  # reported as an error already
            continue
        out.append(f"model {m.name}: {where}{dtype}")
    return out


def register(app: typer.Typer) -> None:
    @app.command()
    def check(files: List[str] = typer.Argument(..., help="pipeline files (.yaml, .yml, .af)"),
              set_: Optional[List[str]] = SetOpt) -> None:
        """Check pipelines; print every error as file:line:col and exit 2 if there is one."""
        found = []
        for f in files:
            diags = Diagnostics()
            r = check_file(f, set_ or (), diags)
            found.extend(diags.errors)
            for w in diags.items:
                if w.severity == "warning":
                    err.print(w.render().replace(f" {w.code} ", f" {w.code} warning: ", 1), markup=False)
            if r is not None:
                p, g = r
                n = sum(1 for _ in g.tasks())
                out.print(f"{f}: ok ({p.name}: {n} tasks, {len(p.sync)} sync edges)", markup=False)
                for line in model_lines(p):
                    out.print(f"  {line}", markup=False)
        if found:
            raise UserError(found)
