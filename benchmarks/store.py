"""Samples/s through the sample store vs Ray's queue (DESIGN.md, The runtime: sample store).

Each sample has 4 fields: ``prompt`` (32 token ids), ``response`` (16..128 token ids), ``reward``
(float), ``logprob`` (float). One consumer task ``train`` needs all four. Per chunk of ``--chunk``
samples the producer puts them and the consumer takes them (streaming, interleaved):

- store (local / Ray): ``add_rows(prompt)`` + ``write(response, reward, logprob)``, then
  ``get(train, chunk)`` + ``ack``;
- ray queue batched: ``put_nowait_batch`` of a chunk of per-sample dicts + ``get_nowait_batch``;
- ray queue unbatched: one ``put`` and one ``get`` per sample; capped at ``--unbatched-cap`` rows
  (it is slow) and extrapolated at the measured rate to the larger sizes (marked ``*``).

    .venv/bin/python benchmarks/store.py [--sizes 1000 10000 100000] [--chunk 1000] [--shards 2]
"""
from __future__ import annotations

import argparse
import random
import time


def make_data(n: int, seed: int = 0) -> dict[str, list]:
    rng = random.Random(seed)
    return {
        "prompt": [[rng.randrange(32000) for _ in range(32)] for _ in range(n)],
        "response": [[rng.randrange(32000) for _ in range(rng.randint(16, 128))] for _ in range(n)],
        "reward": [rng.random() for _ in range(n)],
        "logprob": [-rng.random() for _ in range(n)],
    }


def run_store(store, data, chunk: int) -> float:
    n = len(data["prompt"])
    store.register_task("train", ["prompt", "response", "reward", "logprob"])
    got = 0
    t0 = time.perf_counter()
    for i in range(0, n, chunk):
        j = min(i + chunk, n)
        rows = store.add_rows({"prompt": data["prompt"][i:j]}, list(range(i, j)))
        store.write(rows, {f: data[f][i:j] for f in ("response", "reward", "logprob")})
        lease = store.get("train", j - i)
        got += len(lease.rows)
        store.ack(lease.id)
    dt = time.perf_counter() - t0
    assert got == n, (got, n)
    return n / dt


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
    args = ap.parse_args()

    import ray

    from asyncflow.runtime.ray_store import RayStore
    from asyncflow.runtime.store import SampleStore

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    data = make_data(max(args.sizes))
    unb_rows = min(args.unbatched_cap, max(args.sizes))
    unb = run_queue_unbatched({k: v[:unb_rows] for k, v in data.items()})
    rows = []
    for n in args.sizes:
        d = {k: v[:n] for k, v in data.items()}
        local = run_store(SampleStore(), d, args.chunk)
        rs = RayStore(shards=args.shards, chunk=1024)  # actors started before timing, as the queue's
        rstore = run_store(rs, d, args.chunk)
        rs.shutdown()
        qb = run_queue_batched(d, args.chunk)
        rows.append((n, local, rstore, qb, unb, n > unb_rows))
    ray.shutdown()

    print(f"\nsamples/s, chunk={args.chunk}, RayStore shards={args.shards}, 4 fields/sample "
          f"(unbatched queue measured on {unb_rows} rows; * = extrapolated at that rate)")  # fmt: skip
    head = ("rows", "local store", "Ray store", "queue batched", "queue unbatched", "Ray store/q batched",
            "Ray store/q unbatched", "local/q batched")  # fmt: skip
    print(" | ".join(f"{h:>14}" for h in head))
    for n, local, rstore, qb, unb_rate, extrap in rows:
        cells = [f"{n:>14}", f"{local:>14,.0f}", f"{rstore:>14,.0f}", f"{qb:>14,.0f}",
                 f"{unb_rate:>13,.0f}{'*' if extrap else ' '}", f"{rstore / qb:>13.1f}x",
                 f"{rstore / unb_rate:>13.1f}x", f"{local / qb:>13.1f}x"]  # fmt: skip
        print(" | ".join(cells))


if __name__ == "__main__":
    main()
