"""The .af text DSL: grammar, round trips through both emitters, locations, syntax errors."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow.diagnostics import Diagnostics, table
from asyncflow.dsl.af_emit import emit_af
from asyncflow.dsl.af_front import parse_af, parser
from asyncflow.dsl.emit import emit_yaml
from asyncflow.dsl.load import load_file, load_text
from asyncflow.dsl.tree import plain

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ROOT / "pipelines"
AF_FILES = sorted(PIPELINES.glob("*.af"))
ALL_FILES = sorted(PIPELINES.glob("*.yaml")) + AF_FILES
GRPO_AF = (PIPELINES / "grpo_digits.af").read_text()


def load(text: str, path: str = "t.af"):
    d = Diagnostics()
    p = load_text(text, path, (), d)
    return p, d


def at(text: str, sub: str, start: int = 0) -> tuple[int, int]:
    off = text.index(sub, start)
    return text.count("\n", 0, off) + 1, off - (text.rfind("\n", 0, off) + 1) + 1


# -- the grammar and the shipped pipelines ---------------------------------------------------
def test_there_are_af_pipelines():
    assert (PIPELINES / "grpo_digits.af") in AF_FILES


@pytest.mark.parametrize("path", AF_FILES, ids=lambda p: p.name)
def test_grammar_parses_every_af_file(path):
    parser().parse(path.read_text())
    p, d = load(path.read_text(), str(path))
    assert p is not None and not d.items, [x.headline() for x in d.items]


@pytest.mark.parametrize("path", AF_FILES, ids=lambda p: p.name)
def test_af_file_equals_its_yaml(path):
    twin = path.with_suffix(".yaml")
    if not twin.exists():
        pytest.skip("no YAML twin")
    assert load_file(path) == load_file(twin)


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: p.name)
def test_fmt_round_trips(path):
    p = load_file(path)
    af = emit_af(p)
    assert load(af)[0] == p
    assert load_text(emit_yaml(p), "t.yaml") == p
    assert emit_af(load(af)[0]) == af  # canonical: a fixed point


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: p.name)
def test_af_tree_has_the_yaml_shape(path):
    p = load_file(path)
    d = Diagnostics()
    af_tree = parse_af(emit_af(p), "t.af", d)
    from asyncflow.dsl.yaml_front import parse_yaml

    y_tree = parse_yaml(emit_yaml(p), "t.yaml", Diagnostics())
    assert plain(af_tree) == plain(y_tree)
    assert list(plain(af_tree)) == list(plain(y_tree))


# -- the syntax -------------------------------------------------------------------------------
MINI = """
pipeline p
step prompts_per_step=1 steps=1
task t: custom() { fn=m:f }
"""


def test_values_keep_their_types():
    text = MINI.replace("fn=m:f", """fn=m:f args {
        i=1 neg=-3 big=10_000 f=1.0e-4 g=3e-5 h=.5 inf=.inf ninf=-.inf
        t=true n=null s="1" w=word dotted=a.b.c ref=a.b:c list=[1, "x", [true], {}] nested={ k={ j=[] } }
        model=policy seed=1 true=false "odd key"="v\\n\\u00e9"
      }""")
    p, d = load(text)
    assert not d.items, [x.headline() for x in d.items]
    assert p.tasks["t"].args == {
        "i": 1, "neg": -3, "big": 10000, "f": 1e-4, "g": 3e-5, "h": 0.5, "inf": float("inf"),
        "ninf": float("-inf"), "t": True, "n": None, "s": "1", "w": "word", "dotted": "a.b.c",
        "ref": "a.b:c", "list": [1, "x", [True], {}], "nested": {"k": {"j": []}},
        "model": "policy", "seed": 1, "true": False, "odd key": "v\n\u00e9",
    }
    assert isinstance(p.tasks["t"].args["f"], float) and isinstance(p.tasks["t"].args["i"], int)


def test_whitespace_and_comments_do_not_matter():
    one = "pipeline p step prompts_per_step=1 steps=1 task t:custom(){fn=m:f}"
    many = "# c\npipeline\n  p # name\nstep\nprompts_per_step = 1,\n steps=1\ntask t :\n custom ( )\n{\nfn =\n m:f\n}\n"
    assert load(one)[0] == load(many)[0] == load(MINI)[0] is not None


def test_keywords_are_fine_as_names_and_keys():
    text = """
    pipeline task
    model model = m:f(model=1, data=2, seed=3)
    data data = m:g -> task, model
    pool pool(devices=1)
    step prompts_per_step=1 steps=1
    task step: rollout(task, model) -> sync { engine=hf model=model pool=pool args { copy=frozen } }
    task sync: train(sync) { engine=hf model=model pool=pool loss=grpo }
    sync sync -> step max_staleness=0
    """
    p, d = load(text)
    assert p is not None, [x.headline() for x in d.items]
    assert p.name == "task" and p.models["model"].args == {"model": 1, "data": 2, "seed": 3}
    assert p.tasks["step"].inputs == ("task", "model") and p.tasks["step"].args == {"copy": "frozen"}
    assert load(emit_af(p))[0] == p


def test_every_key_can_also_go_in_braces():
    text = """
    pipeline p
    model m { init=a:b args={ x=1 } copy_of=n frozen=true }
    data d { source="data/x.jsonl" fields=[a] }
    pool q { devices=2 resources={ accel=1 } }
    step { prompts_per_step=2 samples_per_prompt=2 steps=3 }
    task t { kind=custom fn=m:f inputs=[a] outputs=[] keep=[a] batched=true cost={ s=1 } }
    sync t -> t { max_staleness=0 }
    """
    p, d = load(text)
    assert p is not None, [x.headline() for x in d.items]
    m = p.models["m"]
    assert (m.init, m.args, m.copy_of, m.frozen) == ("a:b", {"x": 1}, "n", True)
    assert p.pools["q"].resources == {"accel": 1} and p.step.samples_per_prompt == 2
    assert p.tasks["t"].keep == ("a",) and p.tasks["t"].batched is True
    assert load(emit_af(p))[0] == p


def test_fmt_quotes_strings_that_would_change_type():
    text = MINI.replace("fn=m:f", 'fn=m:f args { a="1" b="true" c="null" d="1e-4" e="" f="a b" g="model" h="x-y" }')
    p = load(text)[0]
    out = emit_af(p)
    assert 'a="1"' in out and 'b="true"' in out and 'e=""' in out and 'h="x-y"' in out
    assert load(out)[0] == p


# -- locations ------------------------------------------------------------------------------
def test_locations_point_into_the_af_source():
    p, d = load(GRPO_AF, "g.af")
    assert not d.items
    assert (p.models["policy"].loc.line, p.models["policy"].loc.col) == at(GRPO_AF, "policy =")
    init = p.models["policy"].locs["init"]
    assert (init.line, init.col) == at(GRPO_AF, "asyncflow.models:tiny_decoder")
    assert init.end_col - init.col == len("asyncflow.models:tiny_decoder")
    lr = p.tasks["update"].locs["args.lr"]
    assert (lr.line, lr.col) == at(GRPO_AF, "1.0e-3")
    inp = p.tasks["score"].locs["inputs.2"]
    assert (inp.line, inp.col) == at(GRPO_AF, "response) -> reward")
    frozen = p.models["reference"].locs["frozen"]
    assert (frozen.line, frozen.col) == at(GRPO_AF, "frozen")
    s = p.sync[0].locs["max_staleness"]
    assert (s.line, s.col) == at(GRPO_AF, "1\n", GRPO_AF.index("sync update"))
    assert (p.step.locs["steps"].line, p.step.locs["steps"].col) == at(GRPO_AF, "200", GRPO_AF.index("steps=200"))
    assert (p.tasks["generate"].loc.line, p.tasks["generate"].loc.col) == at(GRPO_AF, "generate:")


def test_schema_errors_point_into_the_af_source():
    text = GRPO_AF.replace("estimator=grpo", "estimater=grpo").replace("steps=200", "steps=two")
    _, d = load(text, "g.af")
    got = {(x.code, x.loc.line, x.loc.col) for x in d.items}
    assert ("AF201", *at(text, "estimater")) in got
    assert ("AF202", *at(text, "two")) in got


# -- syntax errors ----------------------------------------------------------------------------
AF_EXAMPLES = [(code, ex) for code, c in table().items() for ex in c.examples if ex.suffix == ".af"]


def test_every_af_code_has_an_example():
    codes = {code for code, _ in AF_EXAMPLES}
    assert {f"AF{n}" for n in range(110, 122)} <= codes


@pytest.mark.parametrize("code,ex", AF_EXAMPLES, ids=[f"{c}-{i}" for i, (c, _) in enumerate(AF_EXAMPLES)])
def test_syntax_error_examples(code, ex):
    p, d = load(ex.text, "ex.af")
    assert p is None
    assert [(x.code, x.loc.line, x.loc.col) for x in d.items] == [(code, *at(ex.text, ex.at))]


@pytest.mark.parametrize("text,code,sub", [
    ("pipeline a\npipeline b\n", "AF103", "pipeline b"),
    ("pipeline a\nmodel m = a:b\nmodel m = a:c\n", "AF103", "m = a:c"),
    ("pipeline a\ntask t: custom() { fn=a:b fn=a:c }\n", "AF103", "fn=a:c"),
    ("pipeline a\ntask t: custom(x) { inputs=[y] }\n", "AF103", "inputs"),
    ("pipeline a\nstep steps=1\nstep steps=2\n", "AF103", "step steps=2"),
    ("pipeline a\nmodel m = a:b(x=1, x=2)\n", "AF103", "x=2"),
])
def test_duplicates(text, code, sub):
    _, d = load(text)
    assert (code, *at(text, sub)) in [(x.code, x.loc.line, x.loc.col) for x in d.items]


@pytest.mark.parametrize("text", ["", "   \n", "# only a comment\n"])
def test_empty_file(text):
    p, d = load(text)
    assert p is None and [x.code for x in d.items] == ["AF102"]


def test_rendered_message_has_a_caret():
    _, d = load("pipeline a\nstep steps: 2\n", "r.af")
    assert d.items[0].render().splitlines() == [
        "r.af:2:11: AF117 use '=' between a key and its value, not ':'",
        "    step steps: 2",
        "              ^",
    ]


# -- never an exception -----------------------------------------------------------------------
def _tokens(text: str) -> list[str]:
    return [t.value for t in parser().lex(text)]


_GRPO_TOKENS = _tokens(GRPO_AF)


def _check_quietly(text: str) -> None:
    d = Diagnostics()
    root = parse_af(text, "fuzz.af", d)
    assert root is not None or d.errors
    for x in d.items:
        assert x.code in table()
        x.render()
    if root is not None:
        load_text(text, "fuzz.af", (), Diagnostics())  # the builder copes with any tree


FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(raw):
    _check_quietly(raw.decode("utf-8", errors="replace"))


@FUZZ
@given(st.lists(st.sampled_from(list('abt =:{}[](),->"#\n.1e-+\\_') + ["task", "model", "step", "sync"]),
                max_size=60))
def test_fuzz_dsl_alphabet(pieces):
    _check_quietly("".join(pieces))


@FUZZ
@given(st.randoms(use_true_random=False), st.integers(1, 4))
def test_fuzz_token_edits(rnd: random.Random, n):
    toks = list(_GRPO_TOKENS)
    for _ in range(n):
        i, j = rnd.randrange(len(toks)), rnd.randrange(len(toks))
        op = rnd.choice(("delete", "swap", "duplicate"))
        if op == "delete":
            del toks[i]
        elif op == "swap":
            toks[i], toks[j] = toks[j], toks[i]
        else:
            toks.insert(i, toks[j])
    _check_quietly(" ".join(toks))


@FUZZ
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=10))
def test_fuzz_args_round_trip(value):
    p = load(MINI)[0]
    import dataclasses

    t = dataclasses.replace(p.tasks["t"], args={"v": value})
    q = dataclasses.replace(p, tasks={"t": t})
    back, d = load(emit_af(q))
    assert back == q, [x.headline() for x in d.items]
