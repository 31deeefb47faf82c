"""benchmarks/vs_trl.py: the asyncflow-vs-TRL comparison runs end to end and prints its table."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "vs_trl.py")


def _load():
    spec = importlib.util.spec_from_file_location("vs_trl", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_threshold_and_throughput_arithmetic():
    m = _load()
    steps = [{"step_time": 2.0, "samples": 16, "reward_mean": r}
             for r in (0.0, 0.2, 0.4, 0.4, 0.4, 0.4, 0.4)]
    steps[1]["step_time"] = 1.0
    assert m.steady_samples_per_s(steps) == pytest.approx(6 * 16 / 11.0)  # step 1 left out
    assert m.median_samples_per_s(steps) == pytest.approx(8.0)
    # steps 1..5 average 0.28 < 0.3; steps 2..6 average 0.36: reached at step 6, after 11 s
    assert m.time_to_threshold(steps, 0.3, 5) == (11.0, 6)
    assert m.time_to_threshold(steps, 0.9, 5) == (None, None)
    assert m.steady_samples_per_s(steps[:1]) is None


def test_tokenizer_ids_match_char_tokenizer():
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from asyncflow.models import CharTokenizer

    tok = _load().char_tokenizer_fast()  # asserts the ids itself
    ct = CharTokenizer()
    assert tok("rev 417=")["input_ids"] == [ct.bos_id] + ct.encode("rev 417=")
    assert len(tok) == ct.vocab_size


@pytest.mark.slow
def test_vs_trl_smoke():
    pytest.importorskip("trl")
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, SCRIPT, "--steps", "2", "--prompts-per-step", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "asyncflow/TRL" in out and "samples/s (steady, steps 2..N)" in out
    row = next(line for line in out.splitlines() if line.startswith("| samples/s (steady"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    float(cells[1]), float(cells[2])  # both sides measured
    assert cells[3].endswith("x")
    assert "failed" not in out


def test_exits_cleanly_without_trl(tmp_path):
    # a `trl` that cannot be imported shadows the installed one: the script says so, exits 0
    (tmp_path / "trl.py").write_text("raise ImportError('no trl here')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, SCRIPT, "--steps", "2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert "TRL is not installed" in proc.stdout
