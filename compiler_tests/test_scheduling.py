"""The scheduling keys end to end: schedule, redundancy, on_update (rollout), consume, stream
(train), refill (filter) -- parsed from YAML, .af and --set, round-tripped by fmt, checked with
located codes, filled in with their defaults in the plan, lowered into the op lists, shown by
``asyncflow compile``.

    BASE (asyncflow/diagnostics/examples.py): 4 prompts x 4 samples = 16 samples a step,
    prompts -> generate -> score -> advantage(grpo) -> update (micro_batch 8), ref (frozen)
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import yaml

from asyncflow.check import check_file
from asyncflow.compiler import compile_text
from asyncflow.compiler.passes.lower import read_fields
from asyncflow.diagnostics import Diagnostics
from asyncflow.diagnostics.examples import BASE
from asyncflow.dsl.af_emit import emit_af
from asyncflow.dsl.emit import emit_yaml
from asyncflow.dsl.load import load_text
from asyncflow.kinds import KINDS, SCHED, SCHED_KEYS
from asyncflow.plan import Plan

from conftest import ROOT, position

SCHED_YAML = BASE.replace(
    "    args: {max_new_tokens: 8}",
    "    args: {max_new_tokens: 8}\n    schedule: batch\n    redundancy: 1.25\n    on_update: abort",
).replace(
    "    loss: grpo",
    "    loss: grpo\n    consume: first_ready\n    stream: false",
)
FILTER = """  keep_variance:
    kind: filter
    fn: asyncflow.filters:group_has_variance
    batched: true
    inputs: [reward]
    outputs: [kept]
{extra}  advantage:
    kind: advantage
    estimator: grpo
    inputs: [reward, kept]
"""


def with_filter(extra: str = "") -> str:
    text = BASE.replace("  advantage:\n    kind: advantage\n    estimator: grpo\n    inputs: [reward]\n",
                        FILTER.format(extra=extra))
    assert "keep_variance" in text
    return text


def load(text: str, path: str = "t.yaml", sets=()):
    d = Diagnostics()
    p = load_text(text, path, sets, d)
    return p, d


def diagnose(text: str, sets=(), suffix=".yaml", tmp=None) -> Diagnostics:
    path = tmp / f"p{suffix}"
    path.write_text(text)
    d = Diagnostics()
    check_file(str(path), sets=sets, diags=d)
    return d


def plan_of(text: str = BASE, sets=(), path="t.yaml") -> Plan:
    return compile_text(text, path, sets=sets)


def task(plan: Plan, name: str):
    return plan.task(name)


def sched(t) -> dict:
    return {k: getattr(t, k) for k in SCHED_KEYS}


def ops(plan: Plan, worker: str, kind: str):
    return [o for w in plan.workers if w.id == worker for o in w.ops if o.kind == kind]


# -- the kinds table ----------------------------------------------------------------------------
def test_each_key_belongs_to_one_kind():
    owners = {k: [n for n, v in KINDS.items() if k in v.takes] for k in SCHED_KEYS}
    assert owners == {"schedule": ["rollout"], "redundancy": ["rollout"], "on_update": ["rollout"],
                      "consume": ["train"], "stream": ["train"], "refill": ["filter"]}
    assert SCHED["schedule"].choices == ("queue", "batch")
    assert SCHED["on_update"].choices == ("finish", "abort", "continue")
    assert SCHED["consume"].choices == ("in_order", "first_ready")


# -- parsing: YAML, .af, --set --------------------------------------------------------------------
def test_yaml_parses_the_keys():
    p, d = load(SCHED_YAML)
    assert not d.items, [x.headline() for x in d.items]
    g, u = p.tasks["generate"], p.tasks["update"]
    assert (g.schedule, g.redundancy, g.on_update) == ("batch", 1.25, "abort")
    assert (u.consume, u.stream) == ("first_ready", False)
    assert g.locs["schedule"].line == position(SCHED_YAML, "batch")[0]


def test_unwritten_keys_stay_unset_in_the_ast():
    p, _ = load(BASE)
    for t in p.tasks.values():
        assert all(getattr(t, k) is None for k in SCHED_KEYS), t.name


def test_af_parses_the_keys():
    af = emit_af(load(SCHED_YAML)[0])
    assert "schedule=batch redundancy=1.25 on_update=abort" in af
    assert "consume=first_ready stream=false" in af
    text = """
    pipeline p
    model m = asyncflow.models:tiny_decoder
    data d = asyncflow.datasets:digits -> prompt, answer
    pool gpu(devices=1)
    step prompts_per_step=2 samples_per_prompt=2 steps=1
    task gen: rollout(prompt) -> response, logprobs {
      engine=hf model=m pool=gpu schedule=queue redundancy=1.5 on_update=continue
    }
    task keep: filter(response) -> kept { fn=asyncflow.filters:group_has_variance refill=false }
    task up: train(prompt, response, logprobs) { engine=hf model=m pool=gpu loss=grpo consume=in_order stream=true }
    """
    p, d = load(text, "t.af")
    assert p is not None, [x.headline() for x in d.items]
    assert (p.tasks["gen"].schedule, p.tasks["gen"].redundancy, p.tasks["gen"].on_update) == (
        "queue", 1.5, "continue")
    assert p.tasks["keep"].refill is False
    assert (p.tasks["up"].consume, p.tasks["up"].stream) == ("in_order", True)


@pytest.mark.parametrize("text", [SCHED_YAML, with_filter("    refill: false\n"), BASE])
def test_fmt_round_trips_the_keys(text):
    p, d = load(text)
    assert p is not None, [x.headline() for x in d.items]
    af = emit_af(p)
    assert load(af, "t.af")[0] == p
    assert load(emit_yaml(p))[0] == p
    assert emit_af(load(af, "t.af")[0]) == af
    # a key written with its default value is kept: fmt prints what was written
    q = load(text, sets=["tasks.generate.schedule=queue"])[0]
    assert "schedule: queue" in emit_yaml(q) and load(emit_af(q), "t.af")[0] == q


def test_set_overrides():
    p, d = load(BASE, sets=["tasks.generate.schedule=batch", "tasks.generate.redundancy=1.25",
                            "tasks.generate.on_update=continue", "tasks.update.consume=first_ready",
                            "tasks.update.stream=false"])
    assert not d.errors, [x.headline() for x in d.errors]
    g, u = p.tasks["generate"], p.tasks["update"]
    assert (g.schedule, g.redundancy, g.on_update, u.consume, u.stream) == (
        "batch", 1.25, "continue", "first_ready", False)
    assert g.locs["schedule"].file == "--set[1]"
    plan = plan_of(sets=["tasks.generate.schedule=batch"])
    assert task(plan, "generate").schedule == "batch"


def test_set_override_errors_point_into_the_override():
    _, d = load(BASE, sets=["tasks.generate.schedule=queu"])
    (e,) = d.errors
    assert (e.code, e.loc.file, e.loc.col) == ("AF205", "--set[1]", 25)
    assert e.hint == "did you mean 'queue'?"
    _, d = load(BASE, sets=["tasks.generate.redundancy=0.5"])
    assert [(x.code, x.loc.file) for x in d.errors] == [("AF206", "--set[1]")]


# -- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("where,key,value", [
    ("    loss: grpo", "schedule", "queue"), ("    loss: grpo", "redundancy", "1.5"),
    ("    loss: grpo", "on_update", "finish"), ("    args: {max_new_tokens: 8}", "consume", "in_order"),
    ("    args: {max_new_tokens: 8}", "stream", "true"), ("    estimator: grpo", "refill", "true"),
    ("    fn: asyncflow.rewards:digits_match", "schedule", "batch"),
    ("    model: reference\n    pool: train", "stream", "false"),
])
def test_a_key_on_a_kind_that_does_not_take_it_is_af326(where, key, value, tmp_path):
    text = BASE.replace(where, f"{where}\n    {key}: {value}", 1)
    d = diagnose(text, tmp=tmp_path)
    found = [x for x in d.errors if x.code == "AF326"]
    assert len(found) == 1, [x.headline() for x in d.items]
    at = text.index(f"{key}: {value}") + len(key) + 2
    line = text.count("\n", 0, at) + 1
    assert (found[0].loc.line, found[0].loc.col) == (line, at - text.rfind("\n", 0, at))
    owner = {"schedule": "rollout", "redundancy": "rollout", "on_update": "rollout",
             "consume": "train", "stream": "train", "refill": "filter"}[key]
    assert f"takes no '{key}' (a scheduling key of {owner} tasks)" in found[0].message


@pytest.mark.parametrize("line,code,hint", [
    ("schedule: qeueu", "AF205", "did you mean 'queue'?"),
    ("on_update: abrt", "AF205", "did you mean 'abort'?"),
    ("schedule: 3", "AF202", None),
    ("redundancy: 0.9", "AF206", None),
    ("redundancy: 0", "AF206", None),
    ("redundancy: .nan", "AF206", None),
    ("redundancy: -.inf", "AF206", None),
    ("redundancy: high", "AF202", None),
    ("redundancy: true", "AF202", None),
])
def test_bad_rollout_values(line, code, hint, tmp_path):
    text = BASE.replace("    args: {max_new_tokens: 8}", f"    args: {{max_new_tokens: 8}}\n    {line}")
    d = diagnose(text, tmp=tmp_path)
    assert [x.code for x in d.errors] == [code], [x.headline() for x in d.items]
    key, value = line.split(": ", 1)
    line_no, col = position(text, f"    {line}\n")
    assert (d.errors[0].loc.line, d.errors[0].loc.col) == (line_no, col + 4 + len(key) + 2)
    assert d.errors[0].hint == hint
    if code == "AF205":
        assert "choose one of" in d.errors[0].message


@pytest.mark.parametrize("line,code", [
    ("consume: newest", "AF205"), ("stream: 1", "AF202"), ("stream: sometimes", "AF202"),
])
def test_bad_train_values(line, code, tmp_path):
    text = BASE.replace("    loss: grpo", f"    loss: grpo\n    {line}")
    d = diagnose(text, tmp=tmp_path)
    assert [x.code for x in d.errors] == [code], [x.headline() for x in d.items]


def test_bad_refill_value(tmp_path):
    d = diagnose(with_filter("    refill: yes please\n"), tmp=tmp_path)
    assert [x.code for x in d.errors] == ["AF202"]


def test_redundancy_one_and_an_integer_are_fine(tmp_path):
    for v in ("1", "1.0", "2", "1.25"):
        text = BASE.replace("    args: {max_new_tokens: 8}", f"    args: {{max_new_tokens: 8}}\n    redundancy: {v}")
        assert not diagnose(text, tmp=tmp_path).items


# -- warnings: a key that can do nothing here ------------------------------------------------
def _codes(text, tmp_path, sets=()):
    return sorted(x.code for x in diagnose(text, sets, tmp=tmp_path).items)


def test_af380_on_update_without_new_weights_or_with_batch(tmp_path):
    on = BASE.replace("    args: {max_new_tokens: 8}", "    args: {max_new_tokens: 8}\n    on_update: abort")
    assert _codes(on, tmp_path) == []  # queue + a sync edge: in-flight samples restart
    assert _codes(on, tmp_path, ["tasks.generate.schedule=batch"]) == ["AF380"]
    assert _codes(on, tmp_path, ["tasks.generate.schedule=batch",
                                 "tasks.generate.on_update=finish"]) == []  # finish is batch's way


def test_af329_finish_defeats_first_ready(tmp_path):
    text = BASE.replace("    loss: grpo", "    loss: grpo\n    consume: first_ready")
    # finish with no spare group: every step waits for its slowest sample
    assert _codes(text.replace("    pool: rollout", "    pool: rollout\n    on_update: finish\n"
                               "    redundancy: 1.0"), tmp_path) == ["AF329"]
    # finish with the default spare group (one ahead) or a written one keeps the buffer going
    for extra in ("", "\n    redundancy: 1.25"):
        assert _codes(text.replace("    pool: rollout", "    pool: rollout\n    on_update: finish"
                                   + extra), tmp_path) == [], extra
    assert _codes(text.replace("    pool: rollout", "    pool: rollout\n    schedule: batch"),
                  tmp_path) == ["AF329"]
    assert _codes(text.replace("    pool: rollout", "    pool: rollout\n    on_update: continue"),
                  tmp_path) == []
    # at alpha 0 there is no buffer to defeat (AF382 says so)
    assert _codes(text.replace("    pool: rollout", "    pool: rollout\n    on_update: finish")
                  .replace("max_staleness: 1", "max_staleness: 0"), tmp_path) == ["AF382"]


def test_af382_first_ready_at_staleness_0(tmp_path):
    text = BASE.replace("    loss: grpo", "    loss: grpo\n    consume: first_ready")
    assert _codes(text, tmp_path) == []
    assert _codes(text, tmp_path, ["sync.0.max_staleness=0"]) == ["AF382"]


def test_af383_stream_without_micro_batches(tmp_path):
    text = BASE.replace("    loss: grpo", "    loss: grpo\n    stream: true")
    assert _codes(text, tmp_path) == []
    assert _codes(text, tmp_path, ["tasks.update.args.micro_batch=16"]) == ["AF383"]
    d = diagnose(text.replace("micro_batch: 8", "kl_coef: 0.0"), tmp=tmp_path)
    assert [x.code for x in d.items] == ["AF383"] and "no args.micro_batch" in d.items[0].message
    assert _codes(text.replace("stream: true", "stream: false"), tmp_path,
                  ["tasks.update.args.micro_batch=16"]) == []


def test_shipped_pipelines_set_off_no_scheduling_warning():
    from conftest import pipeline_files

    for path in pipeline_files():
        d = Diagnostics()
        check_file(str(path), diags=d)
        assert not [x for x in d.items if x.code.startswith("AF38")], path


# -- the plan: defaults filled in -------------------------------------------------------------
def test_defaults_in_the_plan():
    plan = plan_of(with_filter())
    assert sched(task(plan, "generate")) == {"schedule": "queue", "redundancy": 1.0,
                                             "on_update": "finish", "consume": "",
                                             "stream": False, "refill": False}
    assert sched(task(plan, "update")) == {"schedule": "", "redundancy": 1.0, "on_update": "",
                                           "consume": "in_order", "stream": True, "refill": False}
    assert task(plan, "keep_variance").refill is True
    for name in ("score", "ref", "advantage"):  # kinds without scheduling keys: neutral values
        assert sched(task(plan, name)) == {"schedule": "", "redundancy": 1.0, "on_update": "",
                                           "consume": "", "stream": False, "refill": False}
    assert (plan.step.launch_groups, plan.step.replace) == (4, ["filter"])


@pytest.mark.parametrize("args,stream", [
    ("{lr: 1.0e-4, micro_batch: 8}", True), ("{lr: 1.0e-4, micro_batch: 16}", False),
    ("{lr: 1.0e-4}", False), ("{lr: 1.0e-4, micro_batch: 4}", True),
])
def test_stream_default_is_micro_batch_below_the_step(args, stream):
    plan = plan_of(BASE.replace("{lr: 1.0e-4, micro_batch: 8}", args))
    assert task(plan, "update").stream is stream


def test_first_ready_launches_one_group_ahead_by_default():
    """A queue rollout fed by a first_ready trainer at alpha >= 1 launches prompts_per_step + 1
    groups a step (redundancy (pps+1)/pps in the plan) and continues on new weights; a written
    redundancy (1.0 too), in_order, alpha 0 or a batch rollout keep exactly prompts_per_step."""
    fr = BASE.replace("    loss: grpo", "    loss: grpo\n    consume: first_ready")
    pps = plan_of(BASE).step.prompts_per_step
    plan = plan_of(fr)
    assert plan.step.launch_groups == pps + 1
    g = task(plan, "generate")
    assert (g.on_update, g.redundancy) == ("continue", (pps + 1) / pps)
    for text, sets in ((BASE, ()), (fr, ["tasks.generate.redundancy=1.0"]),
                       (fr, ["sync.0.max_staleness=0"]), (fr, ["tasks.generate.schedule=batch"])):
        p = plan_of(text, sets)
        assert p.step.launch_groups in (0, pps), (sets, p.step.launch_groups)
        assert task(p, "generate").redundancy == 1.0, sets


def test_written_values_win():
    plan = plan_of(SCHED_YAML)
    assert sched(task(plan, "generate")) == {"schedule": "batch", "redundancy": 1.25,
                                             "on_update": "abort", "consume": "",
                                             "stream": False, "refill": False}
    u = task(plan, "update")
    assert (u.consume, u.stream) == ("first_ready", False)
    assert plan.step.launch_groups == 5  # ceil(4 * 1.25)
    assert plan.step.replace == ["staleness"]
    assert task(plan_of(with_filter("    refill: false\n")), "keep_variance").refill is False
    assert plan_of(with_filter("    refill: false\n")).step.replace == []
    both = plan_of(with_filter(), sets=["tasks.update.consume=first_ready"])
    assert both.step.replace == ["filter", "staleness"]


@pytest.mark.parametrize("pps,r,groups", [(4, 1.0, 4), (4, 1.25, 5), (4, 1.01, 5), (10, 1.1, 11),
                                          (32, 1.1, 36), (4, 2, 8), (3, 1.5, 5)])
def test_launch_groups_is_the_ceiling(pps, r, groups):
    text = BASE.replace("prompts_per_step: 4", f"prompts_per_step: {pps}").replace(
        "micro_batch: 8", f"micro_batch: {pps * 4}")
    plan = plan_of(text, sets=[f"tasks.generate.redundancy={r}"])
    assert plan.step.launch_groups == groups == math.ceil(round(pps * r, 9))


def test_launch_groups_counts_only_rollouts_on_a_trained_model(tmp_path):
    """A second rollout on the frozen reference: its redundancy is ignored (AF381)."""
    text = BASE.replace("  score:\n", """  judge:
    kind: rollout
    engine: hf
    model: reference
    pool: rollout
    redundancy: 3
    inputs: [prompt]
    outputs: [judgement, judge_logprobs]
    keep: [judgement, judge_logprobs]
  score:
""")
    assert _codes(text, tmp_path) == ["AF381"]
    plan = plan_of(text)
    assert plan.step.launch_groups == 4 and task(plan, "judge").redundancy == 3.0
    plan = plan_of(text, sets=["tasks.generate.redundancy=1.5"])
    assert plan.step.launch_groups == 6


def test_plan_json_round_trips_the_fields():
    plan = plan_of(SCHED_YAML)
    back = Plan.from_json(plan.to_json())
    assert back == plan
    d = json.loads(plan.to_json())
    assert d["step"]["launch_groups"] == 5 and d["step"]["replace"] == ["staleness"]
    g = next(t for t in d["tasks"] if t["name"] == "generate")
    assert (g["schedule"], g["redundancy"], g["on_update"]) == ("batch", 1.25, "abort")


# -- the lowered ops ------------------------------------------------------------------------------
def test_streaming_trainer_computes_per_micro_batch():
    plan = plan_of()
    (c,) = ops(plan, "update/0", "COMPUTE")
    assert (c.rows, c.repeat) == (8, 2) and c.note.startswith("train_stream grpo")
    reads = ops(plan, "update/0", "READ")
    assert {(r.rows, r.repeat, r.granularity) for r in reads} == {(8, 2, "micro_batch")}
    (c,) = ops(plan_of(sets=["tasks.update.stream=false"]), "update/0", "COMPUTE")
    assert (c.rows, c.repeat) == (16, 1) and c.note == "train_step grpo"


def test_streaming_trainer_at_staleness_zero():
    """Staleness 0: a streaming trainer reads and computes micro-batch by micro-batch as the
    step's rows become ready; a non-streaming one reads the whole step (overlap rule 1)."""
    plan = plan_of(sets=["sync.0.max_staleness=0"])
    assert {(r.rows, r.granularity) for r in ops(plan, "update/0", "READ")} == {
        (8, "micro_batch")}
    (c,) = ops(plan, "update/0", "COMPUTE")
    assert (c.rows, c.repeat) == (8, 2)
    plan = plan_of(sets=["sync.0.max_staleness=0", "tasks.update.stream=false"])
    assert {(r.rows, r.granularity) for r in ops(plan, "update/0", "READ")} == {(16, "step")}


def test_streaming_micro_batch_smaller_than_a_read():
    """micro_batch 2 < group 4: READs of lcm = 4 rows, COMPUTEs of 2 rows, 8 of them."""
    plan = plan_of(BASE.replace("micro_batch: 8", "micro_batch: 2"))
    assert {(r.rows, r.repeat) for r in ops(plan, "update/0", "READ")} == {(4, 4)}
    (c,) = ops(plan, "update/0", "COMPUTE")
    assert (c.rows, c.repeat) == (2, 8)


def test_queue_rollout_reads_single_samples_batch_keeps_the_input_shape():
    g = compile_text(BASE, "t.yaml", stop_after="overlap")
    q = read_fields(g, "generate", [("group", 4)])
    assert (q["granularity"], q["unit"], q["min_rows"]) == ("sample", 1, 1)
    g = compile_text(BASE, "t.yaml", sets=["tasks.generate.schedule=batch"], stop_after="overlap")
    b = read_fields(g, "generate", [("group", 4)])
    assert (b["granularity"], b["unit"], b["min_rows"]) == ("group", 4, 4)
    # from a data source both read single samples, as before
    for sets in ([], ["tasks.generate.schedule=batch"]):
        plan = plan_of(sets=sets)
        (r,) = ops(plan, "generate/0", "READ")
        assert (r.granularity, r.unit, r.min_rows, r.rows, r.chunk) == ("sample", 1, 1, 16, 16)
    (c,) = ops(plan_of(), "generate/0", "COMPUTE")
    assert c.note == "generate hf, each sample its own request"
    (c,) = ops(plan_of(sets=["tasks.generate.schedule=batch"]), "generate/0", "COMPUTE")
    assert c.note == "generate hf, whole batches per call"


def test_first_ready_read_says_so():
    plan = plan_of(sets=["tasks.update.consume=first_ready"])
    for r in ops(plan, "update/0", "READ"):
        assert "first ready rows of any step with step - version <= 1" in r.note


# -- the cost pass --------------------------------------------------------------------------------
SIM = ROOT / "pipelines" / "sim_longtail.yaml"


def test_cost_batch_schedule_waits_for_the_slowest_sample_of_each_call():
    text = SIM.read_text()
    q = plan_of(text, path=str(SIM)).estimate
    b = plan_of(text, sets=["tasks.generate.schedule=batch"], path=str(SIM)).estimate
    assert b.per_task["generate"] > q.per_task["generate"] > 0
    assert b.step_time_sync == q.step_time_sync


def test_cost_streaming_trainer_pays_per_call_per_micro_batch():
    text = SIM.read_text().replace("seconds_per_sample: 0.005,", "seconds_per_call: 0.01,")
    s = plan_of(text, path=str(SIM)).estimate.per_task["update"]
    w = plan_of(text, sets=["tasks.update.stream=false"], path=str(SIM)).estimate.per_task["update"]
    assert math.isclose(s, 0.01 * 128 / 16) and math.isclose(w, 0.01)


def test_cost_notes_redundancy_it_does_not_model():
    e = plan_of(SIM.read_text(), sets=["tasks.generate.redundancy=1.25"], path=str(SIM)).estimate
    assert any("redundancy 1.25 of 'generate' is not modelled" in n for n in e.notes)
    assert not any("redundancy" in n for n in plan_of(SIM.read_text(), path=str(SIM)).estimate.notes)


# -- asyncflow compile ---------------------------------------------------------------------------
def _compile(*args):
    return subprocess.run([sys.executable, "-m", "asyncflow.cli", "compile", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={"COLUMNS": "200", "NO_COLOR": "1", "PATH": "/usr/bin:/bin"})


def test_compile_shows_the_scheduling():
    r = _compile("pipelines/dapo.yaml", "--set", "tasks.generate.redundancy=1.25",
                 "--set", "tasks.update.consume=first_ready")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "scheduling" in out
    # on_update defaults to continue for a queue rollout feeding a first_ready trainer at alpha
    # >= 1 (it was finish, which defeats the buffer: AF329)
    assert "queue, redundancy 1.25, on_update continue" in out
    assert "first_ready, stream" in out
    assert "refill" in out
    assert "groups launched per step (8 extra" in out and "40" in out
    assert "dropped groups replaced by new prompts" in out and "filter, staleness" in out


def test_compile_json_has_the_fields():
    r = _compile("pipelines/dapo.yaml", "--json", "--set", "tasks.generate.schedule=batch")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["step"]["launch_groups"] == 32 and d["step"]["replace"] == ["filter"]
    t = {x["name"]: x for x in d["tasks"]}
    assert t["generate"]["schedule"] == "batch" and t["update"]["stream"] is True
    assert t["dynamic_sampling"]["refill"] is True


def test_schema_knows_the_keys():
    import jsonschema

    from asyncflow.schema import json_schema

    v = jsonschema.Draft202012Validator(json_schema())
    good = yaml.safe_load(SCHED_YAML)
    assert not list(v.iter_errors(good))
    for path, value in ((("generate", "schedule"), "fast"), (("generate", "redundancy"), 0.5),
                        (("update", "stream"), "yes"), (("update", "schedule"), "queue"),
                        (("score", "refill"), True), (("generate", "consume"), "in_order")):
        doc = yaml.safe_load(BASE)
        doc["tasks"][path[0]][path[1]] = value
        assert list(v.iter_errors(doc)), path
