"""Continuous batching on the ``vllm`` engine (``VLLMEngine.serve``, ``VLLMTurnServer``): the same
samples as ``generate`` row by row, slots, cancel, weight updates mid-flight, length caps.

Needs vLLM (on a CPU: ``scripts/install-vllm.sh``, then
``.venv-vllm/bin/python -m pytest tests/test_vllm_serve.py -m vllm``); skipped without it.
"""
from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed (scripts/install-vllm.sh)")
torch = pytest.importorskip("torch")

from asyncflow.engines.base import EngineSpec, TurnServer  # noqa: E402
from asyncflow.engines.hf_serve import length_cap  # noqa: E402
from asyncflow.engines.vllm import VLLMEngine, VLLMTurnServer  # noqa: E402
from asyncflow.models import tiny_decoder  # noqa: E402

pytestmark = pytest.mark.vllm

# head size 32 (vLLM's CPU attention), a wide init: varied greedy tokens without near-ties
ARGS = {"layers": 2, "hidden": 64, "heads": 2, "seed": 3, "initializer_range": 0.1}
MODEL = {"name": "policy", "init": "asyncflow.models:tiny_decoder", "args": ARGS}
PARETO = {"dist": "pareto", "scale": 3, "alpha": 1.2, "max": 24, "seed": 7}
PROMPTS = [f"{i}+{3 * i}=" if i % 3 else f"copy {i * 71}=" for i in range(10)]
ROWS = list(range(40, 50))
TOL = 1e-4


def make(on_update=None, **args):
    args = {"threads": 2, "temperature": 0.0, "max_new_tokens": PARETO, **args}
    extra = {"on_update": on_update} if on_update else {}
    return VLLMEngine(EngineSpec(task="gen", kind="rollout", model=MODEL, args=args,
                                 outputs=("response", "logprobs"), extra=extra))


def state(seed):
    model, _ = tiny_decoder(**{**ARGS, "seed": seed})
    return {k: v.clone() for k, v in model.state_dict().items()}


# engines are module-scoped: vLLM's process-wide state must outlive every engine of the process
@pytest.fixture(scope="module")
def aborting():
    return make("abort", slots=4)


@pytest.fixture(scope="module")
def continuing():
    return make("continue", slots=4)


@pytest.fixture(scope="module")
def sampler():
    return make(temperature=0.8, top_p=0.9, slots=3)


class Feed:
    """pull/emit for serve: rows in order, as many as asked; ``None`` once all are emitted.
    ``hooks[n]`` runs on the n-th pull and may return extra columns (``_cancel``)."""

    def __init__(self, prompts=PROMPTS, rows=ROWS, hooks=None):
        self.todo = list(zip(prompts, rows))
        self.hooks = hooks or {}
        self.pulls = 0
        self.out: dict[int, dict] = {}
        self.order: list[int] = []
        self.flight: set[int] = set()
        self.peak = 0

    def pull(self, k):
        self.pulls += 1
        extra = self.hooks.get(self.pulls, lambda: None)() or {}
        for r in extra.get("_cancel", ()):
            self.flight.discard(r)
        if not self.todo and not extra and not self.flight:
            return None
        take, self.todo = self.todo[:k], self.todo[k:]
        self.flight |= {r for _, r in take}
        self.peak = max(self.peak, len(self.flight))
        return {"prompt": [p for p, _ in take], "_row": [r for _, r in take],
                "_group": [r // 2 for _, r in take], **extra}

    def emit(self, row):
        assert row["_row"] in self.flight
        self.flight.discard(row["_row"])
        self.out[row["_row"]] = row
        self.order.append(row["_row"])


def run(e, **kw):
    feed = Feed(**kw)
    assert e.serve(feed.pull, feed.emit) == len(feed.out)
    return feed


def same(feed, ref, rows=ROWS, version=None):
    for i, r in enumerate(rows):
        got, want = feed.out[r], ref["response"][i]
        assert got["response"].ids == want.ids and str(got["response"]) == str(want)
        assert got["response"].prompt_ids == want.prompt_ids
        diffs = [abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"][i])]
        assert len(got["logprobs"]) == len(want.ids) and max(diffs) < TOL
        if version is not None:
            assert got["_version"] == version


def test_serve_equals_generate_row_by_row(aborting, sampler):
    e = aborting
    e.update_weights(state(3), 0)
    ref = e.generate({"prompt": PROMPTS, "_row": ROWS})
    feed = run(e)
    same(feed, ref, version=0)
    assert feed.peak <= 4
    caps = [length_cap(e.length_dist, r) for r in ROWS]
    assert len(set(caps)) > 3
    for i, r in enumerate(ROWS):  # per-row caps: a row without eos stops exactly at its cap
        ids = feed.out[r]["response"].ids
        assert 1 <= len(ids) <= caps[i]
        assert ids[-1] == e.tokenizer.eos_id or len(ids) == caps[i]
        assert feed.out[r]["_group"] == r // 2
    # sampling (T 0.8, top-p 0.9): a row's seed is its own, so serve draws what generate drew
    ref = sampler.generate({"prompt": PROMPTS, "_row": ROWS})
    same(run(sampler), ref)


def test_turn_server_slots_and_cancel(sampler):
    server = VLLMTurnServer(sampler)
    assert isinstance(server, TurnServer) and server.slots == 3
    for r, p in zip(ROWS, PROMPTS):
        server.submit(r, sampler._prompt_ids(p))
    assert server.cancel([ROWS[-1]]) == 1  # queued
    done = {}
    while server.in_flight():
        for key, ids, lps, version in server.poll(0.0):
            done[key] = ids
        assert len(server.running) <= 3
        if len(done) == 2 and ROWS[5] not in done:
            assert server.cancel([ROWS[5]]) == 1  # running or queued: gone either way
    assert server.peak_running == 3
    assert sorted(done) == [r for r in ROWS[:-1] if r != ROWS[5]]
    # serve: a _cancel row leaves vLLM at once and is never emitted
    before = sampler.cancelled
    feed = run(sampler, hooks={2: lambda: {"_cancel": [ROWS[0]]}})
    assert ROWS[0] not in feed.out and sorted(feed.out) == ROWS[1:]
    assert sampler.cancelled == before + 1


def test_abort_restarts_in_flight_rows_with_new_weights(aborting):
    e = aborting
    e.update_weights(state(3), 0)
    old = e.generate({"prompt": PROMPTS[:4], "_row": ROWS[:4]})
    new = state(11)
    aborted = e.aborted
    # pull 1 queues 4 rows, step 1 prefills them; pull 2 publishes version 1
    feed = run(e, hooks={2: lambda: e.update_weights(new, 1)})
    ref = e.generate({"prompt": PROMPTS, "_row": ROWS})
    assert [t.ids for t in ref["response"][:4]] != [t.ids for t in old["response"]]
    assert e.aborted - aborted == sum(len(t.ids) > 1 for t in old["response"]) >= 3
    survivors = [r for i, r in enumerate(ROWS) if i >= 4 or len(old["response"][i].ids) > 1]
    same(feed, {k: [v[ROWS.index(r)] for r in survivors] for k, v in ref.items()}, survivors,
         version=1)


def test_continue_keeps_tokens_and_oldest_version(continuing):
    e = continuing
    assert not e.prefix_caching
    e.update_weights(state(3), 0)
    old = e.generate({"prompt": PROMPTS, "_row": ROWS})
    new = state(11)
    # pull 1 queues rows 0-3, step 1 gives their first token, step 2 the second; pull 3
    # publishes version 1
    feed = run(e, hooks={3: lambda: e.update_weights(new, 1)})
    ref = e.generate({"prompt": PROMPTS, "_row": ROWS})
    for i, r in enumerate(ROWS):
        got = feed.out[r]
        if i < 4:
            assert got["_version"] == 0
            assert got["response"].ids[:2] == old["response"][i].ids[:2]
        elif got["_version"] == 1:
            assert got["response"].ids == ref["response"][i].ids
    assert any(feed.out[r]["_version"] == 1 for r in ROWS[4:])
    moved = [i for i in range(4) if len(old["response"][i].ids) > 2]
    assert any(feed.out[ROWS[i]]["response"].ids != old["response"][i].ids for i in moved)
    assert e.aborted == 0


def test_multiturn_serve_equals_hf_episodes():
    """Episodes through serve_episodes over a VLLMTurnServer (agent turn t of row r is request
    (r, t)) give, greedily, the episodes hf's lock-step generate gives."""
    from asyncflow.engines.hf import HFEngine

    env = {"env": "asyncflow.envs:digits_dialogue",
           "env_args": {"max_turns": 3, "stop_on_error": False}}
    args = {"threads": 2, "temperature": 0.0, "max_new_tokens": 4, "max_turns": 3, "slots": 2}
    outputs = ("response", "logprobs", "reward")
    e = VLLMEngine(EngineSpec(task="gen", kind="rollout", model=MODEL, args=args,
                              outputs=outputs, extra=env))
    hf = HFEngine(EngineSpec(task="gen", kind="rollout", model=MODEL, args=args,
                             outputs=outputs, extra=env))
    prompts, answers = ["3+4=", "2+2=", "1+0=", "5+1="], [("7",), ("4",), ("1",), ("6",)]
    rows = [0, 1, 2, 3]
    ref = hf.generate({"prompt": prompts, "context": answers, "_row": rows})
    todo = list(zip(prompts, answers, rows))
    out = {}

    def pull(k):
        nonlocal todo
        if not todo:
            return None
        take, todo = todo[:k], todo[k:]
        return {"prompt": [t[0] for t in take], "context": [t[1] for t in take],
                "_row": [t[2] for t in take]}

    assert e.serve(pull, lambda row: out.setdefault(row["_row"], row)) == 4
    for i, r in enumerate(rows):
        got, want = out[r]["response"], ref["response"][i]
        assert got.ids == want.ids and got.mask == want.mask and got.masked
        assert out[r]["reward"] == pytest.approx(ref["reward"][i])
        assert max(abs(a - b) for a, b in zip(out[r]["logprobs"], ref["logprobs"][i])) < TOL
