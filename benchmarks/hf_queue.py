"""Continuous batching vs whole batches on the ``hf`` engine, long-tailed response lengths.

    python benchmarks/hf_queue.py [--prompts 128] [--slots 32] [--layers 2] [--hidden 64]
                                  [--lengths '{"dist": "pareto", "scale": 4, "alpha": 1.1,
                                               "max": 192}'] [--threads 1] [--repeat 3]
                                  [--temperature 1.0] [--json FILE]

The same rows (``--prompts`` prompts, ``_row`` 0..N-1, so each row gets the same length cap
drawn from ``--lengths`` both ways) go through one ``HFEngine`` in two modes:

- **batch**: ``generate`` on consecutive batches of ``--slots`` rows (``schedule: batch``): each
  batch lasts as long as its longest response;
- **queue**: ``serve`` with ``slots = --slots`` (``schedule: queue``,
  asyncflow/engines/hf_serve.py): a row leaves the batch the step it finishes and a queued row
  takes its slot at once.

After one untimed warm-up pass of each mode over 8 rows, the modes run ``--repeat`` times,
interleaved; the best time of each counts (the machine may be shared: one torch thread by
default, two threads on two busy cores made single runs vary tenfold). At ``temperature > 0``
``generate`` draws from the engine's one generator, so its lengths (eos) differ a little from
run to run; ``serve`` draws per row and repeats exactly. Printed per mode: wall seconds,
samples/s, generated tokens/s, forwards (decode steps; for queue, plus prefills); then the
ratio queue/batch of samples/s, and the settings (with the drawn caps' quantiles). ``--json``
writes the same.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def build(args):
    from asyncflow.engines.base import EngineSpec
    from asyncflow.engines.hf import HFEngine

    model = {"name": "policy", "init": "asyncflow.models:tiny_decoder",
             "args": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                      "max_len": 512, "seed": 0}}
    spec = EngineSpec(task="generate", kind="rollout", model=model,
                      args={"threads": args.threads, "temperature": args.temperature,
                            "max_new_tokens": json.loads(args.lengths), "slots": args.slots},
                      outputs=("response", "logprobs"))
    return HFEngine(spec)


def prompts(n: int) -> list[str]:
    return [f"{i % 97}+{(7 * i) % 89}=" for i in range(n)]


def run_batch(eng, rows: list[int], texts: list[str]) -> tuple[float, int, int]:
    """(seconds, generated tokens, decode forwards) of ``generate`` over batches of slots."""
    tokens = forwards = 0
    start = time.perf_counter()
    for i in range(0, len(rows), eng.slots):
        out = eng.generate({"prompt": texts[i:i + eng.slots], "_row": rows[i:i + eng.slots]})
        lens = [len(t.ids) for t in out["response"]]
        tokens += sum(lens)
        forwards += max(lens)  # the loop runs until its longest row is done
    return time.perf_counter() - start, tokens, forwards


def run_queue(eng, rows: list[int], texts: list[str]) -> tuple[float, int, int]:
    """(seconds, generated tokens, decode forwards + prefills) of ``serve`` over all rows."""
    from asyncflow.engines import hf_serve

    todo = list(zip(texts, rows))
    done: list[dict] = []
    server = hf_serve.HFTurnServer(eng)  # eng.serve(pull, emit) with the server at hand

    def pull(k):
        nonlocal todo
        if not todo:
            return None if len(done) == len(rows) else {}
        take, todo = todo[:k], todo[k:]
        return {"prompt": [p for p, _ in take], "_row": [r for _, r in take]}

    start = time.perf_counter()
    hf_serve.serve(eng, pull, done.append, server=server)
    secs = time.perf_counter() - start
    assert len(done) == len(rows)
    return secs, sum(len(r["response"].ids) for r in done), server.steps + server.prefills


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lengths", default='{"dist": "pareto", "scale": 4, "alpha": 1.1, '
                                         '"max": 192, "seed": 0}')
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from asyncflow.engines.hf_serve import length_cap

    eng = build(args)
    rows = list(range(args.prompts))
    texts = prompts(args.prompts)
    caps = sorted(length_cap(eng.length_dist, r) for r in rows)
    run_batch(eng, rows[:8], texts[:8])  # warm-up (allocator, kernels)
    run_queue(eng, rows[:8], texts[:8])
    runs: dict[str, list] = {"batch": [], "queue": []}
    for _ in range(args.repeat):  # interleaved, so a busy spell of the machine hits both
        runs["batch"].append(run_batch(eng, rows, texts))
        runs["queue"].append(run_queue(eng, rows, texts))
    results = {}
    for name, got in runs.items():
        secs, tokens, forwards = min(got, key=lambda x: x[0])
        results[name] = {"seconds": round(secs, 3), "samples_per_s": round(len(rows) / secs, 2),
                         "tokens_per_s": round(tokens / secs, 1), "tokens": tokens,
                         "forwards": forwards}
    ratio = results["queue"]["samples_per_s"] / results["batch"]["samples_per_s"]
    settings = {"prompts": args.prompts, "slots": args.slots, "layers": args.layers,
                "hidden": args.hidden, "heads": args.heads, "lengths": json.loads(args.lengths),
                "temperature": args.temperature, "threads": args.threads,
                "repeat": args.repeat,
                "caps": {"min": caps[0], "median": caps[len(caps) // 2],
                         "p90": caps[int(0.9 * len(caps))], "max": caps[-1],
                         "mean": round(sum(caps) / len(caps), 1)}}
    print("settings:", json.dumps(settings))
    print(f"{'mode':<6} {'seconds':>8} {'samples/s':>10} {'tokens/s':>9} {'tokens':>7} "
          f"{'forwards':>8}")
    for name, r in results.items():
        print(f"{name:<6} {r['seconds']:>8.3f} {r['samples_per_s']:>10.2f} "
              f"{r['tokens_per_s']:>9.1f} {r['tokens']:>7} {r['forwards']:>8}")
    print(f"queue / batch samples/s: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "results": results, "ratio": ratio}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
