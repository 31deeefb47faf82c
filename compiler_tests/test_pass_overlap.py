"""The overlap pass (asyncflow/compiler/passes/overlap.py); each test cites the rules it checks.

Base pipeline (asyncflow.diagnostics.examples.BASE; 4 prompts x 4 samples, micro_batch 8):

    prompts -> generate -> score -> advantage(grpo) -> update
                  \\-> ref (frozen) -----------------^
    update ..sync a=1..> generate          pools: rollout {generate}, train {ref, update}
"""
import pytest
import yaml

from asyncflow.compiler import Context, compile_text
from asyncflow.diagnostics.examples import BASE
from asyncflow.errors import UserError


def src(alpha=1, estimator="grpo", stream=None, **step):
    d = yaml.safe_load(BASE)
    d["sync"][0]["max_staleness"] = alpha
    if stream is not None:
        d["tasks"]["update"]["stream"] = stream
    d["tasks"]["advantage"]["estimator"] = estimator
    d["step"].update(step)
    return yaml.safe_dump(d, sort_keys=False)


def gran(g):
    return {(e.src, e.dst): m["granularity"] for e, m in g.data_edges()}


def after(text, ctx=None):
    return compile_text(text, "t.yaml", stop_after="overlap", verify=True, ctx=ctx)


def test_async_grpo_granularities():
    """Rules 3, 5, 6, 7, 8: sample into reward, group into and out of grpo, micro_batch to train.

        generate -sample-> score -group-> advantage -group-> update
        generate -micro_batch-> update
    """
    g = gran(after(src()))
    assert g["generate", "score"] == "sample"  # rule 6
    assert g["prompts", "generate"] == "sample"  # rule 7: sources emit samples
    assert g["score", "advantage"] == "group"  # rule 3
    assert g["advantage", "update"] == "group"  # rules 7, 8: grpo emits whole groups
    assert g["generate", "update"] == "micro_batch"  # rule 5
    assert g["ref", "update"] == "micro_batch"


def test_staleness_zero_is_a_step_barrier():
    """Rule 1: every edge into a non-streaming trainer is `step` when a = 0.

        generate -step-> update ..0..> generate
    """
    g = gran(after(src(alpha=0, stream=False)))
    assert {v for (s, d), v in g.items() if d == "update"} == {"step"}
    assert g["generate", "score"] == "sample"  # streaming within the step stays


def test_streaming_trainer_takes_micro_batches_at_staleness_zero():
    """Rule 1's exception: a streaming trainer (stream: true, the default when micro_batch <
    the step) trains each micro-batch as it is ready, also at a = 0 (the step's rows still)."""
    g = gran(after(src(alpha=0)))
    assert g["generate", "update"] == "micro_batch" and g["advantage", "update"] == "group"


def test_batch_estimator_is_step():
    """Rules 2, 7, 8: reinforce_pp sees the whole step, and emits by step.

        score -step-> advantage(reinforce_pp) -step-> update
    """
    g = gran(after(src(estimator="reinforce_pp")))
    assert g["score", "advantage"] == "step"
    assert g["advantage", "update"] == "step"


def test_read_rows_rule_9():
    """Rule 9: sample readers read whatever is ready (0); update reads lcm(group 4, mb 8) = 8."""
    g = after(src())
    assert g.meta("generate")["read_rows"] == 0
    assert g.meta("advantage")["read_rows"] == 4
    assert g.meta("update")["read_rows"] == 8
    assert g.edge_meta("score", "advantage")["unit_rows"] == 4


def test_filter_needs_groups_rule_4():
    """Rule 4: a filter between score and advantage takes whole groups.

        score -group-> keep -group-> advantage
    """
    d = yaml.safe_load(src())
    d["tasks"]["keep"] = {"kind": "filter", "fn": "asyncflow.filters:group_has_variance",
                          "inputs": ["reward"], "outputs": ["kept"]}
    d["tasks"]["advantage"]["inputs"] = ["reward", "kept"]
    g = gran(after(yaml.safe_dump(d, sort_keys=False)))
    assert g["score", "keep"] == "group" and g["keep", "advantage"] == "group"


def test_concurrency_async_rules_10_11():
    """Rules 10, 11: one stage; pool train time-shares ref and update, generate runs throughout.

        slot 0: generate, score, ref, advantage     slot 1: generate, score, advantage, update
    """
    g = after(src())
    assert g.g.graph["concurrency"] == [["generate", "score", "ref", "advantage"],
                                        ["generate", "score", "advantage", "update"]]


def test_concurrency_sync_rule_10():
    """Rule 10: a = 0 puts update behind a step barrier, alone."""
    g = after(src(alpha=0, stream=False))
    assert g.g.graph["concurrency"] == [["generate", "score", "ref", "advantage"], ["update"]]
    assert g.meta("update")["stage"] == 1


def test_concurrency_run_ahead_rule_12():
    """Rule 12: with reinforce_pp (step edges) and a = 1, generate and score keep working on the
    next step during the later stages; ref does not join update (same pool).

        stage 0: generate, score, ref | stage 1: advantage (+ run-ahead) | stage 2: update (+ ...)
    """
    c = after(src(estimator="reinforce_pp")).g.graph["concurrency"]
    assert c[0] == ["generate", "score", "ref"]
    assert c[1] == ["generate", "score", "ref", "advantage"]
    assert c[2] == ["generate", "score", "update"]


def test_group_of_one_is_af405():
    """Rule 3 with samples_per_prompt 1: every grpo advantage is 0 -> error AF405, located."""
    ctx = Context()
    with pytest.raises(UserError):
        after(src(samples_per_prompt=1, prompts_per_step=8), ctx)
    assert [(d.code, d.severity) for d in ctx.diags.items] == [("AF405", "error")]
    assert ctx.diags.items[0].loc.line > 0
