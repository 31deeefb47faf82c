"""The lower pass (asyncflow/compiler/passes/lower.py); rule numbers from its docstring.

    prompts -> generate -> score -> advantage(grpo) -> update      (BASE: 16 samples/step,
                  \\-> ref (frozen) -----------------^               micro_batch 8)
    update ..sync a..> generate
"""
import yaml

from asyncflow.compiler import Context, compile_text
from asyncflow.compiler.passes.lower import lower, naive_ops, overlap_rewrite
from asyncflow.diagnostics.examples import BASE
from asyncflow.plan import Plan


def src(alpha=1, stream=None):
    d = yaml.safe_load(BASE)
    d["sync"][0]["max_staleness"] = alpha
    if stream is not None:
        d["tasks"]["update"]["stream"] = stream
    return yaml.safe_dump(d, sort_keys=False)


def ops(plan, worker):
    w = next(w for w in plan.workers if w.id == worker)
    return [(o.kind, o.channel or o.model or "", o.rows, o.repeat, o.max_lag) for o in w.ops]


def test_deferred_rollout_adopts_before_read_rules_1_3():
    """Rule 3: WAIT blocks only a versions ahead; ADOPT before READ; sample reads of whatever
    is ready up to a whole step (rule 1), at most a chunk per pull of a serve loop."""
    plan = compile_text(src(alpha=1), "t.yaml")
    assert ops(plan, "generate/0") == [
        ("WAIT", "policy", 0, 1, 1), ("ADOPT", "policy", 0, 1, None),
        ("READ", "prompts->generate", 16, 0, None), ("COMPUTE", "", 16, 0, None),
        ("WRITE", "generate->score", 16, 0, None), ("WRITE", "generate->ref", 16, 0, None),
        ("WRITE", "generate->update", 16, 0, None)]
    read = next(o for o in plan.workers[0].ops if o.kind == "READ")
    assert (read.granularity, read.min_rows, read.unit, read.chunk) == ("sample", 1, 1, 16)
    adv = next(o for w in plan.workers if w.id == "advantage/0" for o in w.ops if o.kind == "READ")
    assert (adv.granularity, adv.rows, adv.unit, adv.min_rows) == ("group", 16, 4, 4)
    assert [(s.src, s.dst, s.model, s.mode) for s in plan.sync] == [
        ("update", "generate", "policy", "deferred")]


def test_trainer_reads_micro_batches_and_publishes_without_waiting_rules_1_4():
    """Rules 1, 2, 4: update READs lcm(group 4, micro_batch 8) = 8 rows, twice a step, trains
    them as they come (micro_batch 8 < 16 samples: it streams by default), one COMPUTE per
    micro-batch, then PUBLISHes; with stream: false it trains the whole step once."""
    plan = compile_text(src(alpha=1), "t.yaml")
    o = ops(plan, "update/0")
    assert [k for k, *_ in o] == ["READ"] * 4 + ["COMPUTE", "PUBLISH"]
    assert all(r == 8 and rep == 2 for k, _, r, rep, _ in o if k == "READ")
    assert [(r, rep) for k, _, r, rep, _ in o if k == "COMPUTE"] == [(8, 2)]
    whole = compile_text(src(alpha=1), "t.yaml", sets=["tasks.update.stream=false"])
    assert [(r, rep) for k, _, r, rep, _ in ops(whole, "update/0") if k == "COMPUTE"] == [(16, 1)]
    read = next(x for x in plan.workers if x.id == "update/0").ops[0]
    assert (read.granularity, read.min_rows) == ("micro_batch", 8) and read.lease_s > 0
    pub = next(x for x in plan.workers if x.id == "update/0").ops[-1]
    assert "without waiting" in pub.note


def test_staleness_zero_keeps_blocking_wait_rule_5():
    """Rule 5: a = 0 -> WAIT max_lag 0, blocking sync, a non-streaming update reads the whole
    step (a streaming one: micro-batches, tests/test_scheduling_run.py)."""
    plan = compile_text(src(alpha=0, stream=False), "t.yaml")
    assert ops(plan, "generate/0")[0] == ("WAIT", "policy", 0, 1, 0)
    assert plan.sync[0].mode == "blocking"
    assert {r for k, _, r, *_ in ops(plan, "update/0") if k == "READ"} == {16}


def test_naive_schedule_is_whole_step_and_rewrite_is_separate():
    """naive_ops reads each replica's share of the step; overlap_rewrite changes only granularity,
    waits and notes, never the op sequence."""
    g = compile_text(src(alpha=1), "t.yaml", stop_after="overlap")
    naive = lower(g, Context(), naive=True)
    fast = lower(g, Context())
    for a, b in zip(naive.workers, fast.workers):
        assert [o.kind for o in a.ops] == [o.kind for o in b.ops]
        assert [o.channel for o in a.ops] == [o.channel for o in b.ops]
    assert {o.rows for o in naive.workers[0].ops if o.kind == "READ"} == {16}
    gen_wait = next(o for o in naive.workers[0].ops if o.kind == "WAIT")
    assert gen_wait.max_lag == 0
    ins = [e for e, _ in g.data_edges() if e.dst == "score"]
    n = naive_ops(g, "score", ins, [], [], [])
    r = overlap_rewrite(g, "score", n, {}, [("sample", 1)])
    assert n[0].rows == 16 and n[0].granularity == "step" and r[0].granularity == "sample"
    assert r[0].min_rows == 1 and n[0] is not r[0]


def test_workers_channels_and_models():
    """One worker per replica; one channel per data edge with the annotations; copy_of resolved."""
    plan = compile_text(src(), "t.yaml")
    assert [w.id for w in plan.workers] == ["generate/0", "score/0", "ref/0", "advantage/0", "update/0"]
    ch = {c.id: c for c in plan.channels}
    assert ch["generate->update"].granularity == "micro_batch" and ch["generate->update"].staleness == 1
    assert ch["score->advantage"].capacity == 32
    ref = next(m for m in plan.models if m.name == "reference")
    assert ref.init == "asyncflow.models:tiny_decoder" and ref.frozen and ref.updated_by is None
    assert next(m for m in plan.models if m.name == "policy").updated_by == "update"


def test_plan_json_round_trips():
    plan = compile_text(src(), "t.yaml")
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.source_file == "t.yaml"
