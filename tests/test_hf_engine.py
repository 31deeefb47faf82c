"""The ``hf`` engine on a tiny CPU decoder: rollout, scorer, trainer, weight sync, checkpoints."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from asyncflow.engines.base import EngineSpec, Rollout, Scorer, Trainer, load_engine_class  # noqa: E402
from asyncflow.engines.hf import HFEngine  # noqa: E402
from asyncflow.tokens import Text  # noqa: E402

pytestmark = pytest.mark.engine

MODEL = {"name": "policy", "init": "asyncflow.models:tiny_decoder",
         "args": {"layers": 1, "hidden": 32, "heads": 2, "seed": 0}}
PROMPTS = ["3+4=", "12+7=", "copy 417=", "1="]


def engine(kind, args=None, outputs=(), loss=None, seed=0, replica=0, model=MODEL):
    args = {"threads": 1, **(args or {})}
    return HFEngine(EngineSpec(task=kind, kind=kind, model=model, args=args, outputs=outputs,
                               loss=loss, seed=seed, replica=replica))


def rollout(**args):
    return engine("rollout", {"max_new_tokens": 6, **args}, outputs=("response", "logprobs"))


def max_diff(a, b):
    assert [len(x) for x in a] == [len(y) for y in b]
    return max((abs(u - v) for x, y in zip(a, b) for u, v in zip(x, y)), default=0.0)


def test_registered_and_implements_protocols():
    assert load_engine_class("hf") is HFEngine
    e = engine("train", {"lr": 1e-3}, loss="grpo")
    assert isinstance(e, Rollout) and isinstance(e, Scorer) and isinstance(e, Trainer)


def test_generate_well_formed_and_matches_scorer():
    gen = rollout()
    out = gen.generate({"prompt": PROMPTS, "_row": [0, 1, 2, 3]})
    assert set(out) == {"response", "logprobs"}
    tok = gen.tokenizer
    for prompt, resp, lps in zip(PROMPTS, out["response"], out["logprobs"]):
        assert isinstance(resp, Text)
        assert resp.prompt_ids == (tok.bos_id, *tok.encode(prompt))
        assert 1 <= len(resp.ids) <= 6 and len(lps) == len(resp.ids)
        assert tok.eos_id not in resp.ids[:-1]  # eos only ever ends a response
        assert str(resp) == tok.decode(resp.ids)
        assert all(lp <= 0.0 for lp in lps)
    scorer = engine("logprob", outputs=("ref_logprobs",))
    ref = scorer.logprobs({"prompt": PROMPTS, "response": out["response"]})
    assert set(ref) == {"ref_logprobs"}
    assert max_diff(ref["ref_logprobs"], out["logprobs"]) < 1e-4
    # batch composition does not matter (padding is invisible)
    one = scorer.logprobs({"prompt": PROMPTS[1:2], "response": out["response"][1:2]})
    assert max_diff(one["ref_logprobs"], out["logprobs"][1:2]) < 1e-4


def test_temperature_logprobs_match_and_greedy_is_deterministic():
    gen = rollout(temperature=0.7, top_p=0.9)
    out = gen.generate({"prompt": PROMPTS})
    scorer = engine("logprob", {"temperature": 0.7}, outputs=("logprobs",))
    assert max_diff(scorer.logprobs({"response": out["response"]})["logprobs"],
                    out["logprobs"]) < 1e-4
    greedy = rollout(temperature=0.0)
    a, b = greedy.generate({"prompt": PROMPTS}), rollout(temperature=0.0).generate(
        {"prompt": PROMPTS})
    assert [r.ids for r in a["response"]] == [r.ids for r in b["response"]]


def test_eos_stops_generation():
    gen = rollout(max_new_tokens=10)
    head = torch.nn.Linear(32, gen.tokenizer.vocab_size)  # eos the only likely token
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-50.0)
        head.bias[gen.tokenizer.eos_id] = 50.0
    gen.model.lm_head = head
    out = gen.generate({"prompt": PROMPTS})
    assert all(r.ids == (gen.tokenizer.eos_id,) and r == "" for r in out["response"])
    assert gen.generate({"prompt": []}) == {"response": [], "logprobs": []}


def test_same_seed_same_outputs_other_replica_differs():
    a = rollout().generate({"prompt": PROMPTS * 4})
    b = rollout().generate({"prompt": PROMPTS * 4})
    assert [r.ids for r in a["response"]] == [r.ids for r in b["response"]]
    assert a["logprobs"] == b["logprobs"]
    c = engine("rollout", {"max_new_tokens": 6}, replica=1).generate({"prompt": PROMPTS * 4})
    assert [r.ids for r in a["response"]] != [r.ids for r in c["response"]]


def fixed_batch(gen, n=8):
    """One response repeated n times, with its behaviour log-probs and a constant advantage."""
    out = gen.generate({"prompt": PROMPTS[:1]})
    resp, lps = out["response"][0], out["logprobs"][0]
    return {"prompt": PROMPTS[:1] * n, "response": [resp] * n, "logprobs": [lps] * n,
            "ref_logprobs": [lps] * n, "advantages": [1.0] * n, "_group": [0] * n}


def test_train_steps_raise_logprob_of_rewarded_response():
    gen = rollout()
    batch = fixed_batch(gen)
    trainer = engine("train", {"lr": 1e-2, "micro_batch": 4, "kl_coef": 0.001}, loss="grpo")
    scorer = engine("logprob", outputs=("lp",))
    before = sum(scorer.logprobs(batch)["lp"][0])
    for step in range(3):
        metrics = trainer.train_step(batch)
        assert trainer.version == step + 1
    for key in ("loss", "kl", "entropy", "clip_frac", "grad_norm", "tokens"):
        assert key in metrics and metrics[key] == metrics[key]  # present and not nan
    assert metrics["tokens"] == 8 * len(batch["response"][0].ids)
    scorer.update_weights(trainer.export_weights(), trainer.version)
    assert scorer.version == 3
    after = sum(scorer.logprobs(batch)["lp"][0])
    assert after > before + 0.1


def test_micro_batches_accumulate_to_the_full_batch_gradient():
    gen = rollout()
    out = gen.generate({"prompt": PROMPTS * 2})
    batch = {"prompt": PROMPTS * 2, "response": out["response"], "logprobs": out["logprobs"],
             "advantages": [1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 1.0]}
    for loss in ("grpo", "dapo"):
        whole = engine("train", {"lr": 1e-3, "max_grad_norm": None}, loss=loss)
        parts = engine("train", {"lr": 1e-3, "micro_batch": 3, "max_grad_norm": None}, loss=loss)
        m1, m2 = whole.train_step(batch), parts.train_step(batch)
        assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)
        assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-4, abs=1e-6)


def test_update_weights_changes_generation():
    seven = {**MODEL, "args": {**MODEL["args"], "seed": 7}}
    gen, fresh = rollout(), engine("rollout", {"max_new_tokens": 6}, model=seven)
    before = gen.generate({"prompt": PROMPTS})
    other = engine("train", {}, loss="grpo", model=seven)
    gen.update_weights(other.export_weights(), 5)
    assert gen.version == 5
    gen.generator.manual_seed(0)  # same draws as the fresh engine's
    after, expect = gen.generate({"prompt": PROMPTS}), fresh.generate({"prompt": PROMPTS})
    assert [r.ids for r in after["response"]] == [r.ids for r in expect["response"]]
    assert after["logprobs"] == expect["logprobs"]
    rescored = gen.logprobs({"response": before["response"]})["logprobs"]
    assert max_diff(rescored, before["logprobs"]) > 1e-2


def test_export_weights_is_a_detached_cpu_copy():
    trainer = engine("train", {"lr": 1e-2}, loss="grpo")
    w = trainer.export_weights()
    key = "model.embed_tokens.weight"
    snapshot = w[key].clone()
    trainer.train_step(fixed_batch(rollout(), n=2))
    assert torch.equal(w[key], snapshot)
    assert all(t.device.type == "cpu" and not t.requires_grad for t in w.values())


def test_save_load_round_trip_is_bit_identical(tmp_path):
    gen = rollout()
    batch = fixed_batch(gen, n=4)
    a = engine("train", {"lr": 1e-2, "micro_batch": 2}, loss="grpo")
    a.train_step(batch)
    a.save(str(tmp_path))
    b = engine("train", {"lr": 1e-2, "micro_batch": 2}, loss="grpo")
    b.load(str(tmp_path))
    assert b.version == a.version == 1
    ma, mb = a.train_step(batch), b.train_step(batch)  # the optimizer state came back too
    assert ma == mb
    wa, wb = a.export_weights(), b.export_weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # the checkpoint directory is also a model init
    c = engine("logprob", model={"name": "p", "init": str(tmp_path), "args": {}})
    assert c.logprobs(batch)


def test_value_scorer_and_critic_training():
    critic_model = {**MODEL, "name": "critic"}
    scorer = engine("value", outputs=("values",), model=critic_model)
    gen = rollout()
    out = gen.generate({"prompt": PROMPTS})
    vals = scorer.logprobs({"prompt": PROMPTS, "response": out["response"]})["values"]
    assert [len(v) for v in vals] == [len(r.ids) for r in out["response"]]
    trainer = engine("train", {"lr": 1e-2}, loss="value", model=critic_model)
    batch = {"prompt": PROMPTS, "response": out["response"], "values": vals,
             "returns": [[1.0] * len(v) for v in vals]}
    first = trainer.train_step(batch)["loss"]
    for _ in range(5):
        last = trainer.train_step(batch)["loss"]
    assert last < first
    scorer.update_weights(trainer.export_weights(), trainer.version)
    new_vals = scorer.logprobs(batch)["values"]
    assert max_diff(new_vals, vals) > 1e-3


def test_scores_plain_strings_by_tokenizing():
    scorer = engine("logprob", outputs=("lp",))
    out = scorer.logprobs({"prompt": ["3+4="], "response": ["7"]})
    assert len(out["lp"][0]) == 1


def test_local_hf_directory_with_its_own_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate("0123456789+=")}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(str(tmp_path))
    fast.save_pretrained(str(tmp_path))
    e = engine("rollout", {"max_new_tokens": 3},
               model={"name": "p", "init": str(tmp_path), "args": {}})
    assert e.tokenizer.encode("12+3=") == [4, 5, 13, 6, 14]
    out = e.generate({"prompt": ["1+2="]})
    # a string prompt gets the tokenizer's own special tokens: this one adds none (no BOS)
    assert out["response"][0].prompt_ids == (4, 13, 5, 14)
    assert len(out["logprobs"][0]) == len(out["response"][0].ids)


def test_sampler_draws_the_softmax_distribution_and_respects_top_p():
    """torch_common.sample (inverse-CDF draw): empirical frequencies match softmax(logits / T)
    within sampling error; top_p never draws outside the nucleus; the log-prob is that of the
    full tempered distribution."""
    import torch

    from asyncflow.engines import torch_common as tc

    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0, -30.0]]).repeat(100_000, 1)
    want = torch.softmax(logits[0] / 0.7, -1)
    tok, lp = tc.sample(logits, 0.7, 1.0, g)
    got = torch.bincount(tok, minlength=5).float() / len(tok)
    assert torch.allclose(got, want, atol=0.005), (got, want)
    assert torch.allclose(lp, torch.log(want)[tok], atol=1e-5)
    # nucleus 0.9 at T = 1: tokens 3, 1, 0 hold 0.644 + 0.237 + 0.087 >= 0.9; 2 and 4 are cut
    tok, _ = tc.sample(logits, 1.0, 0.9, g)
    assert set(tok.tolist()) == {0, 1, 3}


def test_gradient_checkpointing_trains_the_same_steps():
    """``gradient_checkpointing: true`` recomputes activations in backward: the same loss,
    gradient norm and weights as without it."""
    gen = rollout()
    batch = fixed_batch(gen, n=4)
    plain = engine("train", {"lr": 1e-2, "micro_batch": 2}, loss="grpo")
    ckpt = engine("train", {"lr": 1e-2, "micro_batch": 2, "gradient_checkpointing": True},
                  loss="grpo")
    on = lambda m: getattr(m, "is_activation_checkpointing", None) if hasattr(  # noqa: E731
        m, "is_activation_checkpointing") else m.is_gradient_checkpointing  # transformers < 5.24
    assert on(ckpt.model) and not on(plain.model)
    for _ in range(2):
        a, b = plain.train_step(batch), ckpt.train_step(batch)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    wa, wb = plain.export_weights(), ckpt.export_weights()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-6


def test_fp32_master_keeps_updates_a_bfloat16_model_cannot_hold(tmp_path):
    """``fp32_master: true`` on a bfloat16 model: AdamW steps float32 masters (its state is
    float32) and the model holds their bfloat16 cast. At lr 1e-5 a step moves every weight by
    about 1e-5, below bfloat16's resolution at the weights' size: the plain bf16 trainer loses
    almost every update, the masters keep them; checkpoints carry the masters (resume exact)."""
    import torch

    bf16 = {**MODEL, "dtype": "bfloat16"}
    gen = rollout()
    batch = fixed_batch(gen, n=4)
    args = {"lr": 1e-5, "micro_batch": 4, "max_grad_norm": None}
    plain = engine("train", args, loss="grpo", model=bf16)
    mixed = engine("train", {**args, "fp32_master": True}, loss="grpo", model=bf16)
    assert plain.masters is None and all(m.dtype == torch.float32 for m in mixed.masters)
    start = {n: p.detach().float().clone() for n, p in mixed.model.named_parameters()}
    start_masters = [m.detach().clone() for m in mixed.masters]
    for _ in range(3):
        plain.train_step(batch)
        mixed.train_step(batch)
    state = mixed.optimizer.state[mixed.masters[0]]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
    moved = [float((m - s).abs().max()) for m, s in zip(mixed.masters, start_masters)]
    assert all(x > 1e-6 for x in moved)  # every master took its updates
    for p, m in zip(mixed._params(), mixed.masters):
        assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))
    changed = lambda e: sum(int((p.detach().float() != start[n]).sum())  # noqa: E731
                            for n, p in e.model.named_parameters())
    print("bf16 elements changed: plain", changed(plain), "mixed", changed(mixed))
    assert changed(plain) < changed(mixed)
    # resume: masters come back exactly, not from the bf16 weights
    mixed.save(str(tmp_path / "ck"))
    again = engine("train", {**args, "fp32_master": True}, loss="grpo", model=bf16)
    again.load(str(tmp_path / "ck"))
    assert all(torch.equal(a, b) for a, b in zip(again.masters, mixed.masters))
    assert again.train_step(batch)["loss"] == mixed.train_step(batch)["loss"]


def test_top_k_restricts_the_draw_not_the_logprobs():
    """top_k: every sampled token is among the k most probable at its step (checked against
    the model's own logits), the log-probs are those of the whole temperature-scaled
    distribution (what the trainer recomputes), and both hf schedules agree row for row."""
    from asyncflow.engines import torch_common as tc

    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0]] * 4000)
    gen = torch.Generator().manual_seed(0)
    tokens, lps = tc.sample(logits, 1.0, 1.0, gen, top_k=2)
    assert set(tokens.tolist()) == {1, 2}
    full = torch.log_softmax(logits[0], -1)
    assert torch.allclose(lps, full[tokens])
    share = (tokens == 1).float().mean().item()  # p1 / (p1 + p2) = e / (e + 1) = 0.731
    assert abs(share - 0.731) < 0.03
    # top_p of the mass top_k left: token 1 holds 0.731 of the top 2 (0.636 of all)
    assert set(tc.sample(logits, 1.0, 0.72, gen, top_k=2)[0].tolist()) == {1}
    assert set(tc.sample(logits, 1.0, 0.72, gen)[0].tolist()) == {1, 2}
    e = rollout(top_k=3, temperature=1.0, max_new_tokens=6)
    out = e.generate({"prompt": PROMPTS})
    scorer = engine("logprob")
    again = scorer.logprobs({"prompt": PROMPTS, "response": out["response"]})["logprobs"]
    assert max_diff(out["logprobs"], again) < 1e-4
    for r in out["response"]:  # replay: each token is in the top 3 of its step
        ids = list(r.prompt_ids)
        with torch.no_grad():
            for t in r.ids:
                top = e.model(torch.tensor([ids])).logits[0, -1].topk(3).indices.tolist()
                assert t in top
                ids.append(t)
