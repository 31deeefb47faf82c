"""``asyncflow export RUN_DIR [--step N] [-o DIR] [--force] [--dtype D]``: a run's trained models
as Hugging Face directories (:func:`asyncflow.runtime.export.export_run`).

Without ``--step``: the run's final export (``RUN_DIR/final``, written when the run reached its
last step), else its newest complete checkpoint. With ``--step N``: checkpoint ``step_N`` (or the
final export when N is the run's last step). Writes ``DIR/<model>/`` for every trained model
(default ``DIR``: ``RUN_DIR/export/step_N``): config, safetensors weights in the model's
``dtype`` (or ``--dtype``'s), tokenizer; no optimizer state. Needs torch and safetensors (the
``hf`` extra), imported only when it runs. Mistakes are AF660-AF664 (exit 2).
"""
from __future__ import annotations

from typing import Optional

import typer

from asyncflow.console import out, usage_error
from asyncflow.modelsrc import DTYPES


def register(app: typer.Typer) -> None:
    @app.command()
    def export(run_dir: str = typer.Argument(..., help="a run directory (asyncflow run --out)"),
               step: Optional[int] = typer.Option(
                   None, "--step", min=0,
                   help="export checkpoint step_N (default: the final export, else the newest "
                        "checkpoint)"),
               output: Optional[str] = typer.Option(
                   None, "-o", "--output", help="write DIR/<model>/ (default RUN_DIR/export/step_N)"),
               force: bool = typer.Option(
                   False, "--force", help="write into an existing non-empty DIR"),
               dtype: Optional[str] = typer.Option(
                   None, "--dtype",
                   help="float32, bfloat16 or float16: the weights' dtype (default: the "
                        "model's dtype:), e.g. bfloat16 to serve a model trained in float32")
               ) -> None:
        """Write a run's trained models as Hugging Face directories (from_pretrained loads them)."""
        try:
            import safetensors  # noqa: F401
            import torch  # noqa: F401
        except ImportError as e:
            usage_error(f"asyncflow export needs torch and safetensors ({e.name} is missing): "
                        "pip install 'asyncflow[hf]'")
        if dtype is not None and dtype not in DTYPES:
            usage_error(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        from asyncflow.runtime.export import export_run

        res = export_run(run_dir, step=step, out=output, force=force, dtype=dtype)  # exit 2
        where = "final export" if res["source"] == "final" else f"checkpoint {res['source']}"
        for model, e in res["models"].items():
            out.print(f"exported {model} (step {res['step']}, {where}, {e['dtype']}): {e['dir']}",
                      markup=False, soft_wrap=True)
