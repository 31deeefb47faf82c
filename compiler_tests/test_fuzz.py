"""Property tests: whatever the text, ``check`` answers with coded, located diagnostics only.

Starting from every canonical pipeline (YAML, and .af where the .af front end and emitter
exist), each strategy breaks the text one way -- deleted lines, swapped lines, swapped tokens, a
scalar replaced by a value of another type, random bytes, truncation -- or applies random
``--set`` overrides. ``check_file`` may return a result or report diagnostics; it must never
raise anything but :class:`UserError`, and every diagnostic must come from the table, carry a
location in a known source and render. Runs are derandomised (the same cases every time).
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncflow.check import check_file
from asyncflow.diagnostics import Diagnostics, table
from asyncflow.errors import UserError

from conftest import has_af_front, pipeline_files

# per strategy; ASYNCFLOW_FUZZ_EXAMPLES=N runs N random (not derandomised) cases instead
EXAMPLES = int(os.environ.get("ASYNCFLOW_FUZZ_EXAMPLES", 200))
COUNTS: dict[str, int] = {}  # strategy -> cases run (printed in the terminal summary)
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    derandomize="ASYNCFLOW_FUZZ_EXAMPLES" not in os.environ,
                    suppress_health_check=list(HealthCheck))
TMP = Path(tempfile.mkdtemp(prefix="asyncflow-fuzz-"))


def _sources() -> list[tuple[str, str]]:
    """(suffix, text) of every seed pipeline."""
    out = [(p.suffix, p.read_text()) for p in pipeline_files()]
    if has_af_front() and not any(s == ".af" for s, _ in out):
        try:  # the .af forms of the YAML pipelines, where the emitter exists
            from asyncflow.dsl.af_emit import emit_af
            from asyncflow.dsl.load import load_file

            out += [(".af", emit_af(load_file(str(p)))) for p in pipeline_files(".yaml")]
        except Exception:  # noqa: BLE001 - the emitter is optional here
            pass
    return out


SOURCES = _sources()
seeds = st.sampled_from(SOURCES)


@pytest.fixture(scope="module", autouse=True)
def installed_engines_read_once():
    """The engines installed (built-ins and entry points) read once for this module's
    thousands of checks: :func:`asyncflow.engines.base.engine_names` reads every installed
    distribution's metadata at each call, three quarters of a check here, and nothing in this
    module installs an engine, so the answer is the same each time (asserted at the end)."""
    from asyncflow.compiler.passes import validate, validate_args
    from asyncflow.engines import base

    names = base.engine_names()
    with pytest.MonkeyPatch.context() as mp:
        for module in (validate, validate_args):
            mp.setattr(module, "engine_names", lambda: dict(names))
        yield
    assert base.engine_names() == names


def check(text: str | bytes, suffix: str, sets=()) -> Diagnostics:
    """Check ``text`` as a file; assert the outcome is well-formed; return the diagnostics."""
    path = TMP / f"case{suffix}"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    diags = Diagnostics()
    result = check_file(str(path), sets=sets, diags=diags)  # nothing but UserError may escape
    codes = table()
    for d in diags.items:
        assert d.code in codes, d.code
        assert d.severity == codes[d.code].severity
        assert d.loc is not None and d.loc.line >= 1 and d.loc.col >= 1, d.headline()
        assert d.loc.file == str(path) or d.loc.file.startswith("--set["), d.headline()
        assert d.render()
    assert (result is None) == bool(diags.errors)
    try:  # the raising form agrees
        check_file(str(path), sets=sets)
        assert not diags.errors
    except UserError as e:
        assert {x.code for x in e.diagnostics} == {x.code for x in diags.errors}
    return diags


def run(name: str, strategy, mutate) -> None:
    n = [0]

    @SETTINGS
    @given(seeds, strategy)
    def case(seed, data):
        suffix, text = seed
        n[0] += 1
        check(mutate(text, data), suffix)

    case()
    COUNTS[name] = n[0]
    assert n[0] >= EXAMPLES // 2


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def test_deleted_lines():
    def mutate(text, picks):
        lines = _lines(text)
        drop = {i % len(lines) for i in picks}
        return "".join(x for i, x in enumerate(lines) if i not in drop)

    run("deleted lines", st.lists(st.integers(0, 10_000), min_size=1, max_size=4), mutate)


def test_swapped_lines():
    def mutate(text, ij):
        lines = _lines(text)
        i, j = ij[0] % len(lines), ij[1] % len(lines)
        lines[i], lines[j] = lines[j], lines[i]
        return "".join(lines)

    run("swapped lines", st.tuples(st.integers(0, 10_000), st.integers(0, 10_000)), mutate)


TOKEN = re.compile(r"[A-Za-z_][\w.:]*|\d+(?:\.\d+)?(?:e-?\d+)?|[^\s\w]")


def test_swapped_tokens():
    def mutate(text, picks):
        toks = list(TOKEN.finditer(text))
        out = text
        for a, b in picks:
            toks = list(TOKEN.finditer(out))
            x, y = sorted((toks[a % len(toks)], toks[b % len(toks)]), key=lambda m: m.start())
            if x.start() == y.start():
                continue
            out = (out[:x.start()] + y.group() + out[x.end():y.start()] + x.group() + out[y.end():])
        return out

    run("swapped tokens",
        st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 10_000)), min_size=1, max_size=3),
        mutate)


VALUE = re.compile(r"(?m)(?<=: )[^\s#{}\[\],][^#\n{}\[\],]*?(?=\s*(?:#|$|,|}))")
REPLACEMENTS = ["[1, 2]", "{a: 1}", "3", "-7", "0", "1.5", "1e309", "'text'", "true", "null",
                "[]", "{}", "policy", "asyncflow.rewards:nope", "x.jsonl", "[prompt, prompt]",
                "{dist: pareto, scale: 0, alpha: 1}", "\"\"", "~"]


def test_wrong_types():
    def mutate(text, picks):
        for i, r in picks:
            spots = list(VALUE.finditer(text))
            if not spots:
                break
            m = spots[i % len(spots)]
            text = text[:m.start()] + r + text[m.end():]
        return text

    run("wrong types",
        st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(REPLACEMENTS)), min_size=1,
                 max_size=3), mutate)


def test_random_bytes():
    def mutate(text, data):
        pos, junk = data
        raw = text.encode()
        k = pos % (len(raw) + 1)
        return raw[:k] + junk + raw[k:]

    run("random bytes", st.tuples(st.integers(0, 100_000), st.binary(min_size=1, max_size=12)),
        mutate)


def test_random_text_edits():
    def mutate(text, data):
        pos, junk, cut = data
        k = pos % (len(text) + 1)
        return text[:k] + junk + text[k + cut:]

    run("random text edits",
        st.tuples(st.integers(0, 100_000), st.text(max_size=8), st.integers(0, 6)), mutate)


def test_truncation():
    run("truncation", st.integers(0, 100_000), lambda text, k: text[:k % (len(text) + 1)])


KEYS = ["tasks.update.args.lr", "tasks.update.args.micro_batch", "tasks.generate.replicas",
        "tasks.generate.engine", "tasks.generate.model", "tasks.generate.pool",
        "tasks.generate.inputs", "tasks.score.fn", "tasks.advantage.estimator", "tasks.update.loss",
        "tasks.update.kind", "tasks.new.kind", "sync.0.max_staleness", "sync.0.from", "sync.0.to",
        "sync.5.to", "step.prompts_per_step", "step.samples_per_prompt", "step.steps",
        "models.policy.init", "models.policy.frozen", "models.reference.copy_of",
        "pools.rollout.devices", "pools.rollout", "data.prompts.source", "data.prompts.fields",
        "pipeline", "description", "seed", "tasks", "sync", "step.steps.x", "tasks.updat.args.lr",
        "tasks.generate.args.latency", "", ".", "tasks..x", "models.policy.args.layers"]
VALUES = ["0", "1", "-1", "3e-5", "true", "null", "[a, b]", "{x: 1}", "[1,", "hf", "sim", "vllm",
          "policy", "train", "grpo", "asyncflow.rewards:digits_match", "{dist: lognormal}", "", "'",
          "[prompt, response]", "{}", "[]", "x" * 40, "ü"]


def test_random_overrides():
    n = [0]
    texts = [(s, t) for s, t in SOURCES if s != ".af"] or SOURCES

    @SETTINGS
    @given(st.sampled_from(texts),
           st.lists(st.one_of(
               st.tuples(st.sampled_from(KEYS), st.sampled_from(VALUES)).map(lambda kv: f"{kv[0]}={kv[1]}"),
               st.text(max_size=20)), min_size=1, max_size=4))
    def case(seed, sets):
        suffix, text = seed
        n[0] += 1
        check(text, suffix, tuple(sets))

    case()
    COUNTS["random --set overrides"] = n[0]
    assert n[0] >= EXAMPLES // 2


def test_every_seed_is_clean():
    """The seeds themselves check clean (so every finding above comes from the mutation)."""
    for suffix, text in SOURCES:
        assert not check(text, suffix).errors
