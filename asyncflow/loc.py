"""Source locations and the source texts they point into.

Below every other module (it imports nothing of asyncflow): the front ends, the diagnostics and
the runtime all use it. There is no global registry of texts: a :class:`Sources` belongs to its
:class:`~asyncflow.diagnostics.Diagnostics`, the loaders add the texts they read to it, and a
diagnostic quotes its line from it.
"""
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

    @classmethod
    def parse(cls, text: str | None, width: int = 0) -> "SourceLoc | None":
        """``"file:line:col"`` (how a plan carries locations) back to a SourceLoc spanning
        ``width`` columns; None when ``text`` is not one."""
        file, _, col = str(text or "").rpartition(":")
        file, _, line = file.rpartition(":")
        if file and line.isdigit() and col.isdigit():
            return cls(file, int(line), int(col), int(line), int(col) + width)
        return None


class Sources:
    """The texts of the sources read so far, so a diagnostic can quote its line."""

    def __init__(self) -> None:
        self._texts: dict[str, str] = {}

    def add(self, name: str, text: str) -> None:
        self._texts[name] = text

    def add_file(self, path: str) -> None:
        """Add the text of the file ``path`` (under that name), if it can be read as UTF-8."""
        try:
            with open(path, encoding="utf-8") as f:
                self.add(path, f.read())
        except (OSError, UnicodeDecodeError):
            pass

    def line(self, loc: SourceLoc) -> str | None:
        text = self._texts.get(loc.file)
        if text is None:
            return None
        lines = text.splitlines()
        if 1 <= loc.line <= len(lines):
            return lines[loc.line - 1]
        return None
