"""Continuous batching for the ``hf`` engine (asyncflow/engines/hf_serve.py) on a tiny decoder:
same tokens as ``generate``, slots, streaming, cancel, weight updates mid-flight, length caps."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from asyncflow.engines import hf_serve  # noqa: E402
from asyncflow.engines import torch_common as tc  # noqa: E402
from asyncflow.engines.base import EngineSpec, TurnServer  # noqa: E402
from asyncflow.engines.hf import HFEngine  # noqa: E402
from asyncflow.models import tiny_decoder  # noqa: E402
from asyncflow.tokens import Text  # noqa: E402

pytestmark = pytest.mark.engine

MODEL = {"name": "policy", "init": "asyncflow.models:tiny_decoder",
         "args": {"layers": 1, "hidden": 32, "heads": 2, "seed": 0,
                  "initializer_range": 0.2}}  # varied greedy tokens (0.02: one token)
PARETO = {"dist": "pareto", "scale": 3, "alpha": 1.2, "max": 24, "seed": 7}
PROMPTS = [f"{i}+{3 * i}=" if i % 3 else f"copy {i * 71}=" for i in range(10)]
ROWS = list(range(40, 50))


def engine(on_update=None, **args):
    args = {"threads": 1, "temperature": 0.0, "max_new_tokens": PARETO, **args}
    extra = {"on_update": on_update} if on_update else {}
    return HFEngine(EngineSpec(task="gen", kind="rollout", model=MODEL, args=args,
                               outputs=("response", "logprobs"), extra=extra))


def new_weights():
    """The state dict of another tiny decoder (a different seed): a 'trained' policy."""
    model, _ = tiny_decoder(**{**MODEL["args"], "seed": 1})
    return {k: v.clone() for k, v in model.state_dict().items()}


class Feed:
    """``pull``/``emit`` for ``serve``: hands out the rows in order, as many as asked; ``None``
    once all are emitted. ``hooks[n]`` runs on the n-th pull (1-based) and may return extra columns
    (e.g. ``_cancel``). Records the pull count at each emit and the rows in flight."""

    def __init__(self, prompts, rows, hooks=None):
        self.todo = list(zip(prompts, rows))
        self.hooks = hooks or {}
        self.pulls = 0
        self.out: dict[int, dict] = {}
        self.order: list[tuple[int, int]] = []  # (row, pull count when emitted)
        self.flight: set[int] = set()
        self.peak = 0

    def pull(self, k):
        self.pulls += 1
        extra = self.hooks.get(self.pulls, lambda: None)() or {}
        for r in extra.get("_cancel", ()):
            self.flight.discard(r)
        if not self.todo and not extra and not self.flight:
            return None  # all served: serve returns
        take, self.todo = self.todo[:k], self.todo[k:]
        self.flight |= {r for _, r in take}
        self.peak = max(self.peak, len(self.flight))
        return {"prompt": [p for p, _ in take], "_row": [r for _, r in take],
                "_group": [r // 2 for _, r in take], **extra}

    def emit(self, row):
        assert row["_row"] in self.flight
        self.flight.discard(row["_row"])
        self.out[row["_row"]] = row
        self.order.append((row["_row"], self.pulls))


def serve(e, prompts=PROMPTS, rows=ROWS, hooks=None):
    feed = Feed(prompts, rows, hooks)
    assert e.serve(feed.pull, feed.emit) == len(feed.out)
    return feed


def test_greedy_queue_equals_generate_and_caps_hold():
    e = engine(slots=4)
    ref = e.generate({"prompt": PROMPTS, "_row": ROWS})
    feed = serve(e)
    assert sorted(feed.out) == ROWS
    eos = e.tokenizer.eos_id
    caps = [hf_serve.length_cap(e.length_dist, r) for r in ROWS]
    assert len(set(caps)) > 3  # long-tailed per-row caps, not one length
    for i, r in enumerate(ROWS):
        got, want = feed.out[r], ref["response"][i]
        assert set(got) == {"_row", "_group", "_version", "response", "logprobs"}
        assert got["_group"] == r // 2 and got["_version"] == 0
        assert isinstance(got["response"], Text)
        assert got["response"].ids == want.ids and str(got["response"]) == str(want)
        assert got["response"].prompt_ids == want.prompt_ids
        lps, ref_lps = got["logprobs"], ref["logprobs"][i]
        assert len(lps) == len(ref_lps) == len(want.ids)
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4
        # the row's own cap holds in both paths; a row without eos stops exactly at it
        n = len(want.ids)
        assert 1 <= n <= caps[i]
        assert want.ids[-1] == eos or n == caps[i]
    assert feed.peak <= 4


def test_slots_cache_trimmed_and_cancel_queued():
    e = engine(max_new_tokens=PARETO, slots=3)
    server = hf_serve.HFTurnServer(e)
    assert isinstance(server, TurnServer)
    for r, p in zip(ROWS, PROMPTS):
        server.submit(r, e._prompt_ids(p))
    assert server.cancel([ROWS[-1], 999]) == 1  # a queued one
    done = {}
    while server.in_flight():
        for key, ids, lps, version in server.poll(0.0):
            done[key] = ids
        assert len(server.running) <= 3
        if server.running:  # the cache is exactly as wide as the longest live sequence
            widest = max(len(q.prefix) + len(q.ids) - 1 for q in server.running)
            assert server.mask.shape[1] == widest
            assert all(k.shape[2] == widest for k, _ in hf_serve._layers(server.cache))
    assert server.peak_running == 3
    assert sorted(done) == ROWS[:-1]
    ref = e.generate({"prompt": PROMPTS[:-1], "_row": ROWS[:-1]})
    assert [done[r] for r in ROWS[:-1]] == [list(t.ids) for t in ref["response"]]


def test_streaming_emits_short_rows_before_the_longest_finishes():
    e = engine(slots=len(ROWS))
    feed = serve(e)
    lengths = {r: len(row["response"].ids) for r, row in feed.out.items()}
    at = dict(feed.order)
    longest = max(lengths, key=lengths.get)
    assert min(lengths.values()) < lengths[longest]
    # all rows start together: each is emitted the step it finishes, so in length order
    assert [lengths[r] for r, _ in feed.order] == sorted(lengths.values())
    assert all(at[r] < at[longest] for r in lengths if lengths[r] < lengths[longest])


def test_cancel_drops_running_rows():
    e = engine(max_new_tokens=20, slots=2)
    feed = serve(e, hooks={3: lambda: {"_cancel": [ROWS[0]]}})
    assert ROWS[0] not in feed.out and sorted(feed.out) == ROWS[1:]
    assert e.cancelled == 1


def test_abort_restarts_in_flight_rows_with_new_weights():
    e = engine(on_update="abort", max_new_tokens=12, slots=4)
    weights = new_weights()
    old = e.generate({"prompt": PROMPTS[:4], "_row": ROWS[:4]})
    # pull 1 admits 4 rows (one token each from the prefill); pull 2 publishes version 1
    feed = serve(e, hooks={2: lambda: e.update_weights(weights, 1)})
    running = sum(len(t.ids) > 1 for t in old["response"])
    assert running >= 3 and e.aborted == running
    ref = e.generate({"prompt": PROMPTS, "_row": ROWS})  # the new weights throughout
    assert [t.ids for t in ref["response"][:4]] != [t.ids for t in old["response"]]
    for i, r in enumerate(ROWS):
        got = feed.out[r]
        if i >= 4 or len(old["response"][i].ids) > 1:
            assert got["_version"] == 1
            assert got["response"].ids == ref["response"][i].ids
            assert max(abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"][i])) < 1e-4


def test_continue_keeps_tokens_and_oldest_version():
    e = engine(on_update="continue", max_new_tokens=12, slots=4)
    weights = new_weights()
    old = e.generate({"prompt": PROMPTS, "_row": ROWS})
    # pull 1 admits rows 0-3 (token 1), step 2 samples token 2, pull 3 publishes version 1
    feed = serve(e, hooks={3: lambda: e.update_weights(weights, 1)})
    new = e.generate({"prompt": PROMPTS, "_row": ROWS})
    assert e.aborted == 0
    for i, r in enumerate(ROWS):
        got, before = feed.out[r]["response"].ids, old["response"][i].ids
        if i < 4:  # in flight at the update: old tokens kept, oldest version reported
            assert feed.out[r]["_version"] == 0
            assert got[:2] == before[:2]
        elif feed.out[r]["_version"] == 1:  # admitted after it: the new policy throughout
            assert got == new["response"][i].ids
    assert any(feed.out[r]["_version"] == 1 for r in ROWS[4:])
    moved = [i for i in range(4) if len(old["response"][i].ids) > 2]
    assert any(feed.out[ROWS[i]]["response"].ids != old["response"][i].ids for i in moved)


def test_sampling_per_request_generator():
    logits = torch.randn(5, 40)
    gens = [torch.Generator().manual_seed(s) for s in range(5)]
    tokens, lps = hf_serve.sample_rows(logits, 0.8, 0.9, gens)
    for i in range(5):  # row i draws what tc.sample draws for it alone with its generator
        t, lp = tc.sample(logits[i:i + 1], 0.8, 0.9, torch.Generator().manual_seed(i))
        assert int(t) == int(tokens[i]) and abs(float(lp) - float(lps[i])) < 1e-6
    # at T > 0 a row's sample does not depend on the batch it runs in
    a = serve(engine(temperature=1.0, slots=1))
    b = serve(engine(temperature=1.0, slots=len(ROWS)))
    assert all(a.out[r]["response"].ids == b.out[r]["response"].ids for r in ROWS)
    assert len({a.out[r]["response"].ids for r in ROWS}) > 1


def test_multiturn_serve_equals_generate_episodes():
    env = {"env": "asyncflow.envs:digits_dialogue",
           "env_args": {"max_turns": 3, "stop_on_error": False}}
    e = HFEngine(EngineSpec(task="gen", kind="rollout", model=MODEL,
                            args={"threads": 1, "temperature": 0.0, "max_new_tokens": 4,
                                  "max_turns": 3, "slots": 2},
                            outputs=("response", "logprobs", "reward"), extra=env))
    prompts, answers = ["3+4=", "2+2=", "1+0=", "5+1="], [("7",), ("4",), ("1",), ("6",)]
    rows = [0, 1, 2, 3]
    ref = e.generate({"prompt": prompts, "context": answers, "_row": rows})
    todo = list(zip(prompts, answers, rows))
    out = {}

    def pull(k):
        nonlocal todo
        if not todo:
            return None
        take, todo = todo[:k], todo[k:]
        return {"prompt": [t[0] for t in take], "context": [t[1] for t in take],
                "_row": [t[2] for t in take], "_group": [0] * len(take)}

    assert e.serve(pull, lambda row: out.setdefault(row["_row"], row)) == 4
    for i, r in enumerate(rows):
        got, want = out[r]["response"], ref["response"][i]
        assert got.ids == want.ids and got.mask == want.mask and got.masked
        assert out[r]["reward"] == pytest.approx(ref["reward"][i])
        assert max(abs(a - b) for a, b in zip(out[r]["logprobs"], ref["logprobs"][i])) < 1e-4
        assert out[r]["_version"] == 0
