"""The validate pass: the language's rules (LANGUAGE.md), each with its AF3xx code."""
from __future__ import annotations

from asyncflow.diagnostics import Diagnostics
from asyncflow.ir import Graph


def validate(graph: Graph, diags: Diagnostics) -> None:
    """Add a located diagnostic to ``diags`` for every rule ``graph`` breaks."""
