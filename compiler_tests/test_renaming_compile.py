"""A field's name is the user's label: renaming fields consistently changes nothing but names.

For every pipeline in ``pipelines/``, a hypothesis strategy renames EVERY field (data fields,
task outputs and so every input and ``keep``) to fresh distinct identifiers, adversarial ones
included: names swapped between fields (``reward`` <-> ``advantages``, the response called
``logprobs`` and the log-probs ``response``), names of other roles, kinds, tasks, models and
keywords, long names, names with digits and underscores. The renamed file is written to a
temporary directory (YAML through ``yaml``; ``.af`` through the loader's AST and the project's
``.af`` emitter); a data source is wrapped by a small module next to it that renames its rows'
columns. Then:

- the renamed pipeline checks clean (the same diagnostic codes as the original: none);
- its plan equals the original's up to names: every field name in the renamed plan (wherever
  the plan holds field names: task inputs/outputs/keep, bindings, data/channel/op field lists,
  the ``fields`` table) is mapped back, ``source_file`` and data ``source`` are dropped, and the
  two plans are compared whole;
- the bindings are the roles the fields play (the shipped files name fields after their roles,
  so the original's bindings can be stated; the renamed one's must be the same roles).

Negative tests: ``check`` reports binding mistakes (AF370-AF375) at the task's line, exit 2.

The helpers here (``field_names``, ``renamings``, ``draw_renaming``, ``swap_renaming``,
``write_renamed``) are also used by ``tests/test_renaming.py``, which runs renamed pipelines.
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import inspect
import itertools
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = ROOT / "pipelines"
FILES = sorted(p for p in PIPELINES.iterdir() if p.suffix in (".yaml", ".yml", ".af"))
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # dsl/build.py's field-name rule

# -- names ---------------------------------------------------------------------------------------
# Names a user might well pick that mean something else somewhere: roles, slots, kinds, task /
# model / pool / source names of the shipped files, estimators, losses, .af and YAML keywords,
# Python keywords, plan keys; plus shapes (one letter, long, digits, underscores, case).
ADVERSARIAL = (
    "response", "logprobs", "ref_logprobs", "prox_logprobs", "values", "value", "reward",
    "rewards", "advantages", "advantage", "returns", "keep", "kept", "info", "custom", "data",
    "prompt", "prompts", "answer", "context", "score", "question", "completion", "lp", "adv",
    "ret", "generate", "update", "critic_update", "ref", "policy", "reference", "critic",
    "rollout", "train", "logprob", "filter", "grpo", "rloo", "gae", "ppo", "dapo", "sim", "hf",
    "engine", "model", "pool", "task", "step", "sync", "seed", "copy", "frozen", "pipeline",
    "inputs", "outputs", "fields", "source", "args", "kind", "name", "groups", "row", "rows",
    "true", "false", "null", "yes", "no", "on", "off", "True", "None", "NULL", "inf", "nan",
    "lambda", "class", "def", "import", "x", "y", "A", "Z9", "a1", "f_2_x", "x_", "x__y__",
    "r2d2", "reward_0", "advantages_1", "Response", "LOGPROBS", "veryLongFieldName" * 4,
    "n" + "_1" * 40,
)
# names that start with "_" are the store's own columns: refused by check (AF376, tested below)
IDENT = st.from_regex(r"\A[A-Za-z][A-Za-z0-9_]{0,47}\Z", fullmatch=True)


def field_names(p) -> list[str]:
    """Every field name of an AST pipeline, in order of first mention."""
    out: dict[str, None] = {}
    for d in p.data.values():
        out.update(dict.fromkeys(d.fields))
    for t in p.tasks.values():
        out.update(dict.fromkeys((*t.inputs, *t.outputs, *t.keep)))
    return list(out)


@functools.lru_cache(maxsize=None)
def names_of(path: Path) -> tuple[str, ...]:
    from asyncflow.dsl.load import load_file

    return tuple(field_names(load_file(str(path))))


def renamings(names) -> st.SearchStrategy[dict[str, str]]:
    """old -> new for every name: distinct valid identifiers, often swapped among the old
    names or taken from :data:`ADVERSARIAL`."""
    names = list(names)
    pool = sorted(set(names) | set(ADVERSARIAL))
    candidate = st.one_of(st.sampled_from(pool), IDENT)
    permuted = st.permutations(names).map(lambda new: dict(zip(names, new)))
    fresh = st.lists(candidate, min_size=len(names), max_size=len(names), unique=True).map(
        lambda new: dict(zip(names, new)))
    # a permutation of the old names with some of them then replaced by fresh ones
    mixed = st.tuples(st.permutations(names), st.lists(candidate, min_size=len(names),
                                                       max_size=len(names), unique=True),
                      st.lists(st.booleans(), min_size=len(names), max_size=len(names))).map(
        lambda t: _mix(names, *t))
    return st.one_of(permuted, fresh, mixed).filter(_valid)


def _mix(names, perm, fresh, take) -> dict[str, str]:
    new = [f if t else p for p, f, t in zip(perm, fresh, take)]
    return dict(zip(names, new))


def _valid(m: dict[str, str]) -> bool:
    return len(set(m.values())) == len(m) and all(NAME_RE.match(v) for v in m.values())


# The adversarial swap, stated: pairs of roles trade names; every other field gets a name of
# another role (or a long one).
SWAPS = (("prompt", "answer"), ("response", "logprobs"), ("reward", "advantages"),
         ("values", "returns"), ("ref_logprobs", "kept"))
SPARE = ("value", "info", "custom", "keep", "data", "score", "context")


def swap_renaming(names) -> dict[str, str]:
    names = list(names)
    m: dict[str, str] = {}
    for a, b in SWAPS:
        if a in names and b in names:
            m[a], m[b] = b, a
    spare = [s for s in SPARE if s not in names] + [f"renamed_{i}_{'x' * 30}" for i in range(50)]
    for n in names:
        if n not in m:
            m[n] = spare.pop(0)
    assert _valid(m) and m != {n: n for n in names}
    return m


def draw_renaming(names, seed: int) -> dict[str, str]:
    """A renaming drawn by a seeded ``random.Random`` (the run tests draw one per pipeline)."""
    rnd = random.Random(seed)
    names = list(names)
    pool = sorted((set(names) | set(ADVERSARIAL)))
    while True:
        new = []
        for _ in names:
            if rnd.random() < 0.7:
                new.append(rnd.choice(pool))
            else:
                alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"
                new.append(rnd.choice("abcxyzQR") + "".join(
                    rnd.choice(alphabet) for _ in range(rnd.randint(0, 40))))
        m = dict(zip(names, new))
        if _valid(m) and m != {n: n for n in names}:
            return m


# -- writing a renamed pipeline ------------------------------------------------------------------
_COUNTER = itertools.count()

WRAPPER = '''\
"""Rows of {source!r} with their columns renamed (written by the renaming tests)."""
import importlib

_SOURCE = {source!r}
_NEW = {new!r}


def rows(**kw):
    module, _, attr = _SOURCE.partition(":")
    fn = importlib.import_module(module)
    for part in attr.split("."):
        fn = getattr(fn, part)
    return [{{new: r[old] for old, new in _NEW.items()}} for r in fn(**kw)]
'''


def _wrap_source(source: str, fields, m: dict[str, str], src_dir: Path, out_dir: Path,
                 module: str) -> str:
    """A source whose rows carry the renamed columns: a renamed copy of a .jsonl file, or a
    module next to the pipeline wrapping the factory."""
    new = {f: m[f] for f in fields}
    if ":" not in source:  # a file of rows
        path = Path(source) if Path(source).is_absolute() else src_dir / source
        if not path.exists():
            path = ROOT / source
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        out = out_dir / f"{module}{path.suffix}"
        out.write_text("".join(json.dumps({new[k]: r[k] for k in fields}) + "\n" for r in rows))
        return out.name
    (out_dir / f"{module}.py").write_text(WRAPPER.format(source=source, new=new))
    return f"{module}:rows"


def rename_yaml(text: str, m: dict[str, str], src_dir: Path, out_dir: Path, module: str) -> str:
    doc = yaml.safe_load(text)
    for i, (name, d) in enumerate((doc.get("data") or {}).items()):
        fields = list(d.get("fields") or [])
        d["source"] = _wrap_source(d["source"], fields, m, src_dir, out_dir,
                                   module if i == 0 else f"{module}_{i}")
        d["fields"] = [m[f] for f in fields]
    for t in doc["tasks"].values():
        for key in ("inputs", "outputs", "keep"):
            if key in t:
                t[key] = [m[f] for f in t[key]]
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def rename_ast(p, m: dict[str, str], src_dir: Path, out_dir: Path, module: str):
    data = {}
    for i, (name, d) in enumerate(p.data.items()):
        source = _wrap_source(d.source, d.fields, m, src_dir, out_dir,
                              module if i == 0 else f"{module}_{i}")
        data[name] = dataclasses.replace(d, source=source, fields=tuple(m[f] for f in d.fields))
    tasks = {n: dataclasses.replace(t, inputs=tuple(m[f] for f in t.inputs),
                                    outputs=tuple(m[f] for f in t.outputs),
                                    keep=tuple(m[f] for f in t.keep))
             for n, t in p.tasks.items()}
    return dataclasses.replace(p, data=data, tasks=tasks)


def write_renamed(src: Path, m: dict[str, str], out_dir: Path, module: str | None = None) -> Path:
    """Write ``src`` renamed by ``m`` (and its data wrappers) into ``out_dir``; its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    module = module or f"renamed_data_{next(_COUNTER)}"
    out = out_dir / src.name
    if src.suffix == ".af":
        from asyncflow.dsl.af_emit import emit_af
        from asyncflow.dsl.load import load_file

        out.write_text(emit_af(rename_ast(load_file(str(src)), m, src.parent, out_dir, module)))
    else:
        out.write_text(rename_yaml(src.read_text(), m, src.parent, out_dir, module))
    return out


# -- plans up to names ---------------------------------------------------------------------------
FIELD_LISTS = ("inputs", "outputs", "keep", "fields")  # keys whose list values are field names
BINDINGS = ("bind_in", "bind_out")  # [[field, role], ...] (or {field: role})
FIELD_NAMES = ("reward_field",)  # keys whose string value is a field name (a worker's)


def unrename(v, back: dict[str, str], key: str | None = None):
    """``v`` with every field name (in the places a plan holds field names) mapped by ``back``.

    Only field places are mapped: a role, a kind, a task named like a renamed field (``reward``
    the kind, ``value`` the task) must stay as they are."""
    f = lambda s: back.get(s, s)  # noqa: E731
    if isinstance(v, dict):
        if key == "fields" or key in BINDINGS:  # the fields table / bindings keyed by field
            return {f(k): (x if key in BINDINGS else unrename(x, back)) for k, x in v.items()}
        return {k: unrename(x, back, k) for k, x in v.items()}
    if isinstance(v, list):
        if key in BINDINGS:
            return [[f(x[0]), *x[1:]] if isinstance(x, list) and x else x for x in v]
        if key in FIELD_LISTS and all(isinstance(x, str) for x in v):
            return [f(x) for x in v]
        return [unrename(x, back, None) for x in v]
    if key in FIELD_NAMES and isinstance(v, str):
        return f(v)
    return v


def _no_locs(v):
    """``v`` without source locations (``loc``: where a thing is written in the file, which the
    rewritten file moves)."""
    if isinstance(v, dict):
        return {k: _no_locs(x) for k, x in v.items() if k not in ("loc", "locs")}
    if isinstance(v, list):
        return [_no_locs(x) for x in v]
    return v


def comparable(plan: dict) -> dict:
    """The parts of a plan that must not change: all but the file, the data sources' ``source``
    (the renaming wrapper) and source locations."""
    plan = _no_locs(plan)
    plan.pop("source_file", None)
    plan["data"] = [{k: x for k, x in d.items() if k != "source"} for d in plan.get("data", [])]
    return plan


def differences(a, b, path: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ, as ``path: a != b`` lines (the first few)."""
    if type(a) is not type(b):
        return [f"{path}: {a!r} != {b!r}"]
    if isinstance(a, dict):
        out = [f"{path}.{k}: only in {'renamed' if k in a else 'original'}"
               for k in sorted(set(a) ^ set(b), key=str)]
        for k in a:
            if k in b:
                out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{path}: {a!r} != {b!r}"]
        return [x for i, (p, q) in enumerate(zip(a, b)) for x in differences(p, q, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def plan_of(path: Path) -> dict:
    from asyncflow.compiler.pipeline import compile_file

    return json.loads(compile_file(str(path)).to_json())


@functools.lru_cache(maxsize=None)
def original_plan(path: Path) -> str:
    return json.dumps(plan_of(path))


def diagnostics_of(path: Path) -> list:
    from asyncflow.check import check_file
    from asyncflow.diagnostics import Diagnostics

    diags = Diagnostics()
    check_file(str(path), (), diags)
    return list(diags.items)


def bindings(plan: dict) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """task -> {"bind_in": [(field, role)], "bind_out": [...]} of a plan."""
    out = {}
    for t in plan["tasks"]:
        out[t["name"]] = {}
        for key in BINDINGS:
            assert key in t, f"the plan's task {t['name']!r} has no {key!r}"
            b = t[key]
            pairs = list(b.items()) if isinstance(b, dict) else [tuple(x) for x in b]
            out[t["name"]][key] = pairs
    return out


def fields_table(plan: dict) -> dict[str, str]:
    """field -> role, from the plan's ``fields`` table."""
    assert "fields" in plan, "the plan has no 'fields' table"
    tab = plan["fields"]
    if isinstance(tab, list):
        tab = {x["name"]: x for x in tab}
    return {f: (x["role"] if isinstance(x, dict) else x) for f, x in tab.items()}


TMP = Path(tempfile.mkdtemp(prefix="asyncflow-renaming-"))  # the property's cases
atexit.register(shutil.rmtree, TMP, ignore_errors=True)
SETTINGS = settings(max_examples=25, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


# -- the property --------------------------------------------------------------------------------
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_renamed_plan_equals_original_up_to_names(path):
    orig = comparable(json.loads(original_plan(path)))
    orig_diags = sorted(d.code for d in diagnostics_of(path))
    orig_bind = bindings(orig)
    names = names_of(path)

    @SETTINGS
    @given(renamings(names))
    def prop(m):
        out = write_renamed(path, m, TMP / f"case{next(_COUNTER)}")
        diags = diagnostics_of(out)
        assert sorted(d.code for d in diags) == orig_diags, (
            m, [d.render() for d in diags], out.read_text())
        new = plan_of(out)
        back = {v: k for k, v in m.items()}
        diff = differences(comparable(unrename(new, back)), orig)
        assert not diff, (m, diff[:10])
        # the same roles, read straight off the renamed plan (no mapping back)
        for task, b in orig_bind.items():
            got = bindings(new)[task]
            for key in BINDINGS:
                assert got[key] == [(m[f], r) for f, r in b[key]], (m, task, key, got[key])
        roles = fields_table(new)
        for f, r in fields_table(orig).items():
            assert roles[m[f]] == r, (m, f, m[f], roles[m[f]], r)

    prop()


# -- the bindings are the roles ------------------------------------------------------------------
# The shipped files name fields after what they hold, so a field's role is its name, except:
ROLE_OF_OUTPUT = {"kept": "keep"}  # dapo's filter output: a keep flag
ROLE_OF_INPUT = {("agentic_multiturn", "generate", "answer"): "context",  # env's reset(row)
                 ("dapo", "advantage", "kept"): "keep"}


def _fn_params(target: str, args: dict, kind: str) -> list[str]:
    import importlib

    module, _, attr = target.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    skip = set(args) | ({"groups"} if kind == "filter" else set())
    P = inspect.Parameter
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD) and p.name not in skip]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_shipped_bindings_are_the_roles(path):
    plan = json.loads(original_plan(path))
    b = bindings(plan)
    for t in plan["tasks"]:
        name, kind = t["name"], t["kind"]
        assert [f for f, _ in b[name]["bind_out"]] == t["outputs"], (name, b[name])
        assert [f for f, _ in b[name]["bind_in"]] == t["inputs"], (name, b[name])
        for f, role in b[name]["bind_out"]:
            assert role == ROLE_OF_OUTPUT.get(f, f), (name, f, role)
        if t.get("fn"):  # a user function: input i is its i-th positional parameter
            params = _fn_params(t["fn"], t.get("args") or {}, kind)
            assert [r for _, r in b[name]["bind_in"]] == params[:len(t["inputs"])], (name, b[name])
        else:
            for f, role in b[name]["bind_in"]:
                assert role == ROLE_OF_INPUT.get((plan["pipeline"], name, f), f), (name, f, role)
    data = {f for d in plan["data"] for f in d["fields"]}
    for f, role in fields_table(plan).items():
        assert role == ("data" if f in data else ROLE_OF_OUTPUT.get(f, f)), (f, role)


def test_renamed_main_job_binds_the_rollouts_second_output_as_logprobs(tmp_path):
    """The issue's example: grpo_digits with the response called ``logprobs`` and the log-probs
    ``response``; the train task's field that is the rollout's second output is bound to role
    ``logprobs``, and the one that is its first to ``response``."""
    path = PIPELINES / "grpo_digits.yaml"
    m = swap_renaming(names_of(path))
    assert m["response"] == "logprobs" and m["logprobs"] == "response"
    assert m["reward"] == "advantages" and m["advantages"] == "reward"
    out = write_renamed(path, m, tmp_path)
    assert not [d for d in diagnostics_of(out) if d.severity == "error"]
    plan = plan_of(out)
    b = bindings(plan)
    gen_out = b["generate"]["bind_out"]
    assert gen_out == [("logprobs", "response"), ("response", "logprobs")]
    train_in = dict(b["update"]["bind_in"])
    assert train_in[gen_out[1][0]] == "logprobs" and train_in[gen_out[0][0]] == "response"
    assert train_in["reward"] == "advantages"  # the advantage task's output, named 'reward'
    assert dict(b["advantage"]["bind_in"])["advantages"] == "reward"
    roles = fields_table(plan)
    assert roles["response"] == "logprobs" and roles["logprobs"] == "response"
    assert roles["reward"] == "advantages" and roles["advantages"] == "reward"
    assert roles["answer"] == roles["prompt"] == "data"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_swap_renaming_compiles_to_the_same_plan(path, tmp_path):
    """The stated adversarial swap, for every file (fast, and named in a failure)."""
    m = swap_renaming(names_of(path))
    out = write_renamed(path, m, tmp_path)
    diags = diagnostics_of(out)
    assert not [d for d in diags if d.severity == "error"], [d.render() for d in diags]
    back = {v: k for k, v in m.items()}
    diff = differences(comparable(unrename(plan_of(out), back)),
                       comparable(json.loads(original_plan(path))))
    assert not diff, (m, diff[:10])


def test_af_renaming_goes_through_the_emitter(tmp_path):
    """The .af writer keeps everything but the names (the AST of the written file is the
    original's with fields renamed), including keyword-like names."""
    from asyncflow.dsl.load import load_file

    path = PIPELINES / "grpo_digits.af"
    names = names_of(path)
    m = dict(zip(names, ("true", "null", "data", "model", "step", "sync", "task", "frozen")))
    out = write_renamed(path, m, tmp_path, module="renamed_data")
    p, q = load_file(str(path)), load_file(str(out))
    assert [d.fields for d in q.data.values()] == [tuple(m[f] for f in d.fields)
                                                   for d in p.data.values()]
    assert q.data["prompts"].source == "renamed_data:rows"
    for n, t in p.tasks.items():
        assert q.tasks[n].inputs == tuple(m[f] for f in t.inputs)
        assert q.tasks[n].outputs == tuple(m[f] for f in t.outputs)
        assert dataclasses.replace(q.tasks[n], inputs=t.inputs, outputs=t.outputs) == t


# -- binding mistakes are located user errors -----------------------------------------------------
def _af_check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncflow.cli", "check", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=str(path.parent))


def _line_of(text: str, needle: str, after: str | None = None) -> int:
    start = text.index(after) if after else 0
    return text.count("\n", 0, text.index(needle, start)) + 1


def _edit(src: str, old: str, new: str, after: str | None = None) -> str:
    """``src`` with the first ``old`` (after ``after``) replaced by ``new``."""
    start = src.index(after) if after else 0
    k = src.index(old, start)
    return src[:k] + new + src[k + len(old):]


PPO = (PIPELINES / "ppo_gae.yaml").read_text()
GRPO = (PIPELINES / "grpo_digits.yaml").read_text()

# (id, base text, [(old, new, after)], code, the needle on the line the error must point at,
#  the section the needle is searched after)
MISTAKES = [
    # gae without per-token values (only the reward): its own code, AF332 (bind reports it
    # for an estimator that needs values; AF370 would do too), anywhere in the task
    ("gae-without-values", PPO,
     [("inputs: [reward, values]", "inputs: [reward]", "  advantage:"),
      ("inputs: [prompt, response]\n    outputs: [values]",
       "inputs: [prompt, response]\n    outputs: [values]\n    keep: [values]", "  value:")],
     ("AF370", "AF332"), None, "  advantage:"),
    # AF370: a ppo train task without advantages
    ("train-without-advantages", GRPO,
     [("inputs: [prompt, response, logprobs, ref_logprobs, advantages]",
       "inputs: [prompt, response, logprobs, ref_logprobs]", "  update:"),
      ("outputs: [advantages]", "outputs: [advantages]\n    keep: [advantages]", "  advantage:")],
     "AF370", "inputs: [prompt, response, logprobs, ref_logprobs]", "  update:"),
    # AF371: two data fields that could both be the train task's prompt
    ("train-two-prompts", GRPO,
     [("inputs: [prompt, response, logprobs, ref_logprobs, advantages]",
       "inputs: [prompt, answer, response, logprobs, ref_logprobs, advantages]", "  update:")],
     "AF371", "inputs: [prompt, answer, response", "  update:"),
    # AF372: a per-sample reward where the critic's loss needs per-token returns
    ("value-loss-given-reward", PPO,
     [("inputs: [prompt, response, values, returns]",
       "inputs: [prompt, response, values, reward]", "  critic_update:"),
      ("outputs: [advantages, returns]", "outputs: [advantages, returns]\n    keep: [returns]",
       "  advantage:")],
     "AF372", "inputs: [prompt, response, values, reward]", "  critic_update:"),
    # AF372: gae given the reference log-probs where the critic's values are needed
    ("gae-given-ref-logprobs", PPO,
     [("inputs: [reward, values]", "inputs: [reward, ref_logprobs]", "  advantage:"),
      ("outputs: [values]", "outputs: [values]\n    keep: [values]", "  value:")],
     "AF372", "inputs: [reward, ref_logprobs]", "  advantage:"),
    # AF373: an input with no place in a logprob task
    ("logprob-given-reward", GRPO,
     [("inputs: [prompt, response]\n    outputs: [ref_logprobs]",
       "inputs: [prompt, response, reward]\n    outputs: [ref_logprobs]", "  ref:")],
     "AF373", "inputs: [prompt, response, reward]", "  ref:"),
    # AF374: digits_match(prompt, answer, response) given two inputs
    ("reward-fn-arity", GRPO,
     [("inputs: [prompt, answer, response]", "inputs: [prompt, response]", "  score:")],
     "AF374", "inputs: [prompt, response]", "  score:"),
    # AF374: ... and five (its fourth parameter, ``partial``, has a default: four fit)
    ("reward-fn-arity-5", GRPO,
     [("inputs: [prompt, answer, response]",
       "inputs: [prompt, answer, response, logprobs, ref_logprobs]", "  score:")],
     "AF374", "inputs: [prompt, answer, response, logprobs, ref_logprobs]", "  score:"),
    # AF375: a rollout without env writes two outputs, not three
    ("rollout-three-outputs", GRPO,
     [("outputs: [response, logprobs]", "outputs: [response, logprobs, episode_return]\n"
       "    keep: [episode_return]", "  generate:")],
     "AF375", "outputs: [response, logprobs, episode_return]", "  generate:"),
    # AF375: a value task writes one output
    ("value-two-outputs", PPO,
     [("outputs: [values]", "outputs: [values, more_values]\n    keep: [more_values]",
       "  value:")],
     "AF375", "outputs: [values, more_values]", "  value:"),
]


def _task_block(text: str, section: str) -> range:
    """The lines of the task whose key line is ``section`` (up to the next key at its indent)."""
    lines = text.splitlines()
    first = _line_of(text, section + "\n")
    indent = len(section) - len(section.lstrip())
    last = next((i + 1 for i in range(first, len(lines))
                 if lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) <= indent),
                len(lines) + 1)
    return range(first, last)


@pytest.mark.parametrize("case", MISTAKES, ids=lambda c: c[0])
def test_binding_mistake_is_located(case, tmp_path):
    """Exit 2, the code, at ``file:line:`` -- the line of the needle (the inputs/outputs line),
    or, where no needle is given, a line of the task."""
    _, text, edits, codes, needle, section = case
    codes = (codes,) if isinstance(codes, str) else codes
    for old, new, after in edits:
        text = _edit(text, old, new, after)
    path = tmp_path / "p.yaml"
    path.write_text(text)
    lines = [_line_of(text, needle, section)] if needle else list(_task_block(text, section))
    r = _af_check(path)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out, out
    heads = [x for x in out.splitlines() if re.search(r":\d+:\d+: AF\d{3} ", x)]
    mine = [x for x in heads if any(f" {c} " in x for c in codes)]
    assert mine, out
    assert any(x.startswith(f"{path}:") and int(x[len(str(path)) + 1:].split(":")[0]) in lines
               for x in mine), (lines, out)


def test_binding_mistake_in_af_is_located(tmp_path):
    """The same in the .af DSL: digits_match given two inputs, at the task's line."""
    text = (PIPELINES / "grpo_digits.af").read_text()
    text = _edit(text, "reward(prompt, answer, response)", "reward(prompt, response)")
    path = tmp_path / "p.af"
    path.write_text(text)
    line = _line_of(text, "reward(prompt, response)")
    r = _af_check(path)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in out, out
    assert any(x.startswith(f"{path}:{line}:") and " AF374 " in x for x in out.splitlines()), out


def test_renamed_mistake_is_still_caught(tmp_path):
    """Renaming does not hide a mistake: gae given only the reward, every field renamed (the
    values are then called 'returns')."""
    text = _edit(PPO, "inputs: [reward, values]", "inputs: [reward]", "  advantage:")
    text = _edit(text, "outputs: [values]", "outputs: [values]\n    keep: [values]", "  value:")
    src = tmp_path / "src" / "ppo.yaml"
    src.parent.mkdir()
    src.write_text(text)
    m = swap_renaming(names_of(PIPELINES / "ppo_gae.yaml"))
    out = write_renamed(src, m, tmp_path / "renamed")
    r = _af_check(out)
    o = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in o, o
    block = _task_block(out.read_text(), "  advantage:")
    lines = [int(x[len(str(out)) + 1:].split(":")[0]) for x in o.splitlines()
             if x.startswith(f"{out}:") and (" AF370 " in x or " AF332 " in x)]
    assert lines and all(n in block for n in lines), (block, o)
    # the hint names the field that holds the values, by its new name
    assert f"'{m['values']}'" in o, o
