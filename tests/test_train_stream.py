"""Streaming into the trainer (``HFEngine.train_stream``) and token-balanced micro-batches.

One optimiser step over micro-batches that arrive one by one, in any order and of any sizes,
equals ``train_step`` on the whole batch, which equals one forward/backward over all rows with
the loss's own normaliser (the definition in :mod:`asyncflow.algos`). The paths differ only in
the order floating-point sums are taken (per-token terms within a micro-batch, then micro-batch
gradients, divided by the normaliser once at the end instead of per micro-batch), so fp32
results agree to rounding: gradients to 1e-5 of their largest entry (measured: 1-2e-7, a float32
ulp or two), parameters after one AdamW step at the default lr 1e-4 to 1e-6 absolute (measured:
<= 7e-8), metrics to 1e-5 relative. The parameter bound is looser than the gradients' because the
first Adam step is ``lr * g / (|g| + eps)``: for a gradient entry near ``eps`` (1e-8) a rounding
difference of 1e-12 moves the update by up to ``lr * 1e-4``; with lr 1e-2 that is 7e-6 for the
same 1e-7-relative gradients.
"""
from __future__ import annotations

import math
import random

import pytest

from asyncflow.runtime.ray_connect import local_worker_priority

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from asyncflow.engines import torch_common as tc  # noqa: E402
from asyncflow.engines.base import EngineSpec  # noqa: E402
from asyncflow.engines.hf import HFEngine  # noqa: E402
from asyncflow.engines.batching import balance_micro_batches, token_sums  # noqa: E402
from asyncflow.tokens import Text  # noqa: E402

pytestmark = pytest.mark.engine

MODEL = {"name": "policy", "init": "asyncflow.models:tiny_decoder",
         "args": {"layers": 1, "hidden": 32, "heads": 2, "seed": 0}}
GRAD_REL, PARAM_ABS, METRIC_REL = 1e-5, 1e-6, 1e-5
MICRO = 3

# (loss, extra task args, whether to add reference log-probs); ppo + kl, the value loss (critic)
# and seq_sum_norm (Dr. GRPO: divides by a length too), tis (an off-policy loss)
CASES = {
    "grpo": ("grpo", {}, False),
    "ppo_kl": ("ppo", {"kl_coef": 0.1}, True),
    "dapo": ("dapo", {}, False),
    "value": ("value", {}, False),
    "grpo_seq_sum_norm": ("grpo", {"loss_agg": "seq_sum_norm"}, False),
    "tis": ("tis", {}, False),
}


def trainer(loss, micro_batch=MICRO, **args):
    return HFEngine(EngineSpec(task="update", kind="train", model=MODEL, loss=loss,
                               args={"threads": 1, "lr": 1e-4, "micro_batch": micro_batch,
                                     **args}))


def scorer(kind="logprob"):
    out = ("values",) if kind == "value" else ("logprobs",)
    return HFEngine(EngineSpec(task=kind, kind=kind, model=MODEL, args={"threads": 1},
                               outputs=out))


def long_tailed(n, rng):
    """Response lengths: mostly short, a few long (as sampled responses are)."""
    return [min(40, 1 + int(rng.expovariate(1 / 4))) if i % 5 else 12 + rng.randrange(20)
            for i in range(n)]


def make_batch(loss, ref=False, n=11, seed=0, masked=False):
    """``n`` rows of random prompts and long-tailed responses; behaviour log-probs from the
    initial model plus noise (so some ratios are clipped); per-token advantages for ppo, one
    per sample otherwise; ``values``/``returns`` for the critic. ``masked``: multi-turn rows
    whose observation tokens (mask 0) carry garbage log-probs and advantages."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    resps = []
    for i, length in enumerate(long_tailed(n, rng)):
        p = [1] + [rng.randrange(4, 40) for _ in range(rng.randrange(1, 8))]
        r = [rng.randrange(4, 40) for _ in range(length)]
        mask = None
        if masked and i == 1:
            mask = [0] * length  # a row with no counted token at all
        elif masked and length >= 4:
            cut = rng.randrange(1, length - 2)
            mask = [1] * cut + [0] * min(3, length - cut - 1) + [1] * max(1, length - cut - 3)
        resps.append(Text("r", r, p, mask))
    batch = {"response": resps, "_row": list(range(n))}
    noise = lambda k: (0.3 * torch.randn(k, generator=g)).tolist()  # noqa: E731
    if loss == "value":
        vals = scorer("value").logprobs(batch)["values"]
        batch["values"] = [[v + e for v, e in zip(row, noise(len(row)))] for row in vals]
        batch["returns"] = [torch.randn(len(r.ids), generator=g).tolist() for r in resps]
        return batch
    lps = scorer().logprobs(batch)["logprobs"]
    batch["logprobs"] = [[v + e for v, e in zip(row, noise(len(row)))] for row in lps]
    if ref:
        batch["ref_logprobs"] = [[v + e for v, e in zip(row, noise(len(row)))] for row in lps]
    if loss == "ppo":
        batch["advantages"] = [torch.randn(len(r.ids), generator=g).tolist() for r in resps]
    else:
        batch["advantages"] = torch.randn(n, generator=g).tolist()
    if masked:  # garbage where the mask is 0: must change nothing
        for col in ("logprobs", "advantages"):
            batch[col] = [[1e3 if m == 0 else v for v, m in zip(row, r.mask)]
                          if isinstance(row, list) else row
                          for row, r in zip(batch[col], resps)]
    return batch


def rows_of(batch, idx):
    return {k: [v[i] for i in idx] for k, v in batch.items()}


def shuffled_uneven(n, seed=1):
    """Row indices in a shuffled order, cut into uneven micro-batches: one larger than
    ``micro_batch`` (split inside), one of a single row, an empty one, a short last one."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    sizes, out, i = [5, 1, 0, 2, 4], [], 0
    for s in sizes:
        out.append(order[i:i + s])
        i += s
    out.append(order[i:])
    assert sorted(j for mb in out for j in mb) == list(range(n))
    return out


def one_pass(engine, batch):
    """The definition: one forward/backward over all rows with the loss's own normaliser (the
    batch's token or sequence count, and its padded width for seq_sum_norm), clip, AdamW.
    Returns the loss's metrics on the whole batch."""
    engine.optimizer.zero_grad(set_to_none=True)
    mb = engine._micro(batch)
    loss, metrics = engine._micro_loss(mb.pack(engine.tokenizer.pad_id), batch, None,
                                       engine.loss_cfg)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(engine._params(), float(engine.max_grad_norm))
    engine.optimizer.step()
    return metrics


def state(engine):
    return {f"{i}": p.detach().clone() for i, p in enumerate(engine._params())}


def grads(engine):
    return {f"{i}": p.grad.detach().clone() for i, p in enumerate(engine._params())
            if p.grad is not None}


def assert_close(a: HFEngine, b: HFEngine):
    ga, gb = grads(a), grads(b)
    assert ga.keys() == gb.keys() and ga
    scale = max(float(g.abs().max()) for g in ga.values())
    assert scale > 0
    gdiff = max(float((ga[k] - gb[k]).abs().max()) for k in ga)
    assert gdiff <= GRAD_REL * scale, (gdiff, scale)
    pa, pb = state(a), state(b)
    pdiff = max(float((pa[k] - pb[k]).abs().max()) for k in pa)
    assert pdiff <= PARAM_ABS, pdiff
    return gdiff / scale, pdiff


def assert_metrics(m1, m2, keys=None):
    """Equal metrics. ``value_clip_frac`` up to two tokens in a hundred: algos/value.py marks a
    token clipped when ``(old + clamp(v - old) - R)^2 > (v - R)^2``, and inside the clip range
    ``old + (v - old)`` is ``v`` only up to rounding, so that test is a coin toss for ~0.15% of
    unclipped tokens, decided by 1e-7 differences in ``v`` (padding differs between splits)."""
    if keys is None:
        assert m1.keys() == m2.keys()
    for k in keys or m1:
        tol = 0.02 if k == "value_clip_frac" else 1e-7
        assert m1[k] == pytest.approx(m2[k], rel=METRIC_REL, abs=tol), k


@pytest.mark.parametrize("case", list(CASES))
def test_stream_equals_step_equals_one_pass(case):
    loss, args, ref = CASES[case]
    batch = make_batch(loss, ref)
    n = len(batch["response"])
    step, stream, whole = (trainer(loss, **args) for _ in range(3))
    before = state(step)
    m_step = step.train_step(batch)
    m_stream = stream.train_stream(rows_of(batch, mb) for mb in shuffled_uneven(n))
    m_whole = one_pass(whole, batch)
    assert_close(step, stream)
    assert_close(step, whole)
    moved = max(float((state(step)[k] - before[k]).abs().max()) for k in before)
    assert moved > 5e-5  # the step did something (Adam's first step moves by about lr)
    assert_metrics(m_step, m_stream)
    # the step's metrics are the whole batch's (explained_var from exact sums, *_max a max)
    assert_metrics(m_step, m_whole, [k for k in m_whole if k in m_step and k != "tokens"])
    assert m_step["rows"] == n and m_step["version"] == 1.0
    assert m_step["tokens"] == sum(len(r.ids) for r in batch["response"])
    if loss in ("grpo", "ppo", "dapo"):
        assert 0 < m_step["clip_frac"] < 1  # the noise made some ratios leave the clip range
    if loss == "tis":
        assert 0 < m_step["is_trunc_frac"] < 1 and m_step["is_weight_max"] == 2.0  # tis_cap
    if ref:
        assert m_step["kl"] == m_step["kl_ref"] > 0


def test_micro_batch_size_changes_nothing_but_rounding():
    batch = make_batch("dapo")
    runs = []
    for micro in (0, 1, 4, 5):
        e = trainer("dapo", micro_batch=micro)
        runs.append((e, e.train_step(batch)))
    for e, m in runs[1:]:
        assert_close(runs[0][0], e)
        assert_metrics(runs[0][1], m)


def test_multiturn_mask_counts_only_agent_tokens():
    batch = make_batch("grpo", masked=True)
    resps = batch["response"]
    assert any(r.masked for r in resps) and not any(resps[1].mask)
    counted = sum(sum(r.mask) for r in resps)
    assert counted < sum(len(r.ids) for r in resps)
    step, stream, whole = (trainer("grpo") for _ in range(3))
    m_step = step.train_step(batch)
    m_stream = stream.train_stream(rows_of(batch, mb) for mb in shuffled_uneven(len(resps), 3))
    one_pass(whole, batch)
    assert m_step["tokens"] == m_stream["tokens"] == counted
    assert_metrics(m_step, m_stream)
    assert_close(step, stream)
    assert_close(step, whole)
    assert all(math.isfinite(v) for v in m_step.values())  # the 1e3 garbage stayed out


def test_stream_of_nothing_and_successive_steps():
    e = trainer("grpo")
    before = state(e)
    m = e.train_stream(iter([]))
    assert m["rows"] == 0 and m["tokens"] == 0 and m["version"] == 1
    assert all(torch.equal(before[k], v) for k, v in state(e).items())  # no update
    batch = make_batch("grpo")
    a, b = trainer("grpo"), trainer("grpo")
    for seed in (1, 2):  # two steps: Adam state and grads are reset per step as in train_step
        a.train_step(batch)
        b.train_stream(rows_of(batch, mb) for mb in shuffled_uneven(11, seed))
    assert_close(a, b)
    assert a.version == b.version == 2


def test_train_step_micro_batches_are_balanced_and_exact():
    rng = random.Random(7)
    for n, micro in ((11, 3), (12, 3), (40, 8), (41, 8), (7, 7), (5, 8)):
        lengths = [1 + int(rng.paretovariate(1.2) * 3) for _ in range(n)]
        e = trainer("grpo", micro_batch=micro)
        chunks = [list(c) for c in e._chunks(n, lengths)]
        assert sorted(i for c in chunks for i in c) == list(range(n))  # exactly the rows
        assert len(chunks) == math.ceil(n / micro)
        sizes = [len(c) for c in chunks]
        assert max(sizes) <= micro and max(sizes) - min(sizes) <= 1
        if n > micro:
            bal = token_sums(lengths, chunks)
            seq = token_sums(lengths, [list(range(i, min(i + micro, n)))
                                       for i in range(0, n, micro)])
            assert max(bal) <= max(seq) and max(bal) - min(bal) <= max(seq) - min(seq)
            # LPT: the largest micro-batch exceeds the mean by at most one row's length
            assert max(bal) <= sum(lengths) / len(chunks) + max(lengths)


def test_balance_micro_batches_remainder():
    lengths = [100, 1, 1, 1, 50, 50, 2, 3, 9]
    with pytest.raises(ValueError):
        balance_micro_batches(lengths, 2)
    mbs = balance_micro_batches(lengths, 2, remainder=True)
    assert [len(mb) for mb in mbs] == [2, 2, 2, 2, 1]
    assert sorted(i for mb in mbs for i in mb) == list(range(9))
    assert mbs == [[0, 3], [1, 4], [2, 5], [6, 8], [7]]
    assert token_sums(lengths, mbs) == [101, 51, 51, 11, 3]
    # a multiple: the exact split, whatever the flag
    assert (balance_micro_batches(lengths[:8], 2, remainder=True)
            == balance_micro_batches(lengths[:8], 2))
    assert balance_micro_batches([], 4, remainder=True) == []
    assert balance_micro_batches([3, 1, 2], 4, remainder=True) == [[0, 1, 2]]


def test_step_sums_normaliser_is_split_invariant():
    mbs = [tc.Micro({}, [[1]] * 2, [[5] * 3, [5] * 7], None, [3, 7]),
           tc.Micro({}, [[1]], [[5] * 2], [[0, 0]], [0])]
    parts = [tc.StepSums(), tc.StepSums()]
    for s, mb in zip(parts, mbs):
        s.add_rows(mb)
    s = tc.StepSums.merged(parts)
    assert (s.rows, s.tokens, s.seqs, s.width) == (3, 10, 2, 7)
    assert s.normaliser("token_mean") == 10 and s.normaliser("seq_mean") == 2
    assert s.normaliser("seq_sum_norm") == 14 and s.normaliser("seq_sum_norm", 16) == 32
    assert tc.StepSums().normaliser("token_mean") == 1


# ---------------------------------------------------------------------- deepspeed
# Skipped where deepspeed is not installed (DS_BUILD_OPS=0 pip install --no-build-isolation
# deepspeed). DeepSpeed frees the gradients at its step, so weights and metrics are compared.

def ds_engine(loss="grpo", replica=0, replicas=1, **args):
    from asyncflow.engines.deepspeed import DeepSpeedEngine

    args = {"threads": 1, "lr": 1e-4, "micro_batch": MICRO, **args}
    return DeepSpeedEngine(EngineSpec(task="update", kind="train", model=MODEL, loss=loss,
                                      args=args, replica=replica, replicas=replicas))


def weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def process_group():
    """In-process DeepSpeed engines create a one-rank process group and set RANK etc.; undo
    both after the module (as tests/test_deepspeed_engine.py does: DeepSpeed caches its groups,
    so the group must outlive every test that uses it)."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    import os

    env = dict(os.environ)
    yield
    from asyncflow.engines.deepspeed import release_distributed

    release_distributed()  # and DeepSpeed's cached groups: the next module builds new ones
    os.environ.clear()
    os.environ.update(env)


@pytest.mark.deepspeed
@pytest.mark.parametrize("stage,loss", [(1, "grpo"), (2, "value")])
def test_deepspeed_stream_equals_step_and_hf(process_group, stage, loss):
    batch = make_batch(loss)
    n = len(batch["response"])
    step, stream = ds_engine(loss, zero_stage=stage), ds_engine(loss, zero_stage=stage)
    hf = trainer(loss)
    start = hf.export_weights()
    m_step = step.train_step(batch)
    m_stream = stream.train_stream(rows_of(batch, mb) for mb in shuffled_uneven(n))
    m_hf = hf.train_step(batch)
    w = step.export_weights()
    assert weight_diff(w, start) > 5e-5  # it trained
    assert weight_diff(w, stream.export_weights()) <= PARAM_ABS
    assert weight_diff(w, hf.export_weights()) <= PARAM_ABS
    assert_metrics(m_step, m_stream)
    assert_metrics(m_step, m_hf)
    # the loss scale that carried the normaliser is back to 1
    assert step.optimizer.loss_scale == stream.optimizer.loss_scale == 1.0


@pytest.mark.deepspeed
@pytest.mark.ray
def test_deepspeed_two_replicas_stream_reaches_one_replica_weights(process_group):
    """ZeRO 2 (a collective in every backward): replica 0 streams four micro-batches (one
    empty), replica 1 two; they run in lock-step and equal one replica's train_step."""
    ray = pytest.importorskip("ray")
    import socket

    batch = make_batch("grpo")
    one = ds_engine(zero_stage=2)
    m_one = one.train_step(batch)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parts = ([[7, 2, 9], [], [0], [4, 10]], [[5, 1, 3, 6], [8]])
    with local_worker_priority():  # the workers' niceness, as asyncflow's own
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        from asyncflow.engines.deepspeed import DeepSpeedEngine

        actor = ray.remote(num_cpus=1)(DeepSpeedEngine)
        reps = [actor.remote(EngineSpec(
            task="update", kind="train", model=MODEL, loss="grpo", replica=r, replicas=2,
            args={"threads": 1, "lr": 1e-4, "micro_batch": MICRO, "zero_stage": 2,
                  "master_port": port})) for r in range(2)]
        metrics = ray.get([e.train_stream.remote([rows_of(batch, mb) for mb in p])
                           for e, p in zip(reps, parts)], timeout=900)  # a hang guard: 256 s beside two CPU hogs
        weights = ray.get([e.export_weights.remote() for e in reps], timeout=120)
    finally:
        ray.shutdown()
    assert weight_diff(weights[0], weights[1]) == 0.0
    assert weight_diff(weights[0], one.export_weights()) <= PARAM_ABS
    for m in metrics:
        assert m["rows"] == 11 and m["tokens"] == m_one["tokens"]
        assert_metrics(m, m_one)
