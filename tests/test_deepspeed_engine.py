"""The deepspeed trainer engine: the hf engine's step through DeepSpeed ZeRO 1/2, and data
parallelism over replicas (Ray actors) that reaches the single-replica weights."""
import os
import socket

import pytest

from asyncflow.runtime.ray_connect import local_worker_priority

deepspeed = pytest.importorskip(
    "deepspeed", reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install "
    "--no-build-isolation deepspeed)")

import torch  # noqa: E402

from asyncflow.engines.base import EngineSpec, Scorer, Trainer, load_engine_class  # noqa: E402
from asyncflow.engines.deepspeed import DeepSpeedEngine  # noqa: E402
from asyncflow.engines.hf import HFEngine  # noqa: E402
from asyncflow.tokens import Text  # noqa: E402

pytestmark = pytest.mark.deepspeed

MODEL = {"name": "policy", "init": "asyncflow.models:tiny_decoder",
         "args": {"layers": 1, "hidden": 32, "seed": 3}}
INPUTS = ("prompt", "response", "logprobs", "advantages")
TOL = 1e-5
# Two data-parallel replicas sum the gradient in another order than one engine (each its
# partial sum, then the all-reduce, pre-divided by the world size), and AdamW turns float-level
# differences of near-zero gradients into larger ones of the update: measured 1.2e-5 after two
# steps at lr 1e-2 with DeepSpeed 0.19.8's ZeRO-2 on the uneven split (the updates are up to
# 2e-2), against 1e-5 before; the replicas themselves stay bit-identical (asserted exactly).
REPLICA_TOL = 5e-5


def spec(kind="train", replica=0, replicas=1, **args):
    args = {"lr": 1e-2, "threads": 1, **args}
    return EngineSpec(task="update", kind=kind, model=MODEL, args=args, loss="grpo",
                      inputs=INPUTS, outputs=() if kind == "train" else ("logprobs",),
                      seed=0, replica=replica, replicas=replicas)


def make_batch(n=8, seed=0):
    """``n`` rows of random prompt/response ids of varying lengths, with behaviour log-probs
    from the initial model (so the first step is on-policy) and random advantages."""
    g = torch.Generator().manual_seed(seed)
    rows = {"prompt": [], "response": [], "advantages": []}
    for _ in range(n):
        p = [1] + torch.randint(4, 40, (int(torch.randint(2, 7, (1,), generator=g)),),
                                generator=g).tolist()
        r = torch.randint(4, 40, (int(torch.randint(3, 10, (1,), generator=g)),),
                          generator=g).tolist()
        rows["prompt"].append("p")
        rows["response"].append(Text("r", r, p))
        rows["advantages"].append(float(torch.randn(1, generator=g)))
    rows["logprobs"] = HFEngine(spec("logprob")).logprobs(rows)["logprobs"]
    return rows


def rows_of(batch, idx):
    return {k: [v[i] for i in idx] for k, v in batch.items()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def clean_process_group():
    """In-process engines create a one-rank process group and set RANK etc.; undo both."""
    env = dict(os.environ)
    yield
    from asyncflow.engines.deepspeed import release_distributed

    release_distributed()  # and DeepSpeed's cached groups: the next module builds new ones
    os.environ.clear()
    os.environ.update(env)


@pytest.fixture(scope="module")
def batch():
    return make_batch(8)


def test_registered_and_implements_the_protocols():
    assert load_engine_class("deepspeed") is DeepSpeedEngine
    e = DeepSpeedEngine(spec())
    assert isinstance(e, Trainer) and isinstance(e, Scorer) and e.ds is not None


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_replica_matches_the_hf_engine(batch, stage):
    """Same seed, lr, batch, AdamW and loss; 4 rows per micro-batch (gradient accumulation)."""
    hf = HFEngine(spec(micro_batch=4))
    ds = DeepSpeedEngine(spec(micro_batch=4, zero_stage=stage))
    start = ds.export_weights()
    assert max_diff(start, hf.export_weights()) == 0.0
    for step in (1, 2):
        m_hf, m_ds = hf.train_step(batch), ds.train_step(batch)
        assert m_ds["version"] == step and m_ds["rows"] == 8
        for k in ("loss", "pg_loss", "grad_norm", "tokens", "clip_frac", "entropy"):
            assert m_ds[k] == pytest.approx(m_hf[k], rel=1e-4, abs=1e-6), k
    assert max_diff(ds.export_weights(), start) > 1e-3  # it trained
    assert max_diff(ds.export_weights(), hf.export_weights()) < TOL


def test_clipping_and_weight_decay_match(batch):
    args = dict(micro_batch=3, max_grad_norm=0.05, weight_decay=0.1, lr=3e-2)
    hf, ds = HFEngine(spec(**args)), DeepSpeedEngine(spec(**args))
    m_hf, m_ds = hf.train_step(batch), ds.train_step(batch)
    assert m_hf["grad_norm"] > 0.05  # clipping is active
    assert m_ds["grad_norm"] == pytest.approx(m_hf["grad_norm"], rel=1e-4)
    assert max_diff(ds.export_weights(), hf.export_weights()) < TOL


def test_critic_matches_the_hf_engine(batch):
    """The value loss trains the value head too: DeepSpeed wraps the model and the head."""
    g = torch.Generator().manual_seed(1)
    cols = dict(batch)
    cols["returns"] = [torch.randn(len(r.ids), generator=g).tolist() for r in batch["response"]]
    critic = dict(task="critic_update", kind="train", model=MODEL, loss="value",
                  inputs=("prompt", "response", "returns"))
    hf = HFEngine(EngineSpec(args={"lr": 1e-2, "threads": 1, "micro_batch": 3}, **critic))
    ds = DeepSpeedEngine(EngineSpec(args={"lr": 1e-2, "threads": 1, "micro_batch": 3,
                                          "zero_stage": 2}, **critic))
    for _ in range(2):
        m_hf, m_ds = hf.train_step(cols), ds.train_step(cols)
    assert m_ds["loss"] == pytest.approx(m_hf["loss"], rel=1e-4)
    w_hf, w_ds = hf.export_weights(), ds.export_weights()
    assert any(k.startswith("value_head.") for k in w_ds)
    assert max_diff(w_ds, w_hf) < TOL


def test_bad_zero_stage():
    with pytest.raises(ValueError, match="zero_stage must be 1, 2 or 3"):
        DeepSpeedEngine(spec(zero_stage=4))


def test_zero3_exports_the_gathered_weights(batch, tmp_path):
    """ZeRO-3 partitions the parameters; the sync, the export and the checkpoint's model are
    the gathered full weights (those of ZeRO-2 within float order)."""
    z2, z3 = DeepSpeedEngine(spec(micro_batch=4, zero_stage=2)), DeepSpeedEngine(
        spec(micro_batch=4, zero_stage=3))
    def partitioned():  # ZeRO-3: the module's parameters hold nothing outside a gather
        return all(p.data.numel() == 0 and p.ds_numel > 0 for p in z3.ds.module.parameters())

    assert partitioned()
    for _ in range(2):
        z2.train_step(batch)
        z3.train_step(batch)
    w2, w3 = z2.export_weights(), z3.export_weights()
    assert w3.keys() == w2.keys() and all(w3[k].shape == w2[k].shape for k in w2)
    assert max_diff(w3, w2) < REPLICA_TOL
    z3.export(str(tmp_path / "final"))
    hf = HFEngine(EngineSpec(task="t", kind="logprob", model={"init": str(tmp_path / "final")},
                             outputs=("logprobs",)))
    assert max_diff(hf.export_weights(), w3) == 0.0
    assert partitioned()  # the export put the gathered weights in and took them out again
    z3.train_step(batch)  # and trains on after the export


def test_bfloat16_trains_in_bf16_with_fp32_master_weights(batch):
    """A model with dtype bfloat16: DeepSpeed's bf16 (bf16 weights, forward and backward) with
    the ZeRO optimizer's fp32 master weights; exported (synced) in bf16; the update follows
    the fp32 one to bf16 precision."""
    bf = {**MODEL, "dtype": "bfloat16"}
    args = {"lr": 1e-2, "threads": 1, "micro_batch": 4, "zero_stage": 2}
    e = DeepSpeedEngine(EngineSpec(task="update", kind="train", model=bf, args=args, loss="grpo",
                                   inputs=INPUTS, seed=0))
    assert e.ds.bfloat16_enabled()
    assert {p.dtype for p in e.ds.module.parameters()} == {torch.bfloat16}
    assert {t.dtype for t in e.optimizer.single_partition_of_fp32_groups} == {torch.float32}
    fp = DeepSpeedEngine(spec(**args))
    start = {k: v.float() for k, v in e.export_weights().items()}
    m, m_fp = e.train_step(batch), fp.train_step(batch)
    w = e.export_weights()
    assert {t.dtype for t in w.values()} == {torch.bfloat16}
    assert m["tokens"] == m_fp["tokens"] and m["loss"] == pytest.approx(m_fp["loss"], rel=5e-2)
    master = torch.cat([t.flatten() for t in e.optimizer.single_partition_of_fp32_groups])
    assert float((master - master.bfloat16().float()).abs().max()) > 0  # not rounded to bf16
    # AdamW's first step moves each weight by about lr along its gradient's sign: in bf16 the
    # signs of the larger gradients are the fp32 run's
    step = torch.cat([(w[k].float() - start[k]).flatten() for k in w])
    step_fp = torch.cat([(fp.export_weights()[k] - start[k]).flatten() for k in w])
    big = step_fp.abs() > 5e-3
    assert big.sum() > 100 and float((step[big].sign() == step_fp[big].sign()).float().mean()) > 0.8


def test_scorer_is_the_hf_scorer(batch):
    ds = DeepSpeedEngine(spec("logprob"))
    assert ds.ds is None  # no DeepSpeed for a forward pass without gradients
    for got, want in zip(ds.logprobs(batch)["logprobs"], batch["logprobs"]):
        assert got == pytest.approx(want, abs=1e-6)


def no_pickles(directory) -> None:
    """Every file of a checkpoint is JSON, safetensors or the tokenizer's text files."""
    for root, _, files in os.walk(directory):
        for f in files:
            assert f.endswith((".json", ".safetensors", ".txt", ".jinja")), os.path.join(root, f)


@pytest.mark.parametrize("stage", [2, 3])
def test_save_load_resumes_exactly(batch, tmp_path, monkeypatch, stage):
    a = DeepSpeedEngine(spec(micro_batch=4, zero_stage=stage))
    a.train_step(batch)
    a.save(str(tmp_path / "ckpt"))
    no_pickles(tmp_path / "ckpt")
    saved = a.export_weights()
    b = DeepSpeedEngine(spec(micro_batch=4, zero_stage=stage))

    def no_torch_load(*_, **__):
        raise AssertionError("a checkpoint read through torch.load (a pickle)")

    monkeypatch.setattr(torch, "load", no_torch_load)
    b.load(str(tmp_path / "ckpt"))
    monkeypatch.undo()
    assert b.version == 1 and max_diff(b.export_weights(), saved) == 0.0
    a.train_step(batch)
    b.train_step(batch)  # the Adam moments were restored too
    assert max_diff(b.export_weights(), a.export_weights()) < 1e-7
    # the checkpoint is also a model init for the other engines
    hf = HFEngine(EngineSpec(task="t", kind="logprob", model={"init": str(tmp_path / "ckpt")},
                             outputs=("logprobs",)))
    assert max_diff(hf.export_weights(), saved) == 0.0


# ---------------------------------------------------------------------- data parallel

SPLITS = {
    "halves": ([0, 1, 2, 3], [4, 5, 6, 7]),
    # uneven: 3 vs 2 micro-batches of 2 rows, so replica 1 pads with a zero-loss micro-batch
    "uneven": ([0, 1, 2, 3, 4], [5, 6, 7]),
    # replica 1 has no rows this step: it runs zero-loss micro-batches only
    "empty": (list(range(8)), []),
}


@pytest.mark.ray
@pytest.mark.parametrize("stage,split", [  # CI runs one of them (its 25-minute budget)
    pytest.param(1, "halves", marks=pytest.mark.slow), pytest.param(2, "uneven", marks=pytest.mark.slow),
    pytest.param(2, "empty", marks=pytest.mark.slow), (3, "uneven")])
def test_two_replicas_reach_the_one_replica_weights(batch, stage, split):
    ray = pytest.importorskip("ray")
    args = dict(micro_batch=2, zero_stage=stage)
    one = DeepSpeedEngine(spec(**args))
    for _ in range(2):
        m_one = one.train_step(batch)

    with local_worker_priority():  # the workers' niceness, as asyncflow's own
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        actor = ray.remote(num_cpus=1)(DeepSpeedEngine)
        reps = [actor.remote(spec(replica=r, replicas=2, master_port=port, **args))
                for r in range(2)]
        parts = [rows_of(batch, idx) for idx in SPLITS[split]]
        for _ in range(2):
            metrics = ray.get([e.train_step.remote(p) for e, p in zip(reps, parts)], timeout=300)
        if stage == 3:  # partitioned: rank 0 holds the gathered weights (the one that publishes)
            weights = ray.get([reps[0].export_weights.remote()], timeout=120)
            with pytest.raises(Exception, match="only replica 0"):
                ray.get(reps[1].export_weights.remote(), timeout=120)
        else:
            weights = ray.get([e.export_weights.remote() for e in reps], timeout=120)
    finally:
        ray.shutdown()
    assert max_diff(weights[0], weights[-1]) == 0.0  # replicas stay identical
    assert max_diff(weights[0], one.export_weights()) < REPLICA_TOL
    for m in metrics:  # the global step's metrics, on every replica
        assert m["rows"] == 8 and m["tokens"] == m_one["tokens"]
        assert m["loss"] == pytest.approx(m_one["loss"], rel=1e-4, abs=1e-6)
        assert m["grad_norm"] == pytest.approx(m_one["grad_norm"], rel=1e-4)


def test_loss_mask_matches_the_hf_engine(batch):
    """Multi-turn rows (a loss mask with 0 on environment observations): DeepSpeed counts and
    trains exactly the tokens the hf engine does."""
    masked = dict(batch)
    masked["response"] = [Text(str(r), r.ids, r.prompt_ids,
                               [1 if j % 3 != 1 else 0 for j in range(len(r.ids))])
                          for r in batch["response"]]
    hf, ds = HFEngine(spec(micro_batch=4)), DeepSpeedEngine(spec(micro_batch=4, zero_stage=1))
    m_hf, m_ds = hf.train_step(masked), ds.train_step(masked)
    kept = sum(sum(r.mask) for r in masked["response"])
    assert m_ds["tokens"] == m_hf["tokens"] == kept < sum(len(r.ids) for r in batch["response"])
    assert m_ds["loss"] == pytest.approx(m_hf["loss"], rel=1e-4, abs=1e-6)
    assert max_diff(ds.export_weights(), hf.export_weights()) < TOL


@pytest.mark.ray
@pytest.mark.slow  # CI's budget: save/load resumes exactly (one replica, stages 2 and 3) runs there
def test_two_replicas_resume_from_their_checkpoints(batch, tmp_path):
    """Each replica saves its part of the ZeRO-2 optimizer (safetensors + JSON) and loads it
    back: a resumed pair takes the next step exactly as the pair that went on."""
    ray = pytest.importorskip("ray")
    args = dict(micro_batch=2, zero_stage=2)
    parts = [rows_of(batch, idx) for idx in SPLITS["uneven"]]
    dirs = [str(tmp_path / f"update_{r}") for r in range(2)]
    with local_worker_priority():  # the workers' niceness, as asyncflow's own
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(num_cpus=1)(DeepSpeedEngine)
        port = free_port()
        reps = [actor.remote(spec(replica=r, replicas=2, master_port=port, **args)) for r in range(2)]
        ray.get([e.train_step.remote(p) for e, p in zip(reps, parts)], timeout=300)
        ray.get([e.save.remote(d) for e, d in zip(reps, dirs)], timeout=300)
        ray.get([e.train_step.remote(p) for e, p in zip(reps, parts)], timeout=300)
        went_on = ray.get([e.export_weights.remote() for e in reps], timeout=120)
        for e in reps:
            ray.kill(e)
        port = free_port()
        again = [actor.remote(spec(replica=r, replicas=2, master_port=port, **args))
                 for r in range(2)]
        ray.get([e.load.remote(d) for e, d in zip(again, dirs)], timeout=300)
        versions = ray.get([e.train_step.remote(p) for e, p in zip(again, parts)], timeout=300)
        resumed = ray.get([e.export_weights.remote() for e in again], timeout=120)
    finally:
        ray.shutdown()
    for d in dirs:
        no_pickles(d)
    assert [m["version"] for m in versions] == [2, 2]
    assert max_diff(resumed[0], resumed[1]) == 0.0
    assert max_diff(resumed[0], went_on[0]) < 1e-7
