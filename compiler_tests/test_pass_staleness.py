"""The staleness pass (asyncflow/compiler/passes/staleness.py); rule numbers from its docstring."""
import copy

import yaml

from asyncflow.compiler import Context, compile_text
from asyncflow.compiler.passes.staleness import MAX_CAPACITY_ROWS, capacity

BASE = {
    "pipeline": "t",
    "models": {"policy": {"init": "asyncflow.models:tiny_decoder"},
               "reference": {"copy_of": "policy", "frozen": True}},
    "data": {"prompts": {"source": "asyncflow.datasets:digits", "fields": ["prompt", "answer"]}},
    "pools": {"rollout": {"devices": 1}, "train": {"devices": 1}},
    "step": {"prompts_per_step": 4, "samples_per_prompt": 4, "steps": 10},
    "tasks": {
        "gen": {"kind": "rollout", "engine": "hf", "model": "policy", "pool": "rollout",
                "inputs": ["prompt"], "outputs": ["response", "logprobs"]},
        "score": {"kind": "reward", "fn": "asyncflow.rewards:digits_match",
                  "inputs": ["prompt", "answer", "response"], "outputs": ["reward"]},
        "ref": {"kind": "logprob", "engine": "hf", "model": "reference", "pool": "train",
                "inputs": ["prompt", "response"], "outputs": ["ref_logprobs"]},
        "adv": {"kind": "advantage", "estimator": "grpo", "inputs": ["reward"],
                "outputs": ["advantages"]},
        "train": {"kind": "train", "engine": "hf", "model": "policy", "pool": "train", "loss": "grpo",
                  "inputs": ["prompt", "response", "logprobs", "ref_logprobs", "advantages"],
                  "args": {"micro_batch": 4}},
    },
    "sync": [{"from": "train", "to": "gen", "max_staleness": 2}],
}


def graph(alpha=2, ctx=None, **step):
    d = copy.deepcopy(BASE)
    d["sync"][0]["max_staleness"] = alpha
    d["step"].update(step)
    return compile_text(yaml.safe_dump(d, sort_keys=False), "t.yaml", stop_after="staleness",
                        verify=True, ctx=ctx)


def test_rollout_output_carries_alpha_and_propagates():
    """Rules 1-3.

        prompts -> gen ==(lag 2)==> score -> adv --+
           |        |                              v
           |        +--(lag 2)--> ref (frozen) -> train
           +--(lag 0)----------------------------> ^
        train ..sync a=2..> gen
    """
    g = graph(alpha=2)
    m = {t.name: g.meta(t.name) for t in g.tasks()}
    assert m["gen"]["own_lag"] == 2 and m["gen"]["lag"] == 2
    assert m["score"]["own_lag"] == 0 and m["score"]["lag"] == 2  # rule 2: propagates
    assert m["ref"]["own_lag"] == 0 and m["ref"]["lag"] == 2  # frozen model: own lag 0
    assert m["adv"]["lag"] == 2
    assert m["train"]["own_lag"] == 0 and m["train"]["lag"] == 2  # inputs carry the lag
    assert g.edge_meta("prompts", "train")["staleness"] == 0  # rule 3: sources lag 0
    assert g.edge_meta("gen", "train")["staleness"] == 2
    assert g.edge_meta("adv", "train")["staleness"] == 2


def test_run_ahead_rule_4():
    """Rule 4: gen runs a ahead, its data followers as far as their producers, train 0.

        prompts -> gen -> score -> adv -> train ..a..> gen
    """
    g = graph(alpha=3)
    assert g.meta("gen")["run_ahead"] == 3
    assert g.meta("score")["run_ahead"] == 3
    assert g.meta("train")["run_ahead"] == 0
    assert g.meta("prompts")["run_ahead"] == 3  # the source prefetches for its furthest consumer


def test_staleness_zero_is_lag_zero_everywhere():
    """Rule 1 with a = 0: nothing lags.

        prompts -> gen -> ... -> train ..0..> gen
    """
    g = graph(alpha=0)
    assert all(g.meta(t.name)["lag"] == 0 for t in g.tasks())
    assert all(m["staleness"] == 0 for _, m in g.data_edges())


def test_capacity_rule_5():
    """Rule 5: (run_ahead + 2) * samples_per_step, bounded by the run and MAX_CAPACITY_ROWS.

        gen --(a=2, 16 rows/step)--> score : capacity 64
    """
    g = graph(alpha=2)
    assert g.edge_meta("gen", "score")["capacity"] == 4 * 16
    assert g.edge_meta("adv", "train")["capacity"] == 4 * 16  # adv runs ahead with its inputs
    assert capacity(0, 16, 10) == 32
    assert capacity(0, 16, 1) == 16  # a one-step run holds one step
    assert capacity(50, 16, 10) == 160  # never more than the whole run
    assert capacity(10**9, 10**6, 10**9) == MAX_CAPACITY_ROWS


def test_alpha_not_below_steps_warns_af406():
    """a >= steps: a warning, not an error; the plan still compiles.

        train ..a=10..> gen   (steps: 10)
    """
    ctx = Context()
    graph(alpha=10, ctx=ctx)
    assert [d.code for d in ctx.diags.items] == ["AF406"]
    assert ctx.diags.items[0].severity == "warning"


def test_pass_is_pure():
    """The pass copies the graph: the input's meta stays empty.

        prompts -> gen -> ... -> train
    """
    from asyncflow.compiler.passes.staleness import staleness

    g = compile_text(yaml.safe_dump(BASE), "t.yaml", stop_after="validate")
    staleness(g, Context())
    assert all(not g.meta(n) for n in g.g.nodes)
