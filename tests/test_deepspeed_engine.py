"""The deepspeed trainer engine: the hf engine's step through DeepSpeed ZeRO 1/2, and data
parallelism over replicas (Ray actors) that reaches the single-replica weights."""
import os
import socket

import pytest

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


@pytest.mark.parametrize("stage", [1, 2])
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
    with pytest.raises(ValueError, match="zero_stage must be 1 or 2"):
        DeepSpeedEngine(spec(zero_stage=3))


def test_scorer_is_the_hf_scorer(batch):
    ds = DeepSpeedEngine(spec("logprob"))
    assert ds.ds is None  # no DeepSpeed for a forward pass without gradients
    for got, want in zip(ds.logprobs(batch)["logprobs"], batch["logprobs"]):
        assert got == pytest.approx(want, abs=1e-6)


def test_save_load_resumes_exactly(batch, tmp_path):
    a = DeepSpeedEngine(spec(micro_batch=4, zero_stage=2))
    a.train_step(batch)
    a.save(str(tmp_path / "ckpt"))
    saved = a.export_weights()
    b = DeepSpeedEngine(spec(micro_batch=4, zero_stage=2))
    b.load(str(tmp_path / "ckpt"))
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
@pytest.mark.parametrize("stage,split", [(1, "halves"), (2, "uneven"), (2, "empty")])
def test_two_replicas_reach_the_one_replica_weights(batch, stage, split):
    ray = pytest.importorskip("ray")
    args = dict(micro_batch=2, zero_stage=stage)
    one = DeepSpeedEngine(spec(**args))
    for _ in range(2):
        m_one = one.train_step(batch)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        actor = ray.remote(num_cpus=1)(DeepSpeedEngine)
        reps = [actor.remote(spec(replica=r, replicas=2, master_port=port, **args))
                for r in range(2)]
        parts = [rows_of(batch, idx) for idx in SPLITS[split]]
        for _ in range(2):
            metrics = ray.get([e.train_step.remote(p) for e, p in zip(reps, parts)], timeout=300)
        weights = ray.get([e.export_weights.remote() for e in reps], timeout=120)
    finally:
        ray.shutdown()
    assert max_diff(weights[0], weights[1]) == 0.0  # replicas stay identical
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
