"""Source locations and the source texts they point into."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class SourceLoc:
    """A 1-based ``line:col`` span in a named source (a file path, or ``--set`` for an override)."""

    file: str
    line: int
    col: int
    end_line: int = 0
    end_col: int = 0

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


class Sources:
    """The texts of every source a run has read, so a diagnostic can quote its line."""

    def __init__(self) -> None:
        self._texts: dict[str, str] = {}

    def add(self, name: str, text: str) -> None:
        self._texts[name] = text

    def line(self, loc: SourceLoc) -> str | None:
        text = self._texts.get(loc.file)
        if text is None:
            return None
        lines = text.splitlines()
        if 1 <= loc.line <= len(lines):
            return lines[loc.line - 1]
        return None


SOURCES = Sources()
