"""Multi-turn (agentic) rollouts: the episode driver, the loss mask, the hf engine, a real run."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from shared_runs import shipped_run

from asyncflow.engines import multiturn
from asyncflow.envs import DigitsDialogue, digits_dialogue
from asyncflow.models import CharTokenizer
from asyncflow.tokens import Text

ROOT = Path(__file__).resolve().parent.parent
TOK = CharTokenizer()
BOS, EOS = TOK.bos_id, TOK.eos_id  # 1, 2
ROWS = [{"prompt": "3+4=", "answer": "7", "_row": 0},
        {"prompt": "2+2=", "answer": "4", "_row": 1},
        {"prompt": "1+0=", "answer": "1", "_row": 2}]
RESETS = [(r["prompt"], r["answer"]) for r in ROWS]  # reset(prompt, answer): the inputs in order
# DigitsDialogue draws the next operand from a RNG seeded by crc32 of the row, so these are fixed:
# "3+4=" (7) continues " +3=" then " +7="; "1+0=" (1) continues " +5=".
SCRIPT = {  # dialogue so far (specials dropped) -> the agent's turn (text, whether it ends in eos)
    "3+4=": ("7", True),             # right (7)
    "3+4=7 +3=": ("10", True),       # right (10)
    "3+4=7 +3=10 +7=": ("17", False),  # right (17), cut by max_new_tokens: no eos
    "2+2=": ("5", True),             # wrong (4): the episode ends
    "1+0=": ("1", True),             # right (1)
    "1+0=1 +5=": ("7", True),        # wrong (6): the episode ends
}


class ScriptedSampler:
    """Plays SCRIPT; token j of a turn gets log-prob -(j + 1) / 10. Records every call."""

    def __init__(self):
        self.calls: list[list[list[int]]] = []

    def __call__(self, prefixes):
        self.calls.append([list(p) for p in prefixes])
        tokens, logprobs = [], []
        for p in prefixes:
            text, eos = SCRIPT[TOK.decode(p)]
            ids = TOK.encode(text) + ([EOS] if eos else [])
            tokens.append(ids)
            logprobs.append([-(j + 1) / 10 for j in range(len(ids))])
        return tokens, logprobs


def enc(s):
    return TOK.encode(s)


# ---------------------------------------------------------------------- the driver

def test_driver_exact_layout_mask_logprobs_and_return():
    sampler = ScriptedSampler()
    eps = multiturn.run_episodes(RESETS, sampler, TOK, lambda: DigitsDialogue(max_turns=3),
                                 max_turns=3)
    a, b, c = eps
    # the first observation (reset) is the prompt, after bos
    assert a.prompt_ids == [BOS] + enc("3+4=") == [1, 7, 14, 8, 18]
    # row a: 7<eos> | " +3=" | 10<eos> | " +7=" | 17 ; the final observation is not appended
    assert a.ids == [11, 2, 73, 14, 7, 18, 5, 4, 2, 73, 14, 11, 18, 5, 11]
    assert a.ids == (enc("7") + [EOS] + enc(" +3=") + enc("10") + [EOS] + enc(" +7=")
                     + enc("17"))
    assert a.mask == [1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert a.logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, 0.0, -0.1, -0.2, -0.3, 0.0, 0.0, 0.0, 0.0,
                          -0.1, -0.2]
    assert a.rewards == pytest.approx([1 / 3] * 3) and a.ret == pytest.approx(1.0)
    assert a.turns == 3 and a.done
    # row b: wrong at once -> one turn, no observation, return 0
    assert b.ids == [9, 2] and b.mask == [1, 1] and b.logprobs == [-0.1, -0.2]
    assert b.ret == 0.0 and b.turns == 1 and b.done
    # row c: right, then wrong
    assert c.ids == enc("1") + [EOS] + enc(" +5=") + enc("7") + [EOS]
    assert c.mask == [1, 1, 0, 0, 0, 0, 1, 1]
    assert c.logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, 0.0, -0.1, -0.2]
    assert c.ret == pytest.approx(1 / 3) and c.turns == 2


def test_driver_batches_turns_and_stops_sampling_finished_episodes():
    sampler = ScriptedSampler()
    multiturn.run_episodes(RESETS, sampler, TOK, lambda: DigitsDialogue(max_turns=3), max_turns=3)
    # one batched call per turn, over the still-active episodes only: 3, then a and c, then a
    assert [len(c) for c in sampler.calls] == [3, 2, 1]
    assert sampler.calls[1] == [[1, 7, 14, 8, 18, 11, 2, 73, 14, 7, 18],  # a: prompt+7<eos>+obs
                                [1, 5, 14, 4, 18, 5, 2, 73, 14, 9, 18]]  # c: prompt+1<eos>+obs
    assert TOK.decode(sampler.calls[2][0]) == "3+4=7 +3=10 +7="


class Endless:
    """Never done: observation "ok", reward 0.5 per turn."""

    def reset(self, *inputs):
        return "go="

    def step(self, action):
        return "ok", 0.5, False


def test_driver_max_turns_caps_episodes_without_trailing_observation():
    sampler = lambda prefixes: ([[11, EOS] for _ in prefixes], [[-1.0, -2.0] for _ in prefixes])
    (ep,) = multiturn.run_episodes([()], sampler, TOK, Endless, max_turns=2)
    assert ep.ids == [11, EOS] + enc("ok") + [11, EOS]
    assert ep.mask == [1, 1, 0, 0, 1, 1]
    assert ep.rewards == [0.5, 0.5] and not ep.done


def test_rollout_columns_text_and_reward_column():
    cols = multiturn.rollout_columns(
        {"prompt": [r["prompt"] for r in ROWS], "context": [(r["answer"],) for r in ROWS],
         "_row": [r["_row"] for r in ROWS]}, ScriptedSampler(), TOK,
        "asyncflow.envs:digits_dialogue", {"max_turns": 3, "temperature": 1.0},  # not accepted
        max_turns=3, outputs=("response", "logprobs", "reward"))
    assert set(cols) == {"response", "logprobs", "reward"}
    a = cols["response"][0]
    assert isinstance(a, Text) and str(a) == "7 +3=10 +7=17" and a.masked
    assert a.prompt_ids == (1, 7, 14, 8, 18)
    assert a.mask == (1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1)
    assert len(cols["logprobs"][0]) == len(a.ids)
    assert cols["reward"] == pytest.approx([1.0, 0.0, 1 / 3])
    two = multiturn.rollout_columns({"prompt": ["2+2="], "context": [("4",)]}, ScriptedSampler(), TOK,
                                    digits_dialogue, None, 3, ("response", "logprobs"))
    assert set(two) == {"response", "logprobs"}  # reward only when declared


def test_accepted_kwargs():
    got = multiturn.accepted_kwargs(digits_dialogue, {"max_turns": 2, "lr": 1.0})
    assert got == {"max_turns": 2}
    assert multiturn.accepted_kwargs(lambda **kw: None, {"a": 1}) == {"a": 1}


# ---------------------------------------------------------------------- Text and pack

def test_text_mask_defaults_pickles_and_keeps_str_behaviour():
    plain = Text("ab", [30, 31], [1])
    assert plain.mask == (1, 1) and not plain.masked
    t = Text("7 +3=", [11, 2, 73, 14, 7, 18], [1, 7], [1, 1, 0, 0, 0, 0])
    assert t == "7 +3=" and t.startswith("7") and str(t) == "7 +3=" and hash(t) == hash("7 +3=")
    assert t.masked and t.mask == (1, 1, 0, 0, 0, 0)
    back = pickle.loads(pickle.dumps(t))
    assert isinstance(back, Text) and back == t and back.ids == t.ids
    assert back.prompt_ids == t.prompt_ids and back.mask == t.mask
    assert not Text("a", [30], (), [1]).masked  # an all-ones mask is the default
    with pytest.raises(ValueError):
        Text("a", [30, 31], (), [1])
    with pytest.raises(ValueError):
        Text("a", [30], (), [2])


def test_pack_loss_mask_narrows_response_mask_not_attention():
    torch = pytest.importorskip("torch")
    from asyncflow.engines import torch_common as tc

    prompts, resps = [[1, 7], [1]], [[11, 2, 73, 14], [9]]
    plain = tc.pack(prompts, resps, 0)
    masked = tc.pack(prompts, resps, 0, [[1, 1, 0, 0], None])
    assert torch.equal(plain.input_ids, masked.input_ids)
    assert torch.equal(plain.attention_mask, masked.attention_mask)
    assert torch.equal(plain.position_ids, masked.position_ids)
    assert masked.response_mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]
    assert plain.response_mask.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]
    assert masked.tokens == 3 and plain.tokens == 5 and masked.lengths == [4, 1]
    assert tc.loss_masks([Text("x", [30]), "y"]) is None
    assert tc.loss_masks([Text("x", [30, 2], (), [1, 0]), "y"]) == [(1, 0), None]


# ---------------------------------------------------------------------- the hf engine

MODEL = {"name": "policy", "init": "asyncflow.models:tiny_decoder",
         "args": {"layers": 1, "hidden": 32, "heads": 2, "seed": 0}}


def hf(kind, args=None, outputs=(), loss=None, extra=None):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from asyncflow.engines.base import EngineSpec
    from asyncflow.engines.hf import HFEngine

    return HFEngine(EngineSpec(task=kind, kind=kind, model=MODEL,
                               args={"threads": 1, **(args or {})}, outputs=outputs, loss=loss,
                               extra=dict(extra or {})))


ENV = {"env": "asyncflow.envs:digits_dialogue",
       "env_args": {"max_turns": 3, "stop_on_error": False}}


@pytest.mark.engine
def test_hf_multiturn_generate_matches_scorer_on_agent_tokens():
    gen = hf("rollout", {"max_new_tokens": 3, "max_turns": 3}, ("response", "logprobs", "reward"),
             extra=ENV)
    batch = {"prompt": [r["prompt"] for r in ROWS], "context": [(r["answer"],) for r in ROWS],
             "_row": [0, 1, 2]}
    out = gen.generate(batch)
    assert set(out) == {"response", "logprobs", "reward"}
    for row, resp, lps, ret in zip(ROWS, out["response"], out["logprobs"], out["reward"]):
        assert resp.prompt_ids == (BOS, *enc(row["prompt"]))
        assert len(lps) == len(resp.ids) == len(resp.mask)
        assert 0.0 <= ret <= 1.0
        # never done early (stop_on_error false): 3 agent turns, 2 observations in between;
        # replaying the environment on the agent turns gives back the observation tokens
        env = DigitsDialogue(max_turns=3, stop_on_error=False)
        env.reset(row["prompt"], row["answer"])
        ids, mask, turns, total, i = list(resp.ids), list(resp.mask), 0, 0.0, 0
        while i < len(ids):
            j = i
            while j < len(ids) and mask[j] == 1:
                j += 1
            obs, r, done = env.step(TOK.decode(ids[i:j]))
            turns, total = turns + 1, total + r
            k = j
            while k < len(ids) and mask[k] == 0:
                k += 1
            assert ids[j:k] == ([] if done else enc(obs))
            assert all(lp == 0.0 for lp in lps[j:k]) and all(lp < 0.0 for lp in lps[i:j])
            i = k
        assert turns == 3 and total == pytest.approx(ret)
    # the scorer recomputes the agent tokens' log-probs over the whole dialogue in one pass
    ref = hf("logprob", outputs=("ref",)).logprobs({"response": out["response"]})["ref"]
    diffs = [abs(a - b) for resp, x, y in zip(out["response"], ref, out["logprobs"])
             for a, b, m in zip(x, y, resp.mask) if m]
    assert diffs and max(diffs) < 1e-4


def _train_batch(obs_logprob=None, obs_adv=None, obs_ref=None, agent_logprob=None):
    """Two masked responses with per-token advantages; optional overrides of observation values
    (every mask-0 token) or of the first agent token's behaviour log-prob."""
    prompt = [BOS] + enc("3+4=")
    r1 = enc("7") + [EOS] + enc(" +3=") + enc("10") + [EOS]
    m1 = [1, 1, 0, 0, 0, 0, 1, 1, 1]
    r2 = enc("5") + [EOS] + enc(" no, 7. +1=") + enc("8")
    m2 = [1, 1] + [0] * len(enc(" no, 7. +1=")) + [1]
    resps = [Text(TOK.decode(r1), r1, prompt, m1), Text(TOK.decode(r2), r2, prompt, m2)]
    lps, advs, refs = [], [], []
    for k, (r, m) in enumerate(zip([r1, r2], [m1, m2])):
        lp = [-4.5 - 0.01 * j if mj else 0.0 for j, mj in enumerate(m)]
        adv = [(1.0 if k == 0 else -1.0) if mj else 0.0 for mj in m]
        ref = [-4.6 if mj else 0.0 for mj in m]
        for j, mj in enumerate(m):
            if not mj:
                lp[j] = obs_logprob if obs_logprob is not None else lp[j]
                adv[j] = obs_adv if obs_adv is not None else adv[j]
                ref[j] = obs_ref if obs_ref is not None else ref[j]
        lps.append(lp)
        advs.append(adv)
        refs.append(ref)
    if agent_logprob is not None:
        lps[0][0] = agent_logprob
    return {"prompt": ["3+4=", "3+4="], "response": resps, "logprobs": lps,
            "advantages": advs, "ref_logprobs": refs}


def _train_once(batch):
    import torch

    eng = hf("train", {"lr": 1e-2, "micro_batch": 1, "kl_coef": 0.1}, loss="grpo")
    metrics = eng.train_step(batch)
    weights = eng.export_weights()
    return metrics, torch.cat([v.flatten() for v in weights.values()])


@pytest.mark.engine
def test_observation_tokens_do_not_change_the_trainer():
    import torch

    base_m, base_w = _train_once(_train_batch())
    assert base_m["tokens"] == 3 + 2 + 2 + 1  # agent tokens only
    # anything on observation tokens (behaviour/ref log-probs, per-token advantages): no effect
    obs_m, obs_w = _train_once(_train_batch(obs_logprob=-30.0, obs_adv=100.0, obs_ref=-9.0))
    assert torch.equal(base_w, obs_w)
    for k in ("loss", "pg_loss", "kl", "entropy", "tokens", "grad_norm", "clip_frac"):
        assert obs_m[k] == base_m[k], k
    # one agent token's behaviour log-prob does change the update
    agent_m, agent_w = _train_once(_train_batch(agent_logprob=-1.0))
    assert not torch.equal(base_w, agent_w) and agent_m["loss"] != base_m["loss"]


@pytest.mark.engine
def test_entropy_and_kl_metrics_average_agent_tokens_only():
    import torch

    from asyncflow.engines import torch_common as tc

    batch = _train_batch()
    eng = hf("train", {"lr": 1e-2, "kl_coef": 0.1}, loss="grpo")
    resps = batch["response"]
    packed = tc.pack([list(r.prompt_ids) for r in resps], [list(r.ids) for r in resps], TOK.pad_id,
                     [r.mask for r in resps])
    with torch.no_grad():
        logits = eng._forward(packed)
        ent = tc.entropy(logits)
    mask = packed.response_mask
    expected = float((ent * mask).sum() / mask.sum())
    plain_mean = float((ent * (packed.attention_mask[:, packed.prompt_len:])).sum()
                       / packed.attention_mask[:, packed.prompt_len:].sum())
    metrics = eng.train_step(batch)
    assert metrics["entropy"] == pytest.approx(expected, rel=1e-5)
    assert abs(plain_mean - expected) > 1e-4  # the observation tokens would have shifted it


# ---------------------------------------------------------------------- runtime

def test_engine_spec_passes_env_and_the_args_the_factory_accepts(monkeypatch):
    from asyncflow.compiler import compile_file
    from asyncflow.runtime.worker import engine_spec

    monkeypatch.chdir(ROOT)
    plan = compile_file("pipelines/agentic_multiturn.yaml")
    spec = engine_spec(plan, plan.task("generate"), 0)
    assert spec.extra["env"] == "asyncflow.envs:digits_dialogue"
    args = plan.task("generate").args
    assert spec.extra["env_args"] == {k: args[k] for k in ("max_turns", "max_operand",
                                                            "stop_on_error")}
    assert "env" not in engine_spec(plan, plan.task("update"), 0).extra


@pytest.mark.engine
def test_cli_runs_the_agentic_pipeline(tmp_path_factory):
    # asyncflow run pipelines/agentic_multiturn.yaml --steps 3 --backend local, the run
    # test_trace_vs_plan.py holds against its plan (tests/shared_runs.py)
    out = Path(shipped_run(tmp_path_factory, "agentic_multiturn.yaml", "local").ok().out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [0, 1, 2]
    assert all(m["samples"] == 32 * 8 for m in rows)
    # only agent tokens count: at most 3 turns x 4 new tokens per sample
    assert all(0 < m["tokens"] <= 32 * 8 * 3 * 4 for m in rows)
    rewards = [m["reward_mean"] for m in rows]  # the episode returns, written by the rollout
    assert all(x is not None and 0.0 <= x <= 1.0 for x in rewards), rewards
