"""The weight sync's transfer in the simulator (asyncflow.simulate.transfer, .links;
docs/weight-sync.md, "In the simulator"): bytes by method over a link, who waits, and no cost --
the very same run -- where the model's size is unknown."""
from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path

import pytest

from asyncflow.compiler import compile_file
from asyncflow.plan import Plan
from asyncflow.simulate import simulate
from asyncflow.simulate.links import HOST, LINKS, LinkError, link
from asyncflow.simulate.transfer import SyncCosts, checkpoint_params, model_bytes

from shared_runs import cli

ROOT = Path(__file__).resolve().parents[1]
LONGTAIL = str(ROOT / "pipelines" / "sim_longtail.yaml")
SIZE = ["models.policy.params=1e9", "models.policy.dtype=bfloat16"]  # 2 GB a sync


def _plan(sets=(), via=None, steps=4) -> Plan:
    p = compile_file(LONGTAIL, sets=list(sets) + [f"step.steps={steps}"])
    if via:
        p = dataclasses.replace(p, sync=[dataclasses.replace(s, via=via) for s in p.sync])
    return p


def test_links_presets_numbers_and_errors():
    assert link(None) is LINKS["ethernet"] and link("IB") is LINKS["infiniband"]
    assert link("12.5:20").gb_s == 12.5 and link("12.5:20").latency_s == pytest.approx(20e-6)
    assert LINKS["nvlink"].seconds(450e9) == pytest.approx(1.0 + 5e-6)
    assert LINKS["pcie"].seconds(0) == 0.0
    for bad in ("warp", "0", "-3", "x:1"):
        with pytest.raises(LinkError):
            link(bad)


def test_params_key_and_dtype_give_the_bytes():
    p = _plan(SIZE)
    assert p.models[0].params == 1e9 and Plan.from_json(p.to_json()).models[0].params == 1e9
    assert model_bytes(p, "policy") == 2e9
    assert model_bytes(_plan(), "policy") == 0.0  # a factory model without params: unknown


def test_unknown_size_costs_nothing_and_changes_nothing():
    p = _plan()
    assert SyncCosts(p, "ethernet").free
    a, b = simulate(p).to_dict(), simulate(p, link="ethernet").to_dict()
    for d in (a, b):
        d.pop("wall_s"), d.pop("events_per_s")
    assert a == b


def test_store_blocks_the_trainer_and_each_adopter():
    """At staleness 0 a step waits for the publish and for the rollout's adoption: the step
    time grows by at least both (store: export + pack + put on the trainer; get over the link
    and load on the replica)."""
    sets = ["sync.0.max_staleness=0"]
    free, paid = simulate(_plan(sets)), simulate(_plan(sets + SIZE), link="ethernet")
    b = 2e9
    publish = 3 * HOST.seconds(b)
    adopt = LINKS["ethernet"].seconds(b) + HOST.seconds(b)
    assert paid.step_time_s >= free.step_time_s + 0.99 * (publish + adopt)
    # a faster link: a faster run, never slower than the free one
    fast = simulate(_plan(sets + SIZE), link="nvlink")
    assert free.step_time_s < fast.step_time_s < paid.step_time_s


def test_collective_replicas_queue_at_the_trainer_and_store_copies_spread():
    p = _plan(SIZE + ["tasks.generate.replicas=4", "pools.rollout.devices=4"], via="collective")
    sc = SyncCosts(p, "infiniband")
    one = LINKS["infiniband"].seconds(2e9, math.ceil(2e9 / p.sync[0].bucket_bytes))
    last_bucket = HOST.seconds(p.sync[0].bucket_bytes)
    assert sc.publish_s("update", "policy") == pytest.approx(HOST.seconds(2e9))  # export only
    waits = [sc.adopt_s("generate", 0.0) for _ in range(3)]
    assert waits == pytest.approx([k * one + last_bucket for k in (1, 2, 3)])
    st = SyncCosts(dataclasses.replace(p, sync=[dataclasses.replace(p.sync[0], via="store")]),
                   "ethernet")
    st.publish_s("update", "policy")
    got = [st.adopt_s("generate", 0.0) for _ in range(4)]
    per = LINKS["ethernet"].seconds(2e9)
    assert got == pytest.approx([k * per + HOST.seconds(2e9) for k in (1, 2, 2, 3)])
    st.publish_s("update", "policy")  # a new version: its copies spread from the start again
    assert st.adopt_s("generate", 0.0) == pytest.approx(got[0])


def test_checkpoint_params_from_safetensors_headers_and_config(tmp_path):
    header = {"a": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 24]},
              "b": {"dtype": "F32", "shape": [5], "data_offsets": [24, 44]},
              "__metadata__": {"format": "pt"}}
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(44))
    assert checkpoint_params(str(tmp_path)) == 17
    cfg = tmp_path / "c"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({
        "hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 16}))
    # embeddings 80 + 2 layers x (attention 2*64 + 2*8*4, mlp 3*8*16)
    assert checkpoint_params(str(cfg)) == 80 + 2 * (128 + 64 + 384)
    assert checkpoint_params(str(tmp_path / "nothing")) == 0


def test_cli_link_option_and_the_sync_line(capsys):
    rc, out = cli(capsys, "simulate", LONGTAIL, "--steps", "3", "--link", "warp")
    assert rc == 2 and "--link 'warp'" in out
    rc, out = cli(capsys, "simulate", LONGTAIL, "--steps", "3", "--link", "infiniband",
                  *[a for s in SIZE for a in ("--set", s)])
    assert rc == 0 and "2.00 GB a sync over infiniband" in out
    rc, out = cli(capsys, "simulate", LONGTAIL, "--steps", "3")
    assert rc == 0 and "size of model 'policy' is unknown" in out


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_a_lora_sync_moves_the_adapter_peft_builds(tmp_path, targets):
    """A LoRA model's sync is charged by its adapter: the elements peft gives that checkpoint
    (counted from the safetensors headers, or laid out from config.json alone), in float32
    even on a bfloat16 model, as peft keeps them."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tiny_hf import model_dir

    from asyncflow.lora import resolve
    from asyncflow.simulate.transfer import adapter_params

    path = model_dir(tmp_path / "m", dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=targets, task_type="CAUSAL_LM"))
    lora = [p for n, p in peft.named_parameters() if "lora_" in n]
    want = sum(p.numel() for p in lora)
    assert want > 0 and {p.dtype for p in lora} == {torch.float32}
    spec = resolve({"r": 4, "target_modules": targets})
    assert adapter_params(str(path), spec) == want
    cfg_only = tmp_path / "cfg"
    cfg_only.mkdir()
    (cfg_only / "config.json").write_text((path / "config.json").read_text())
    assert adapter_params(str(cfg_only), spec) == want  # a Llama/Qwen layout from the config
    # through a plan: the model's adapter, 4 bytes an element; without lora, the whole model
    p = compile_file(LONGTAIL, sets=["step.steps=2"])
    m = dataclasses.replace(p.models[0], source_kind="directory", path=str(path), lora=spec,
                            dtype="bfloat16")
    assert model_bytes(dataclasses.replace(p, models=[m]), m.name) == 4 * want
    full = dataclasses.replace(m, lora={})
    assert model_bytes(dataclasses.replace(p, models=[full]), m.name) == \
        2 * checkpoint_params(str(path)) > 4 * want


def test_a_calibrated_delta_edge_is_charged_the_share_its_run_moved():
    """A run whose delta adoptions received a quarter of the model's bytes (metrics'
    ``sync_bytes``): the calibration keeps that share, and the simulator charges the delta edge
    that many bytes; without a calibration (or on a full edge) the whole model."""
    from asyncflow.simulate.calibrate import Calibration, _delta_fraction

    p = _plan(SIZE, via="collective")
    delta = dataclasses.replace(p, sync=[dataclasses.replace(p.sync[0], delta=True)])
    assert _delta_fraction(delta, 0.5e9) == 0.25 and _delta_fraction(p, 0.5e9) == 0.0
    assert _delta_fraction(delta, 9e9) == 1.0
    cal = Calibration(run_dir="r", pipeline="sim_longtail", delta_fraction=0.25)
    assert SyncCosts(delta, "infiniband", cal).sizes() == {"policy": 0.5e9}
    assert SyncCosts(delta, "infiniband").sizes() == {"policy": 2e9}
    assert SyncCosts(p, "infiniband", cal).sizes() == {"policy": 2e9}
    assert "moved 25.0% of the model's bytes" in cal.describe()


def test_papers_lora_row_charges_a_qwen_7b_adapter_and_runs():
    """benchmarks/papers.py --transfer's LoRA row: the trained model laid out as Qwen2.5-7B
    (config.json alone) with an r 16 all-linear adapter moves 40,370,176 float32 elements a
    sync (r x (in + out) over 28 layers' seven projections), not the 14 GB of the bf16 model,
    and its simulation runs, slower than free and faster than the full model's store sync."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("papers", ROOT / "benchmarks" / "papers.py")
    papers = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec.loader.exec_module(papers)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    free = papers.roll_sync(papers.load("roll_flash.yaml", 8, 3), 8)
    cfg = papers.with_7b(free)
    plan = papers.compile_cfg(cfg)
    name = cfg["tasks"][papers._tasks(cfg, "train")]["model"]
    assert model_bytes(plan, name) == 14e9
    per_layer = 16 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944))
    assert model_bytes(papers.with_lora(plan, cfg), name) == 4 * 28 * per_layer
    rate = {m: papers.run_one((m, free if m == "none" else cfg, 3, papers.TRANSFERS.get(m)))[1][
        "samples_per_s_from_step0"] for m in ("none", "store", "lora")}
    assert rate["store"] < rate["lora"] < rate["none"]
