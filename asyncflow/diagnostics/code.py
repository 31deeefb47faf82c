"""A diagnostic code of the table and its examples (:mod:`asyncflow.diagnostics` assembles the
table from one module per layer; each of them, and the examples' base, builds on these two)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """A source holding one mistake; the diagnostic must point at the first ``at`` in it.

    An ``at`` of the form ``@LINE:COL`` (e.g. ``"@3:1"``) is an explicit 1-based position, for
    places no text marks (the end of the file).

    ``sets`` are ``--set`` overrides applied before checking; when ``in_set`` is true the
    expected location is inside the first override's text rather than in the file.
    """

    text: str
    at: str
    suffix: str = ".yaml"
    sets: tuple[str, ...] = ()
    in_set: bool = False


@dataclass(frozen=True)
class Code:
    code: str
    name: str
    message: str  # a str.format template
    examples: tuple[Example, ...] = ()
    severity: str = "error"
