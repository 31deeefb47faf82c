"""The pass runner and pipeline (asyncflow/compiler/runner.py, pipeline.py), and the AF4xx table.

    parse -> build IR -> validate -> staleness -> placement -> overlap -> lower -> cost
"""
import pytest

from asyncflow.compiler import (PASS_NAMES, Context, Pass, PassFailed, compile_file, compile_pipeline,
                                compile_text, run_passes, verify)
from asyncflow.diagnostics import table
from asyncflow.diagnostics.examples import BASE
from asyncflow.errors import InternalError, UserError
from asyncflow.plan import Plan


def test_pass_order():
    assert PASS_NAMES == ["parse", "build IR", "validate", "bind", "staleness", "placement", "overlap",
                          "lower", "cost"]


def test_compile_base_to_plan_with_verify():
    plan = compile_text(BASE, "base.yaml", verify=True)
    assert isinstance(plan, Plan) and plan.estimate is not None


def test_compile_pipeline_from_ast():
    from asyncflow.dsl.load import load_text

    p = load_text(BASE, "base.yaml")
    assert compile_pipeline(p) == compile_text(BASE, "base.yaml")


def test_internal_error_names_the_pass_and_those_before():
    def boom(g, ctx):
        raise KeyError("x")

    passes = [Pass("one", lambda v, c: v), Pass("two", lambda v, c: v), Pass("bad", boom)]
    with pytest.raises(InternalError) as e:
        run_passes(passes, 1, Context())
    assert isinstance(e.value, PassFailed)
    assert e.value.pass_name == "bad" and e.value.before == ["one", "two"]
    assert "'bad'" in str(e.value) and "one, two" in str(e.value)


def test_stops_after_validate_with_all_user_errors(monkeypatch):
    """Two mistakes -> one UserError with both; no later pass runs."""
    import asyncflow.compiler.passes.staleness as st

    ran = []
    monkeypatch.setattr(st, "staleness", lambda g, c: ran.append(1) or g)
    text = BASE.replace("fn: asyncflow.rewards:digits_match", "fn: asyncflow.rewards:nope") \
               .replace("estimator: grpo", "estimator: grpoo")
    with pytest.raises(UserError) as e:
        compile_text(text, "bad.yaml")
    assert len(e.value.diagnostics) >= 2 and not ran


def test_dump_after_staleness_is_graph_dump():
    text = compile_text(BASE, "base.yaml", dump_after="staleness")
    assert text.startswith("graph base\n")
    assert "lag=1" in text and "capacity=" in text and "granularity" not in text
    assert compile_text(BASE, "base.yaml", dump_after="lower").lstrip().startswith("{")
    with pytest.raises(ValueError):
        compile_text(BASE, "base.yaml", dump_after="nope")


def test_verify_catches_a_missing_annotation():
    g = compile_text(BASE, "base.yaml", stop_after="staleness")
    verify(g, "staleness")
    del g.meta("score")["lag"]
    with pytest.raises(InternalError, match="after staleness"):
        verify(g, "staleness")


def test_compile_file_records_a_relative_path(tmp_path, monkeypatch):
    f = tmp_path / "sub" / "p.yaml"
    f.parent.mkdir()
    f.write_text(BASE)
    monkeypatch.chdir(tmp_path)
    assert compile_file(str(f)).source_file == "sub/p.yaml"


AF4 = [(c.code, i, ex) for c in table().values() if c.code.startswith("AF4")
       for i, ex in enumerate(c.examples)]


@pytest.mark.parametrize("code,i,ex", AF4, ids=[f"{c}-{i}" for c, i, _ in AF4])
def test_af4xx_examples(code, i, ex):
    """Every AF4xx example reports exactly its code at the first `at`.

    AF401 duplicates validate's device-count rule, so it is checked on placement alone."""
    from asyncflow.compiler.passes.placement import placement

    ctx = Context()
    if code == "AF401":
        g = compile_text(ex.text, "ex.yaml", stop_after="build IR")
        placement(g, ctx)
        found = ctx.diags.items
    else:
        try:
            compile_text(ex.text, "ex.yaml", sets=ex.sets, ctx=ctx)
            found = ctx.diags.items
        except UserError as e:
            found = e.diagnostics
    assert [d.code for d in found] == [code]
    off = ex.text.index(ex.at)
    line = ex.text.count("\n", 0, off) + 1
    col = off - (ex.text.rfind("\n", 0, off) + 1) + 1
    assert (found[0].loc.line, found[0].loc.col) == (line, col)
