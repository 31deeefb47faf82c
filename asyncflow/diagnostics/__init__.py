"""The diagnostics table and located diagnostics.

Every user-facing error has a code ``AF###`` defined exactly once in the table below, assembled
from one module per layer (the code's hundreds digit says which):

======  ===================  ================================================
range   module               what it covers
======  ===================  ================================================
AF1xx   ``syntax``           YAML and .af syntax, unreadable files
AF2xx   ``schema``           unknown keys, wrong value types, missing keys
AF3xx   ``rules``            the language's rules (docs/language.md), cross-references
AF4xx   ``compile``          compiler findings: placement, staleness, batch
AF5xx   ``overrides``        ``--set key.path=value`` overrides
AF6xx   ``runtime``          run-time user errors (resume, engines, data)
======  ===================  ================================================

Each :class:`Code` carries examples: a source with the mistake and the text at which the
diagnostic must point. ``compiler_tests/test_diagnostics_table.py`` walks every example.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Iterable

from asyncflow.diagnostics import compile as _compile
from asyncflow.diagnostics import overrides, rules, runtime, schema, syntax
from asyncflow.diagnostics.code import Code, Example
from asyncflow.errors import UserError
from asyncflow.loc import SourceLoc, Sources


@dataclass
class Diagnostic:
    code: str
    message: str
    loc: SourceLoc | None
    hint: str | None = None
    severity: str = "error"
    # the texts its location points into (those of the Diagnostics that made it)
    sources: Sources | None = field(default=None, repr=False, compare=False)

    def headline(self) -> str:
        where = f"{self.loc}: " if self.loc else ""
        return f"{where}{self.code} {self.message}"

    def render(self, sources: Sources | None = None) -> str:
        """The headline, the quoted source line with a caret under the location, the hint."""
        out = [self.headline()]
        sources = sources if sources is not None else self.sources
        if self.loc is not None and sources is not None:
            text = sources.line(self.loc)
            if text is not None:
                width = 1
                if self.loc.end_line == self.loc.line and self.loc.end_col > self.loc.col:
                    width = self.loc.end_col - self.loc.col
                col, quoted = self.loc.col, text
                if len(text) > QUOTE_WIDTH:  # a window of a long line, around the caret
                    start = max(0, min(col - 1 - QUOTE_WIDTH // 2, len(text) - QUOTE_WIDTH))
                    quoted = ("..." if start else "") + text[start:start + QUOTE_WIDTH] + (
                        "..." if start + QUOTE_WIDTH < len(text) else "")
                    col = col - start + (3 if start else 0)
                    width = min(width, QUOTE_WIDTH)
                out.append(f"    {quoted}")
                out.append("    " + " " * (col - 1) + "^" * max(1, width))
        if self.hint:
            out.append(f"    hint: {self.hint}")
        return "\n".join(out)


QUOTE_WIDTH = 100  # characters of a source line quoted under a diagnostic


def _table() -> dict[str, Code]:
    table: dict[str, Code] = {}
    for mod in (syntax, schema, rules, _compile, overrides, runtime):
        for c in mod.CODES:
            if c.code in table:
                raise AssertionError(f"diagnostic code {c.code} defined twice")
            table[c.code] = c
    return dict(sorted(table.items()))


_TABLE: dict[str, Code] | None = None


def table() -> dict[str, Code]:
    global _TABLE
    if _TABLE is None:
        _TABLE = _table()
    return _TABLE


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    m = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean '{m[0]}'?" if m else None


class Diagnostics:
    """Collects diagnostics so that all independent errors of a file are reported at once.

    It owns the :class:`Sources` its diagnostics point into: the loaders add every text they
    read (a file, a ``--set`` override) to ``sources``, and a diagnostic renders from it."""

    def __init__(self, sources: Sources | None = None) -> None:
        self.items: list[Diagnostic] = []
        self.sources = sources if sources is not None else Sources()

    def add(self, code: str, loc: SourceLoc | None, hint: str | None = None, **fmt) -> Diagnostic:
        spec = table()[code]
        d = Diagnostic(code, spec.message.format(**fmt), loc, hint, spec.severity, self.sources)
        # the same finding at the same place is reported once
        if not any(x.code == d.code and x.loc == d.loc and x.message == d.message for x in self.items):
            self.items.append(d)
        return d

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.items if d.severity == "error"]

    def raise_if_errors(self) -> None:
        if self.errors:
            raise UserError(sorted(self.errors, key=lambda d: (d.loc is None, d.loc or SourceLoc("", 0, 0))))

    def __bool__(self) -> bool:
        return bool(self.errors)


def error(code: str, loc: SourceLoc | None, hint: str | None = None, *,
          sources: Sources | None = None, **fmt) -> UserError:
    """One located diagnostic as an exception, for the places that cannot go on; ``sources``
    holds the text its location points into (when the caret line should be quoted)."""
    d = Diagnostics(sources)
    d.add(code, loc, hint, **fmt)
    return UserError(d.items)


__all__ = ["Code", "Example", "Diagnostic", "Diagnostics", "table", "did_you_mean", "error"]
