"""Run-time user errors (AF6xx): located, coded, exit 2, never an internal error."""
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow.compiler.pipeline import compile_file
from asyncflow.errors import UserError
from asyncflow.runtime.driver import load_prompts

ROOT = Path(__file__).resolve().parents[1]


def _pipeline(tmp_path, data_text):
    (tmp_path / "rows.jsonl").write_text(data_text)
    text = (ROOT / "pipelines/sim_longtail.yaml").read_text()
    text = text.replace("source: asyncflow.datasets:digits", "source: rows.jsonl")
    text = text.replace("args: {n: 10000, seed: 0}", "args: {}")
    assert "rows.jsonl" in text
    p = tmp_path / "p.yaml"
    p.write_text(text)
    return p


def test_jsonl_beside_the_pipeline_is_read(tmp_path):
    p = _pipeline(tmp_path, '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4", "x": 1}\n')
    rows = load_prompts(compile_file(str(p)))
    assert rows == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


@pytest.mark.parametrize("data,code,line", [
    ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n', "AF601", 2),
    ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n', "AF603", 1),
    ("\n", "AF602", 1),
])
def test_bad_data_is_a_located_user_error(tmp_path, data, code, line):
    p = _pipeline(tmp_path, data)
    with pytest.raises(UserError) as ei:
        load_prompts(compile_file(str(p)))
    (d,) = ei.value.diagnostics
    assert d.code == code and d.loc.line == line


def test_cli_exits_2_with_the_data_file_line(tmp_path):
    p = _pipeline(tmp_path, '{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n')
    r = subprocess.run([sys.executable, "-m", "asyncflow.cli", "run", str(p), "--backend", "local",
                        "--steps", "1", "--out", str(tmp_path / "run"), "--quiet"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "rows.jsonl:2:1: AF601" in r.stderr and "Traceback" not in r.stderr
