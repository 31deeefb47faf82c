"""--set overrides: typing, list indices, creation of new keys, and located errors."""
import pytest

from asyncflow.diagnostics import Diagnostics
from asyncflow.dsl.load import load_file, load_text
from asyncflow.errors import UserError
from asyncflow.dsl.overrides import typed

GRPO = "pipelines/grpo_digits.yaml"


@pytest.mark.parametrize("text,value", [
    ("3e-5", 3e-5), ("1.0e-4", 1e-4), ("42", 42), ("-1", -1), ("true", True), ("False", False),
    ("null", None), ("hf", "hf"), ('"1"', "1"), ("[a, b]", ["a", "b"]), ("{x: 1}", {"x": 1}),
    ("asyncflow.rewards:digits_match", "asyncflow.rewards:digits_match"), (".5", 0.5),
])
def test_typed_values(text, value):
    assert typed(text) == value and type(typed(text)) is type(value)


def test_overrides_change_the_ast():
    p = load_file(GRPO, sets=["tasks.update.args.lr=3e-5", "sync.0.max_staleness=0",
                              "tasks.generate.replicas=2", "step.steps=3"])
    assert p.tasks["update"].args["lr"] == 3e-5
    assert p.sync[0].max_staleness == 0
    assert p.tasks["generate"].replicas == 2
    assert p.step.steps == 3
    # an override's location is the override itself
    assert p.sync[0].locs["max_staleness"].file == "--set[2]"


def test_override_creates_missing_keys():
    p = load_file(GRPO, sets=["tasks.score.args.scale=2", "tasks.score.replicas=3"])
    assert p.tasks["score"].args == {"scale": 2}
    assert p.tasks["score"].replicas == 3


def _codes(sets):
    d = Diagnostics()
    load_file(GRPO, sets=sets, diags=d)
    return [(x.code, x.loc.file, x.loc.col) for x in d.errors]


def test_wrong_path_is_located_in_the_override():
    assert _codes(["tasks.updat.args.lr=1"]) == [("AF502", "--set[1]", 7)]
    assert _codes(["sync.5.max_staleness=0"]) == [("AF503", "--set[1]", 6)]
    assert _codes(["step.steps.x=1"]) == [("AF504", "--set[1]", 12)]
    assert _codes(["nonsense"]) == [("AF501", "--set[1]", 1)]


def test_wrong_value_type_is_located_at_the_value():
    assert _codes(["step.steps=many"]) == [("AF202", "--set[1]", 12)]
    assert _codes(["tasks.update.kind=trian"]) == [("AF205", "--set[1]", 19)]


def test_unknown_key_through_override_names_it():
    d = Diagnostics()
    load_file(GRPO, sets=["tasks.update.lrr=1"], diags=d)
    (e,) = d.errors
    assert e.code == "AF201" and "lrr" in e.message and e.loc.file == "--set[1]"


def test_all_override_errors_reported_at_once():
    with pytest.raises(UserError) as ei:
        load_file(GRPO, sets=["tasks.x.kind=rollout", "step.steps=x", "bad"])
    assert sorted(d.code for d in ei.value.diagnostics) == ["AF202", "AF501", "AF502"]


def test_override_of_af_free_text_round_trip():
    text = open(GRPO).read()
    p = load_text(text, "x.yaml", sets=["description=changed here"])
    assert p.description == "changed here"
