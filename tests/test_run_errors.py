"""Run-time user errors (AF6xx): located, coded, exit 2, never an internal error."""
from pathlib import Path

import pytest
from shared_runs import cli_result

from asyncflow.compiler.pipeline import compile_file
from asyncflow.errors import UserError
from asyncflow.runtime.data import load_prompts

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


def _line_of(p, needle):
    return next(i for i, x in enumerate(p.read_text().splitlines(), 1) if needle in x)


@pytest.mark.parametrize("data,code,where", [
    ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n', "AF601", ("rows.jsonl", 2)),
    # a missing or null field: at that field in the pipeline's `fields:` list
    ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n', "AF603", ("p.yaml", "fields:")),
    ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": null}\n', "AF605",
     ("p.yaml", "fields:")),
    ("\n", "AF602", ("p.yaml", "source:")),
])
def test_bad_data_is_a_located_user_error(tmp_path, data, code, where):
    p = _pipeline(tmp_path, data)
    with pytest.raises(UserError) as ei:
        load_prompts(compile_file(str(p)))
    (d,) = ei.value.diagnostics
    file, line = where
    assert d.code == code and d.loc.file.endswith(file)
    assert d.loc.line == (line if isinstance(line, int) else _line_of(p, line))
    if code in ("AF603", "AF605"):  # the caret is under the field itself
        text = p.read_text().splitlines()[d.loc.line - 1]
        assert text[d.loc.col - 1:].startswith("answer")


def test_a_factory_that_raises_is_located_at_the_source(tmp_path):
    (tmp_path / "badfactory.py").write_text("def rows(n=1, seed=0):\n    return 1 / 0\n")
    text = (ROOT / "pipelines/sim_longtail.yaml").read_text()
    p = tmp_path / "p.yaml"
    p.write_text(text.replace("asyncflow.datasets:digits", "badfactory:rows"))
    with pytest.raises(UserError) as ei:
        load_prompts(compile_file(str(p)))
    (d,) = ei.value.diagnostics
    assert d.code == "AF601" and "ZeroDivisionError" in d.message
    assert d.loc.line == _line_of(p, "source:")


def test_fewer_prompts_than_the_run_needs_warns_or_is_an_error_with_epochs(tmp_path):
    rows = "".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(5))
    p = _pipeline(tmp_path, rows)  # sim_longtail: 20 steps x 32 prompts = 640 needed, 5 given
    warned = []
    load_prompts(compile_file(str(p)), warn=warned.append)
    assert len(warned) == 1 and "reads them 128 times" in warned[0] and "epochs: 128" in warned[0]
    text = p.read_text().replace("fields: [prompt, answer]", "fields: [prompt, answer]\n    epochs: 128")
    p.write_text(text)
    warned.clear()
    load_prompts(compile_file(str(p)), warn=warned.append)
    assert warned == []  # said so: no warning
    p.write_text(text.replace("epochs: 128", "epochs: 3"))
    with pytest.raises(UserError) as ei:
        load_prompts(compile_file(str(p)), warn=warned.append)
    (d,) = ei.value.diagnostics
    assert d.code == "AF606" and d.loc.line == _line_of(p, "epochs: 3")


def test_cli_exits_2_with_the_data_file_line(tmp_path, capsys):
    p = _pipeline(tmp_path, '{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n')
    r = cli_result(capsys, "run", str(p), "--backend", "local", "--steps", "1", "--out",
                   str(tmp_path / "run"), "--quiet")
    assert r.returncode == 2, r.stderr
    assert "rows.jsonl:2:1: AF601" in r.stderr and "Traceback" not in r.stderr


def test_asyncflow_variables_become_run_options_read_only_by_the_cli():
    """ASYNCFLOW_* are read by `asyncflow run` alone (env_options) into RunOptions, which the
    driver hands down: the workers' options carry the call bound; a bad value is a bad
    parameter, not a crash at import time."""
    import typer

    from asyncflow.commands.run import env_options
    from asyncflow.runtime.driver import Driver
    from asyncflow.runtime.options import RunOptions

    env = {"ASYNCFLOW_CALL_TIMEOUT_S": "7.5", "ASYNCFLOW_PG_TIMEOUT_S": "30",
           "ASYNCFLOW_RAY_FULL": "1", "PATH": "/bin"}
    assert env_options(env) == {"call_timeout_s": 7.5, "pg_timeout_s": 30.0, "ray_full": True}
    assert env_options({}) == {}
    for bad in ("soon", "0"):
        with pytest.raises(typer.BadParameter, match="ASYNCFLOW_CALL_TIMEOUT_S"):
            env_options({"ASYNCFLOW_CALL_TIMEOUT_S": bad})
    plan = compile_file(str(ROOT / "pipelines/sim_longtail.yaml"))
    d = Driver(plan, run=RunOptions(call_timeout_s=7.5), steps=2)
    assert d.options["call_timeout_s"] == 7.5 and d.run_options.backend == "local"
    assert d.plan.step.steps == 2 and plan.step.steps != 2  # --steps: a new plan, once
