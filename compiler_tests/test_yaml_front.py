"""The YAML front end: locations, typed scalars, syntax errors, the schema builder."""
import pytest

from asyncflow.diagnostics import Diagnostics
from asyncflow.dsl.emit import emit_yaml
from asyncflow.dsl.load import load_file, load_text
from asyncflow.dsl.tree import Map
from asyncflow.dsl.yaml_front import parse_yaml

GRPO = "pipelines/grpo_digits.yaml"


def test_every_value_has_its_line_and_column():
    p = load_file(GRPO)
    lines = open(GRPO).read().splitlines()
    for t in p.tasks.values():
        for path, loc in t.locs.items():
            assert loc.file == GRPO
            line = lines[loc.line - 1]
            if "." not in path and path not in ("inputs", "outputs", "args", "keep", "cost"):
                # the value written at that place is the value in the AST
                assert line[loc.col - 1:].startswith(str(getattr(t, path)).lower()[:3]) or \
                    line[loc.col - 1:].startswith(str(getattr(t, path))[:3]), (path, line)
    gen = p.tasks["generate"]
    assert gen.loc.line == lines.index("  generate:") + 1 and gen.loc.col == 3
    assert lines[gen.locs["inputs.0"].line - 1][gen.locs["inputs.0"].col - 1:].startswith("prompt")


def test_keys_keep_their_written_text():
    d = Diagnostics()
    tree = parse_yaml("on: 1\n1: 2\nyes: 3\n", "t.yaml", d)
    assert isinstance(tree, Map) and list(tree.entries) == ["on", "1", "yes"]


@pytest.mark.parametrize("text,code,line,col", [
    ("pipeline: x\ntasks: [a\n", "AF101", 3, 1),
    ("", "AF102", 1, 1),
    ("a: 1\na: 2\n", "AF103", 2, 1),
    ("a: 1\n<<: {b: 1}\n", "AF105", 2, 1),
    ("pipeline: x\n  bad indent: 1\n", "AF101", 2, 13),
])
def test_syntax_errors_are_located(text, code, line, col):
    d = Diagnostics()
    parse_yaml(text, "t.yaml", d)
    (e,) = d.errors
    assert (e.code, e.loc.line, e.loc.col) == (code, line, col)


def test_independent_errors_all_reported():
    text = open(GRPO).read().replace("kind: reward", "kind: rewrd").replace("steps: 200", "steps: -3") \
        .replace("    estimator: grpo", "    estimatr: grpo")
    d = Diagnostics()
    load_text(text, "t.yaml", diags=d)
    assert sorted(x.code for x in d.errors) == ["AF201", "AF205", "AF206"]
    unknown = next(x for x in d.errors if x.code == "AF201")
    assert unknown.hint == "did you mean 'estimator'?"


def test_defaults_and_types():
    p = load_file(GRPO)
    assert p.tasks["score"].replicas == 1 and p.tasks["score"].pool is None
    assert p.step.samples_per_step == 256
    assert p.models["reference"].frozen is True and p.models["reference"].copy_of == "policy"


def test_canonical_yaml_round_trips():
    p = load_file(GRPO)
    text = emit_yaml(p)
    assert load_text(text, "again.yaml") == p
    assert emit_yaml(load_text(text, "again.yaml")) == text  # fmt is idempotent


def test_a_string_that_looks_like_a_number_stays_a_string():
    text = open(GRPO).read().replace("description: GRPO on the digits task, async with staleness 1",
                                     "description: '1.5'")
    p = load_text(text, "t.yaml")
    assert p.description == "1.5"
    assert load_text(emit_yaml(p), "t2.yaml").description == "1.5"
