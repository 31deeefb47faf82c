"""``asyncflow check FILE...``: diagnostics only."""
from __future__ import annotations

from typing import List, Optional

import typer

from asyncflow.check import check_file
from asyncflow.console import SetOpt, err, out
from asyncflow.diagnostics import Diagnostics
from asyncflow.errors import UserError


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
        if found:
            raise UserError(found)
