"""Golden text dumps of the IR (``Graph.dump()``) of every canonical pipeline.

A change to the IR or to a pipeline shows up here as a diff to review. Regenerate with
``ASYNCFLOW_UPDATE_GOLDEN=1 pytest compiler_tests/test_ir_golden.py``. A ``.af`` pipeline with the
stem of a ``.yaml`` one must give the same graph (both front ends build one AST).
"""
from __future__ import annotations

import os

import pytest

from asyncflow.check import check_file

from conftest import GOLDEN, pipeline_files

UPDATE = os.environ.get("ASYNCFLOW_UPDATE_GOLDEN") == "1"
DIR = GOLDEN / "ir"


@pytest.mark.parametrize("path", pipeline_files(), ids=lambda p: p.name)
def test_ir_dump_matches_golden(path):
    _, graph = check_file(str(path))
    text = graph.dump()
    golden = DIR / f"{path.stem}.txt"
    if UPDATE and path.suffix != ".af":
        DIR.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"no golden dump {golden.name}: run with ASYNCFLOW_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"IR of {path.name} changed; review, then regenerate"


def test_every_golden_has_its_pipeline():
    stems = {p.stem for p in pipeline_files()}
    stale = [g.name for g in DIR.glob("*.txt") if g.stem not in stems]
    assert not stale, f"golden dumps without a pipeline: {stale}"


def test_dump_is_deterministic():
    path = pipeline_files(".yaml")[0]
    assert check_file(str(path))[1].dump() == check_file(str(path))[1].dump()
