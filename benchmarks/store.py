"""Samples/s through the sample store vs Ray's queue (DESIGN.md, The runtime: sample store).

Each sample has 4 fields: ``prompt`` (32 token ids), ``response`` (16..128 token ids), ``reward``
(float), ``logprob`` (float). One consumer task ``train`` needs all four. Per chunk of ``--chunk``
samples the producer puts them and the consumer takes them (streaming, interleaved):

- store (local / Ray): ``add_rows(all 4 fields)`` (one put, as the queue's), then
  ``get(train, chunk)`` (the consumer has the 4 columns in hand) + ``ack``. Two data layouts:
  *lists* (Python lists, token ids as lists of ints, as the queue gets them) and *numpy* (token ids
  as :class:`~asyncflow.runtime.store.codec.Ragged` flat int32 arrays + offsets, floats as float32
  arrays: no per-row pickling; built before timing, like the lists);
- ray queue batched: ``put_nowait_batch`` of a chunk of per-sample dicts + ``get_nowait_batch``;
- ray queue unbatched: one ``put`` and one ``get`` per sample; capped at ``--unbatched-cap`` rows
  (it is slow) and extrapolated at the measured rate to the larger sizes (marked ``*``).

    .venv/bin/python benchmarks/store.py [--sizes 1000 10000 100000] [--chunk 1000] [--shards 2]

It also prints the store's share of one runtime step of ``--step-samples`` (16,384) samples:
the store calls of that step (:func:`run_step`) timed alone, over the step time at the runtime
benchmark's 20,000 samples/s ceiling.
"""
from __future__ import annotations

import argparse
import random
import time

import numpy as np


def make_data(n: int, seed: int = 0) -> dict[str, list]:
    rng = random.Random(seed)
    return {
        "prompt": [[rng.randrange(32000) for _ in range(32)] for _ in range(n)],
        "response": [[rng.randrange(32000) for _ in range(rng.randint(16, 128))] for _ in range(n)],
        "reward": [rng.random() for _ in range(n)],
        "logprob": [-rng.random() for _ in range(n)],
    }


def to_numpy(data: dict[str, list]) -> dict:
    from asyncflow.runtime.store.ray import Ragged

    return {
        "prompt": Ragged.from_lists(data["prompt"], np.int32),
        "response": Ragged.from_lists(data["response"], np.int32),
        "reward": np.asarray(data["reward"], np.float32),
        "logprob": np.asarray(data["logprob"], np.float32),
    }


def run_store(store, data, chunk: int) -> float:
    n = len(data["prompt"])
    fields = ("prompt", "response", "reward", "logprob")
    store.register_task("train", list(fields))
    got = 0
    t0 = time.perf_counter()
    for i in range(0, n, chunk):
        j = min(i + chunk, n)
        store.add_rows({f: data[f][i:j] for f in fields}, np.arange(i, j))
        lease = store.get("train", j - i)
        assert all(len(lease.columns[f]) == j - i for f in fields)
        got += len(lease.rows)
        store.ack(lease)
    dt = time.perf_counter() - t0
    assert got == n, (got, n)
    return n / dt


def run_step(store, sps: int = 16384, spp: int = 4, flush: int = 1024, seed: int = 0) -> float:
    """Seconds the store takes for one step of ``sps`` samples, with the calls a run of the
    runtime benchmark makes (benchmarks/runtime.py: ``sim_longtail`` at 16,384 samples a step):
    the driver adds the prompts; the rollout leases the step in one read and writes its
    samples ``flush`` at a time (``ack_rows``: a response of 8 token ids and its log-probs);
    the reward and advantage tasks read and write ``flush`` rows a call (whole groups for the
    advantage); the trainer leases its micro-batches of ``flush`` in one ``get_split`` and
    acks them. Everything else a worker does is left out: this is the store's own share."""
    rng = random.Random(seed)
    for task, inputs in (("generate", ["prompt"]), ("score", ["prompt", "answer", "response"]),
                         ("advantage", ["reward"]),
                         ("update", ["prompt", "response", "logprobs", "advantages"])):
        store.register_task(task, inputs)
    prompts = [[rng.randrange(32) for _ in range(12)] for _ in range(sps // spp)]
    t0 = time.perf_counter()
    rows = store.add_rows({"prompt": [p for p in prompts for _ in range(spp)],
                           "answer": [str(i) for i in range(sps // spp) for _ in range(spp)]},
                          [g for g in range(sps // spp) for _ in range(spp)])
    lease = store.get("generate", sps)
    assert len(lease.rows) == sps
    for i in range(0, sps, flush):
        part = lease.rows[i:i + flush]
        store.ack_rows(lease.id, part, {"response": [[4 + (r % 10)] * 8 for r in part],
                                        "logprobs": [[-0.5] * 8 for _ in part]})
    for task, out, kw in (("score", "reward", {}),
                          ("advantage", "advantages", {"whole_groups": True, "group_size": spp})):
        done = 0
        while done < sps:
            lz = store.get(task, flush, **kw)
            store.ack(lz, {out: [0.5] * len(lz.rows)})
            done += len(lz.rows)
    leases = store.get_split("update", sps, flush)
    assert sum(len(x.rows) for x in leases) == sps
    for x in leases:
        store.ack(x)
    dt = time.perf_counter() - t0
    assert len(rows) == sps
    return dt


def run_queue_batched(data, chunk: int) -> float:
    from ray.util.queue import Queue

    q = Queue()
    q.put_nowait_batch([0]), q.get_nowait_batch(1)  # the queue actor is up before timing
    n = len(data["prompt"])
    keys = list(data)
    got = 0
    t0 = time.perf_counter()
    for i in range(0, n, chunk):
        j = min(i + chunk, n)
        q.put_nowait_batch([{k: data[k][r] for k in keys} for r in range(i, j)])
        got += len(q.get_nowait_batch(j - i))
    dt = time.perf_counter() - t0
    assert got == n
    q.shutdown()
    return n / dt


def run_queue_unbatched(data) -> float:
    from ray.util.queue import Queue

    q = Queue()
    q.put(0), q.get()
    n = len(data["prompt"])
    keys = list(data)
    t0 = time.perf_counter()
    for r in range(n):
        q.put({k: data[k][r] for k in keys})
        q.get()
    dt = time.perf_counter() - t0
    q.shutdown()
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--chunk", type=int, default=1000)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--unbatched-cap", type=int, default=2000)
    ap.add_argument("--step-samples", type=int, default=16384,
                    help="samples of the step whose store time is reported (run_step)")
    args = ap.parse_args()

    import ray

    from asyncflow.runtime.store.ray import RayStore
    from asyncflow.runtime.store import SampleStore

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    data = make_data(max(args.sizes))
    unb_rows = min(args.unbatched_cap, max(args.sizes))
    unb = run_queue_unbatched({k: v[:unb_rows] for k, v in data.items()})
    npdata = to_numpy(data)
    rows = []
    for n in args.sizes:
        d = {k: v[:n] for k, v in data.items()}
        dn = {k: v[:n] for k, v in npdata.items()}
        local = run_store(SampleStore(), d, args.chunk)
        rs = RayStore(shards=args.shards, chunk=1024)  # actors started before timing, as the queue's
        rlist = run_store(rs, d, args.chunk)
        rs.shutdown()
        rs = RayStore(shards=args.shards, chunk=1024)
        rnp = run_store(rs, dn, args.chunk)
        rs.shutdown()
        qb = run_queue_batched(d, args.chunk)
        rows.append((n, local, rlist, rnp, qb, unb, n > unb_rows))
    # the store's share of a step at 16,384 samples (median of 3 steps, each a new store)
    share = {}
    for name, make in (("local", SampleStore), ("ray", lambda: RayStore(shards=1, chunk=1024))):
        times = []
        for _ in range(3):
            st_ = make()
            times.append(run_step(st_, args.step_samples))
            if hasattr(st_, "shutdown"):
                st_.shutdown()
        share[name] = sorted(times)[1]
    ray.shutdown()

    ceiling_s = args.step_samples / 20000.0
    print(f"\none step of {args.step_samples:,} samples through the store, the runtime's calls "
          f"(run_step): local {share['local'] * 1e3:.0f} ms, Ray (1 shard) "
          f"{share['ray'] * 1e3:.0f} ms; of a step at 20,000 samples/s ({ceiling_s * 1e3:.0f} ms, "
          f"benchmarks/runtime.py's ceiling): local {share['local'] / ceiling_s:.0%}, Ray "
          f"{share['ray'] / ceiling_s:.0%}")

    print(f"\nsamples/s, chunk={args.chunk}, RayStore shards={args.shards}, 4 fields/sample "
          f"(unbatched queue measured on {unb_rows} rows; * = extrapolated at that rate)")  # fmt: skip
    head = ("rows", "local store", "Ray st. lists", "Ray st. numpy", "queue batched", "queue unbatched",
            "lists/q batch", "numpy/q batch", "numpy/q unbat", "local/q batch")  # fmt: skip
    print(" | ".join(f"{h:>14}" for h in head))
    for n, local, rlist, rnp, qb, unb_rate, extrap in rows:
        cells = [f"{n:>14}", f"{local:>14,.0f}", f"{rlist:>14,.0f}", f"{rnp:>14,.0f}", f"{qb:>14,.0f}",
                 f"{unb_rate:>13,.0f}{'*' if extrap else ' '}", f"{rlist / qb:>13.1f}x", f"{rnp / qb:>13.1f}x",
                 f"{rnp / unb_rate:>13.1f}x", f"{local / qb:>13.1f}x"]  # fmt: skip
        print(" | ".join(cells))


if __name__ == "__main__":
    main()
