"""``asyncflow schema [--markdown] [-o FILE]``: the language's JSON Schema, or its reference."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer


def schema_text() -> str:
    """The JSON Schema as ``docs/asyncflow.schema.json`` holds it."""
    from asyncflow.schema import json_schema

    return json.dumps(json_schema(), indent=2) + "\n"


def markdown_text() -> str:
    """The language reference as ``docs/language.md`` holds it."""
    from asyncflow.langdoc import language_markdown

    return language_markdown()


def register(app: typer.Typer) -> None:
    @app.command()
    def schema(markdown: bool = typer.Option(
                   False, "--markdown", help="print the language reference (docs/language.md)"),
               output: Optional[str] = typer.Option(
                   None, "-o", "--output", help="write here instead of stdout")) -> None:
        """Print the JSON Schema of the YAML pipeline language (for editors), or its reference."""
        text = markdown_text() if markdown else schema_text()
        if output:
            Path(output).write_text(text, encoding="utf-8")
        else:
            typer.echo(text, nl=False)
