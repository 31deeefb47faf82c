"""Shared fixtures of the compiler tests (pure: no ray, no torch; milliseconds each)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# nothing downloads: a hub id not in the cache is AF345 at check (its example relies on this)
os.environ["HF_HUB_OFFLINE"] = "1"

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "pipelines"
GOLDEN = Path(__file__).resolve().parent / "golden"


def pipeline_files(*suffixes: str) -> list[Path]:
    """The canonical pipelines, sorted; ``.af`` ones only where the .af front end exists."""
    suffixes = suffixes or (".yaml", ".yml", ".af")
    files = sorted(p for p in PIPELINES.iterdir() if p.suffix in suffixes)
    return [p for p in files if p.suffix != ".af" or has_af_front()]


def has_af_front() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("asyncflow.dsl.af_front") is not None
    except ImportError:
        return False


def position(text: str, at: str) -> tuple[int, int]:
    """1-based (line, col) of the first ``at`` in ``text``; ``@LINE:COL`` is an explicit one."""
    if at.startswith("@") and ":" in at:
        line, col = at[1:].split(":")
        return int(line), int(col)
    k = text.index(at)
    return text.count("\n", 0, k) + 1, k - (text.rfind("\n", 0, k) + 1) + 1


@pytest.fixture
def write(tmp_path):
    """write(text, suffix=".yaml", name="pipeline") -> the path of a fresh file holding text."""

    def _write(text: str | bytes, suffix: str = ".yaml", name: str = "pipeline") -> Path:
        p = tmp_path / f"{name}{suffix}"
        if isinstance(text, bytes):
            p.write_bytes(text)
        else:
            p.write_text(text, encoding="utf-8")
        return p

    return _write


def pytest_terminal_summary(terminalreporter):
    """How many fuzz cases each strategy ran (compiler_tests/test_fuzz.py)."""
    import sys

    fuzz = sys.modules.get("test_fuzz")
    counts = getattr(fuzz, "COUNTS", None)
    if counts:
        total = sum(counts.values())
        parts = ", ".join(f"{k} {v}" for k, v in counts.items())
        terminalreporter.write_line(f"fuzz: {total} cases ({parts})")
