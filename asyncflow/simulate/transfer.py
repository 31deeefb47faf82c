"""What a weight sync costs in the simulator (docs/weight-sync.md, "In the simulator").

Each sync edge (:class:`asyncflow.plan.SyncPlan`) moves its model's bytes -- its parameters
(:func:`model_params`) times its dtype's size -- by the edge's method, over a link
(:mod:`asyncflow.simulate.links`). Who waits follows the runtime (``runtime/weights.py``,
``runtime/collective.py``):

- ``store``: the trainer is blocked while it publishes -- the export to a CPU state dict, the
  packing and the put into the object store: three host copies (:data:`~links.HOST`). Each
  replica that adopts is blocked for its get and the load into its device (:data:`~links.HOST`).
  The object store pulls a copy from any node that holds one, so copies spread by doubling:
  the k-th replica to get a version waits ``ceil(log2(k + 1))`` transfers of it over the link
  (one replica per node; replicas sharing a node's copy are not modelled).
- ``collective``: the trainer is blocked for the export only (it keeps the snapshot); its serving
  thread answers the replicas' requests one after the other, so a replica waits for the ones
  before it, then for the buckets over the link (a latency per bucket of ``bucket_bytes``) and
  the load of the last bucket (each bucket is loaded while the next one travels). ``delta`` is
  charged as a full copy (in float32 every element changes at every step), or, calibrated from a
  run with delta edges, as the share of the bytes its adoptions received there.
- a LoRA model moves its adapter only (:func:`adapter_params`), in float32.

A model whose size the plan does not know costs nothing: the run is simulated exactly as it was
before the transfer was modelled.
"""
from __future__ import annotations

import json
import math
import os
import struct

from asyncflow.plan import ModelPlan, Plan, SyncPlan
from asyncflow.simulate.links import HOST, Link, link as link_of

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
_ST_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _safetensors_header(path: str) -> dict:
    """A safetensors file's JSON header (tensor name -> dtype, shape, offsets), read alone."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def _safetensors_params(path: str) -> int:
    """Elements stored in a safetensors file (its JSON header only is read)."""
    return sum(math.prod(v.get("shape") or [1]) for k, v in _safetensors_header(path).items()
               if k != "__metadata__" and isinstance(v, dict))


def _config_params(cfg: dict) -> int:
    """A decoder's parameters from its config.json (embeddings, attention with grouped KV heads,
    a gated MLP where ``intermediate_size`` is given; norms and biases left out): an estimate
    for a checkpoint without safetensors."""
    h = int(cfg.get("hidden_size") or cfg.get("n_embd") or 0)
    n_layers = int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or 0)
    vocab = int(cfg.get("vocab_size") or 0)
    if not (h and n_layers and vocab):
        return 0
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 1)
    kv = int(cfg.get("num_key_value_heads") or heads)
    inter = int(cfg.get("intermediate_size") or 0)
    attn = 2 * h * h + 2 * h * (h * kv // heads)
    mlp = 3 * h * inter if inter else 8 * h * h
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings", True) else 2)
    return embed + n_layers * (attn + mlp)


def checkpoint_params(path: str) -> int:
    """Parameters of the Hugging Face checkpoint directory ``path``: counted from its
    safetensors headers, else estimated from its config.json; 0 when neither is there."""
    if not path or not os.path.isdir(path):
        return 0
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if files:
        return sum(_safetensors_params(os.path.join(path, f)) for f in files)
    cfg = os.path.join(path, "config.json")
    if os.path.isfile(cfg):
        with open(cfg) as f:
            return _config_params(json.load(f))
    return 0


def _linear_shapes(path: str) -> dict[str, tuple[int, int]]:
    """The 2-D weights of the checkpoint directory ``path`` that peft can put an adapter on:
    ``name -> (out, in)`` from its safetensors headers, else a Llama-style decoder's projections
    laid out from its config.json (embeddings and the output head left out, as peft's
    ``all-linear`` leaves the head out); {} when neither is there."""
    out: dict[str, tuple[int, int]] = {}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) \
        if path and os.path.isdir(path) else []
    for f in files:
        for k, v in _safetensors_header(os.path.join(path, f)).items():
            shape = v.get("shape") if isinstance(v, dict) else None
            if (k.endswith(".weight") and shape and len(shape) == 2
                    and not any(x in k for x in ("embed", "lm_head", "wte", "wpe"))):
                out[k[: -len(".weight")]] = (int(shape[0]), int(shape[1]))
    if out or not (path and os.path.isfile(os.path.join(path, "config.json"))):
        return out
    with open(os.path.join(path, "config.json")) as fh:
        cfg = json.load(fh)
    h = int(cfg.get("hidden_size") or 0)
    heads = int(cfg.get("num_attention_heads") or 1)
    kv = h * int(cfg.get("num_key_value_heads") or heads) // heads
    inter = int(cfg.get("intermediate_size") or 4 * h)
    proj = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter)}
    for i in range(int(cfg.get("num_hidden_layers") or 0) if h else 0):
        out.update({f"model.layers.{i}.{k}": v for k, v in proj.items()})
    return out


def adapter_params(path: str, lora: dict) -> int:
    """Parameters of the LoRA adapter ``lora`` (asyncflow.lora.resolve) on the checkpoint at
    ``path``: ``r * (in + out)`` for each targeted linear weight (a name in ``target_modules``,
    or every one for ``all-linear``); 0 when the checkpoint's layout is unknown."""
    r = int(lora.get("r", 8))
    targets = lora.get("target_modules", "all-linear")
    return sum(r * (o + i) for name, (o, i) in _linear_shapes(path).items()
               if targets == "all-linear" or name.rsplit(".", 1)[-1] in targets)


def model_params(plan: Plan, name: str) -> float:
    """Parameters of model ``name`` a sync moves: its ``params:`` (or the model it copies'),
    else its checkpoint's count; for a LoRA model, its adapter's (:func:`adapter_params`: only
    the adapter moves); 0 when unknown."""
    models = {m.name: m for m in plan.models}
    m: ModelPlan | None = models.get(name)
    if m is None:
        return 0.0
    if m.lora:
        return float(adapter_params(m.path, m.lora)) \
            if m.source_kind in ("directory", "hub") else 0.0
    seen = set()
    while m is not None and m.name not in seen:
        seen.add(m.name)
        if m.params:
            return float(m.params)
        if not m.copy_of:
            break
        m = models.get(m.copy_of)
    top = models[name]
    return float(checkpoint_params(top.path)) if top.source_kind in ("directory", "hub") else 0.0


def model_bytes(plan: Plan, name: str) -> float:
    """Bytes of model ``name``'s weights: parameters x the dtype's size (0: unknown); a LoRA
    adapter's in float32, whatever the base model's dtype (peft keeps the adapter of a float16
    or bfloat16 model in float32: ``autocast_adapter_dtype``)."""
    m = next((x for x in plan.models if x.name == name), None)
    size = 4 if m is not None and m.lora else DTYPE_BYTES.get(m.dtype if m else "float32", 4)
    return model_params(plan, name) * size


class SyncCosts:
    """The transfer cost of every sync edge of a plan over ``link`` (module docstring); the
    simulator's workers ask it what a publish and an adoption cost, in virtual time."""

    def __init__(self, plan: Plan, link: Link | str | None = None, calibration=None):
        self.link = link_of(link)
        # the runtime's own costs fitted to a real run (asyncflow.simulate.calibrate): a
        # publish's, an adoption's (per byte), the rest of a trainer's step
        self.calib = calibration
        self.edges: dict[tuple[str, str], tuple[SyncPlan, float]] = {}
        frac = calibration.delta_fraction if calibration is not None else 0.0
        for s in plan.sync:
            b = model_bytes(plan, s.model)
            self.edges[(s.src, s.dst)] = (s, b * frac if s.delta and frac > 0 else b)
        self.server_free: dict[str, float] = {}  # collective: when the trainer's server is idle
        self.getters: dict[str, int] = {}  # store: replicas that got the newest version so far
        self.charged = {"publish_s": 0.0, "adopt_s": 0.0, "bytes": 0.0}

    @property
    def free(self) -> bool:
        """No edge moves a known number of bytes: the simulation is the transfer-free one."""
        return not any(b for _, b in self.edges.values())

    def sizes(self) -> dict[str, float]:
        """model -> bytes a sync moves (the known ones)."""
        return {s.model: b for s, b in self.edges.values() if b}

    def publish_s(self, trainer: str, model: str) -> float:
        """Seconds ``trainer`` is blocked publishing ``model`` (the largest of its edges: the
        export is done once, whatever the number of receiving tasks)."""
        t = 0.0
        for (src, _), (s, b) in self.edges.items():
            if src != trainer or s.model != model or not b:
                continue
            copies = 3 if s.via == "store" else 1  # export (+ pack + put)
            self.getters[model] = 0
            t = max(t, copies * HOST.seconds(b))
        if self.calib is not None:
            t += self.calib.publish_s
        self.charged["publish_s"] += t
        return t

    def step_s(self, trainer: str) -> float:
        """Seconds ``trainer`` is blocked at the end of each step beyond its calls (a
        calibration's; else 0)."""
        return self.calib.step_s if self.calib is not None else 0.0

    def adopt_s(self, task: str, now: float) -> float:
        """Seconds a replica of ``task`` adopting at ``now`` is blocked (all its edges)."""
        t = 0.0
        for (src, dst), (s, b) in self.edges.items():
            if dst != task or not b:
                continue
            if s.via == "collective":
                buckets = max(1, math.ceil(b / max(1, s.bucket_bytes)))
                start = max(now + t, self.server_free.get(s.model, 0.0))
                sent = start + self.link.seconds(b, buckets)
                self.server_free[s.model] = sent
                t = sent + HOST.seconds(min(b, s.bucket_bytes)) - now
            else:
                k = self.getters[s.model] = self.getters.get(s.model, 0) + 1
                t += math.ceil(math.log2(k + 1)) * self.link.seconds(b) + HOST.seconds(b)
            self.charged["bytes"] += b
            if self.calib is not None:
                t += self.calib.adopt_s_per_byte * b
        if self.calib is not None:
            t += self.calib.adopt_s
        self.charged["adopt_s"] += t
        return t
