"""Weight sync by method and model size, side by side in one run (docs/weight-sync.md).

A trainer process and a rollout process (two Ray actors, as a run places them) hold a model of
N parameters (a transformer's shapes: an embedding and layers of square matrices); the trainer
publishes each version with asyncflow's own :class:`asyncflow.runtime.weights.Publisher` and the
rollout adopts it with :class:`asyncflow.runtime.weights.Adopter`, loading every tensor into its
own preallocated copy (``copy_``, what ``load_state_dict`` does). Printed per method and size:

- publish: the seconds the trainer is blocked (export + put, or export + snapshot);
- publish->adopted: from the trainer's publish until the rollout holds the version;
- bytes per sync (collective: what the buckets carried; store: the object's size).

Methods: ``store`` (Ray's object store), ``collective`` (gloo here, NCCL between two GPUs),
``collective+delta`` (only the changed elements). Each version is a real optimizer-like step:
fp32 weights move every element (delta sends them all); the ``bf16`` rows keep fp32 master
weights, step them by ``lr`` per element and send the bfloat16 cast, where most elements do not
change at a small ``lr`` -- what delta sync is for.

    .venv/bin/python benchmarks/weight_sync.py                 # 1M, 10M, 100M; ~3 min here
    .venv/bin/python benchmarks/weight_sync.py --sizes 1 --syncs 2   # smoke
    .venv/bin/python benchmarks/weight_sync.py --device cuda   # on a GPU machine
    .venv/bin/python benchmarks/weight_sync.py --device cuda --sizes 1000 3000 \
        --methods store:bfloat16 collective:bfloat16 --syncs 2   # 1B and 3B, bf16
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def shapes(n_params: int) -> dict[str, tuple]:
    """A decoder-like state of about ``n_params`` parameters: a 32k x h embedding and layers of
    four h x h matrices (h chosen so that 8 layers make up the rest)."""
    import math

    vocab, layers = 32000, 8
    # vocab*h + layers*4*h*h = n  ->  h
    a, b = layers * 4, vocab
    h = max(8, int((-b + math.sqrt(b * b + 4 * a * n_params)) / (2 * a)))
    out = {"embed.weight": (vocab, h)}
    for i in range(layers):
        for m in ("q", "k", "v", "o"):
            out[f"layers.{i}.{m}.weight"] = (h, h)
    return out


class Model:
    """A trainer's or a rollout's weights; ``dtype`` is what is sent (bf16: cast from fp32
    master weights)."""

    def __init__(self, n_params: int, dtype: str, device: str, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.torch, self.device = torch, device
        self.dtype = getattr(torch, dtype)
        self.master = {k: (torch.randn(s, generator=g) * 0.02).to(device)
                       for k, s in shapes(n_params).items()}
        self.live = {k: v.to(self.dtype).clone() for k, v in self.master.items()}
        self.version = 0

    # trainer
    def step(self, lr: float, seed: int) -> None:
        """An Adam-like first step: every master weight moves by lr in a random direction."""
        g = self.torch.Generator().manual_seed(seed)
        for k, v in self.master.items():
            sign = (self.torch.rand(v.shape, generator=g) < 0.5).to(v.device) * 2.0 - 1.0
            v.add_(sign * lr)
            self.live[k] = v.to(self.dtype)

    def export_weights(self) -> dict:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.live.items()}

    # rollout
    def update_weights(self, weights: dict, version: int) -> None:
        for k, v in weights.items():
            self.live[k].copy_(v)
        self.version = version

    def update_weights_stream(self, chunks, version: int, partial: bool = False) -> None:
        for c in chunks:
            for k, v in c.items():
                self.live[k].copy_(v)
        self.version = version

    def checksum(self) -> str:
        import hashlib

        h = hashlib.sha256()
        for k in sorted(self.live):
            h.update(self.live[k].detach().cpu().contiguous().view(-1).view(self.torch.uint8).numpy())
        return h.hexdigest()[:16]


class Trainer:
    def __init__(self, n_params, dtype, device, via, delta, bucket_mb):
        from types import SimpleNamespace

        from asyncflow.runtime.weights import Publisher

        self.model = Model(n_params, dtype, device)
        sync = SimpleNamespace(model="m", via=via, delta=delta, bucket_bytes=int(bucket_mb * 2**20))
        self.pub = Publisher(self.model, True, [sync])
        self.box = None

    def publish(self, version: int, lr: float):
        if version > 1:
            self.model.step(lr, version)
        t = time.time()
        self.pub.publish("m", version, self._keep)
        return t, time.time() - t, self.box

    def _keep(self, model, version, box):
        self.box = box

    def checksum(self):
        return self.model.checksum()

    def close(self):
        self.pub.close()


class Rollout:
    def __init__(self, n_params, dtype, device, via, delta):
        from asyncflow.runtime.weights import Adopter

        self.model = Model(n_params, dtype, device, seed=1)
        self.adopter = Adopter(self.model, ["m"], True, vias={"m": via}, replica="rollout/0",
                               delta={"m": delta})

    def adopt(self, version: int, box) -> tuple[float, int]:
        for _ in range(3):  # a failed fetch is tried again (as a worker's next heartbeat would)
            if self.adopter.adopt({"m": (version, box)}):
                break
            print(f"retry: {self.adopter.last_error}", file=sys.stderr, flush=True)
        else:
            raise RuntimeError(f"version {version} not adopted: {self.adopter.last_error}")
        rec = self.adopter.receivers.get("m")
        return time.time(), (rec.bytes[-1] if rec else -1)

    def checksum(self):
        return self.model.checksum()


METHODS = [("store", "float32", False), ("collective", "float32", False),
           ("collective", "float32", True), ("store", "bfloat16", False),
           ("collective", "bfloat16", False), ("collective", "bfloat16", True)]


def _label(method: tuple) -> str:
    via, dtype, delta = method
    return f"{via}{'+delta' if delta else ''}:{dtype}"


def run(args) -> list[dict]:
    import ray

    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False,
             log_to_driver=False,
             object_store_memory=int(args.ray_memory_gb * 2**30) if args.ray_memory_gb else None)
    T, R = ray.remote(Trainer), ray.remote(Rollout)
    methods = [m for m in METHODS if not args.methods or _label(m) in args.methods]
    rows = []
    for size in args.sizes:
        n = int(size * 1e6)
        for via, dtype, delta in methods:
            tr = T.remote(n, dtype, args.device, via, delta, args.bucket_mb)
            ro = R.remote(n, dtype, args.device, via, delta)
            pubs, lat, sent = [], [], []
            for v in range(1, args.syncs + 2):  # version 1 warms up (and is delta's full copy)
                t0, pub_s, box = ray.get(tr.publish.remote(v, args.lr))
                t1, nbytes = ray.get(ro.adopt.remote(v, box))
                if v > 1:
                    pubs.append(pub_s)
                    lat.append(t1 - t0)
                    sent.append(nbytes)
            same = ray.get(tr.checksum.remote()) == ray.get(ro.checksum.remote())
            raw = sum(int(a) * int(b) for a, b in shapes(n).values()) * (4 if dtype == "float32" else 2)
            if via == "store":  # the whole state, once per version
                sent = [raw]
            row = {"params_M": size, "dtype": dtype, "method": via + ("+delta" if delta else ""),
                   "publish_s": round(statistics.median(pubs), 4),
                   "publish_to_adopted_s": round(statistics.median(lat), 4),
                   "bytes_per_sync": int(statistics.median(sent)),
                   "bytes_vs_full": round(statistics.median(sent) / raw, 3),
                   "rollout_equals_trainer": same}
            rows.append(row)
            print(json.dumps(row), flush=True)
            ray.get(tr.close.remote())
            ray.kill(tr)
            ray.kill(ro)
    ray.shutdown()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 10, 100],
                    help="model sizes in millions of parameters")
    ap.add_argument("--syncs", type=int, default=3, help="timed syncs per method (median)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--bucket-mb", type=float, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--methods", nargs="+", default=None, choices=[_label(m) for m in METHODS],
                    help="only these rows (default: all six per size)")
    ap.add_argument("--ray-memory-gb", type=float, default=None,
                    help="the object store's size (large models through via: store)")
    args = ap.parse_args()
    rows = run(args)
    print(f"\nweight sync on this machine ({args.device}; median of {args.syncs} syncs; "
          f"lr {args.lr:g}):")
    print(f"{'params':>7} {'dtype':>8} {'method':>17} {'publish s':>10} {'->adopted s':>12} "
          f"{'MB/sync':>9} {'vs full':>8} {'exact':>6}")
    base = {}
    for r in rows:
        key = (r["params_M"], r["dtype"])
        if r["method"] == "store":
            base[key] = r["publish_to_adopted_s"]
        ratio = base.get(key, 0) / r["publish_to_adopted_s"] if r["publish_to_adopted_s"] else 0
        print(f"{r['params_M']:>6g}M {r['dtype']:>8} {r['method']:>17} {r['publish_s']:>10.4f} "
              f"{r['publish_to_adopted_s']:>12.4f} {r['bytes_per_sync'] / 2**20:>9.2f} "
              f"{r['bytes_vs_full']:>8.3f} {str(r['rollout_equals_trainer']):>6}"
              + (f"   store/this {ratio:.2f}x" if r["method"] != "store" else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["rollout_equals_trainer"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
