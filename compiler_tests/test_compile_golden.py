"""`asyncflow compile --json` of every pipelines/*.yaml matches compiler_tests/golden/compile/.

Regenerate with ASYNCFLOW_UPDATE_GOLDEN=1 (the plan records paths relative to the repository
root, where this test runs the compiler, so goldens are machine-independent).
"""
import os
from pathlib import Path

import pytest

from asyncflow.compiler import compile_file
from asyncflow.plan import Plan

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden" / "compile"
PIPELINES = sorted((ROOT / "pipelines").glob("*.yaml"))


@pytest.mark.parametrize("path", PIPELINES, ids=[p.stem for p in PIPELINES])
def test_compile_json_golden(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    plan = compile_file(f"pipelines/{path.name}")
    text = plan.to_json()
    assert Plan.from_json(text) == plan  # round trip
    golden = GOLDEN / f"{path.stem}.json"
    if os.environ.get("ASYNCFLOW_UPDATE_GOLDEN") == "1" or not golden.exists():
        if os.environ.get("ASYNCFLOW_UPDATE_GOLDEN") != "1":
            pytest.fail(f"no golden {golden.name}: rerun with ASYNCFLOW_UPDATE_GOLDEN=1")
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), f"{golden.name} differs: rerun with ASYNCFLOW_UPDATE_GOLDEN=1"


def test_every_golden_has_a_pipeline():
    assert {p.stem for p in GOLDEN.glob("*.json")} <= {p.stem for p in PIPELINES}
