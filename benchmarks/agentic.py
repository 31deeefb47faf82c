"""Agentic benchmark: lock-step vs env-level asynchronous multi-turn rollouts, side by side.

    python benchmarks/agentic.py [--file pipelines/agentic_sim.yaml] [--episodes 128]
                                 [--in-flight 32] [--time-scale 1.0] [--pipeline]
                                 [--backend local|ray] [--json FILE]

The setting is the rollout task of ``--file`` (default ``pipelines/agentic_sim.yaml``, a miniature
of ROLL Flash's agentic setting): its sim engine (``slots``, per-turn ``latency``,
``response_tokens``, ``max_turns``) and its environment (``asyncflow.envs:sim_env`` with the
task's ``turns``, long-tailed ``env_latency``, ``fail_rate``, ``seed``), built exactly as the
runtime builds them (:func:`asyncflow.runtime.worker.engine_spec`). The same ``--episodes`` rows
(``_row`` 0..N-1) go through two fresh engines:

- lock-step (``schedule: batch``): ``generate`` on consecutive batches of ``--in-flight`` rows:
  every turn of a batch waits for the slowest environment step of the batch;
- env-level async (``schedule: queue``): ``serve`` with ``env_threads = --in-flight`` (so as
  many episodes in flight) and a ``pull`` that hands out the same rows as slots free; each
  episode's next turn is queued the moment its observation arrives.

It prints episodes/s of each and the ratio (goal: >= 1.5x), and checks that both produced the same
rows (response ids, mask, log-probs, reward). ``--pipeline`` also runs the whole pipeline twice
(``asyncflow run`` semantics, ``--backend``, the rollout's ``time_scale`` set to
``--time-scale``): with ``--set tasks.<rollout>.schedule=batch`` and with ``schedule=queue``
and ``env_threads = slots`` (a batch-scheduled rollout leases at most ``slots`` rows a
``generate`` call, so both keep as many episodes in flight), and prints steady-state samples/s
and their ratio; a compiler that does not know the ``schedule`` key is reported as such.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def rollout_spec(path: str, time_scale: float, in_flight: int):
    """The rollout task's name and its EngineSpec (replica 0) as the runtime builds it, with
    ``time_scale`` and ``env_threads`` set."""
    from asyncflow.compiler.pipeline import compile_file
    from asyncflow.runtime.worker import engine_spec

    plan = compile_file(path)
    task = next(t for t in plan.tasks if t.kind == "rollout")
    spec = engine_spec(plan, task, 0)
    spec.args["time_scale"] = time_scale
    spec.args["env_threads"] = in_flight
    spec.extra["env_args"].pop("time_scale", None)  # the engine hands over its own
    return task.name, spec


def episodes(n: int) -> dict:
    from asyncflow.datasets import digits

    prompts = [r["prompt"] for r in digits(n=n, seed=0)]
    return {"prompt": prompts, "_row": list(range(n)), "_group": [i // 8 for i in range(n)]}


def lockstep(spec, cols: dict, in_flight: int) -> tuple[float, dict]:
    from asyncflow.engines.sim import SimEngine

    eng = SimEngine(spec)
    n, out = len(cols["_row"]), {}
    t = time.monotonic()
    for i in range(0, n, in_flight):
        part = {k: v[i:i + in_flight] for k, v in cols.items()}
        got = eng.generate(part)
        for j, r in enumerate(part["_row"]):
            out[r] = {k: v[j] for k, v in got.items()}
    return time.monotonic() - t, out


def queued(spec, cols: dict) -> tuple[float, dict, int]:
    from asyncflow.engines.sim import SimEngine

    eng = SimEngine(spec)
    n, out, given = len(cols["_row"]), {}, [0]

    def pull(k: int):
        if given[0] >= n:
            return None
        i, given[0] = given[0], min(n, given[0] + k)
        return {c: v[i:given[0]] for c, v in cols.items()} if k else {}

    t = time.monotonic()
    eng.serve(pull, lambda row: out.__setitem__(row["_row"], row))
    return time.monotonic() - t, out, eng.turn_server.started


def same_rows(a: dict, b: dict) -> bool:
    if sorted(a) != sorted(b):
        return False
    for r in a:
        x, y = a[r], b[r]
        if list(x["response"].ids) != list(y["response"].ids) or \
                list(x["response"].mask) != list(y["response"].mask):
            return False
        if any(x.get(k) != y.get(k) for k in ("logprobs", "reward")):
            return False
    return True


def pipeline_run(path: str, sets: list[str], backend: str) -> dict:
    from asyncflow.compiler.pipeline import compile_file
    from asyncflow.runtime.driver import Driver

    plan = compile_file(path, sets=sets)
    r = Driver(plan, backend).run()
    ms = r.metrics
    first_end = ms[0]["time"]
    steady_t = ms[-1]["time"] - first_end
    steady = sum(m["samples"] for m in ms[1:]) / steady_t if len(ms) > 1 and steady_t else 0.0
    return {"steps": len(ms), "steady_sps": steady, "wall_s": r.wall_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default="pipelines/agentic_sim.yaml")
    ap.add_argument("--episodes", type=int, default=128)
    ap.add_argument("--in-flight", type=int, default=32,
                    help="episodes at once: lock-step batch size = serve's env_threads")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--pipeline", action="store_true", help="also run the whole pipeline twice")
    ap.add_argument("--backend", default="local", choices=["ray", "local"])
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)

    name, spec = rollout_spec(a.file, a.time_scale, a.in_flight)
    cols = episodes(a.episodes)
    env_args = dict(spec.extra["env_args"])
    print(f"{a.file}: rollout task {name!r} on the sim engine, env {spec.extra['env']}")
    print(f"  engine: slots={spec.args.get('slots')} latency={spec.args.get('latency')} "
          f"response_tokens={spec.args.get('response_tokens')} "
          f"max_turns={spec.args.get('max_turns')} time_scale={a.time_scale}")
    print(f"  env:    {env_args}")
    print(f"  {a.episodes} episodes, {a.in_flight} in flight (lock-step batches of "
          f"{a.in_flight}; serve env_threads={a.in_flight})")

    t_lock, rows_lock = lockstep(spec, cols, a.in_flight)
    t_queue, rows_queue, turns = queued(spec, cols)
    same = same_rows(rows_lock, rows_queue)
    n = a.episodes
    res = {"settings": {"file": a.file, "episodes": n, "in_flight": a.in_flight,
                        "time_scale": a.time_scale, "engine_args": dict(spec.args),
                        "env_args": env_args},
           "lockstep_s": t_lock, "queue_s": t_queue, "lockstep_eps": n / t_lock,
           "queue_eps": n / t_queue, "ratio": t_lock / t_queue, "agent_turns": turns,
           "same_rows": same}
    head = f"{'schedule':<24} {'seconds':>8} {'episodes/s':>11}"
    print(head)
    print("-" * len(head))
    print(f"{'lock-step (batch)':<24} {t_lock:>8.2f} {n / t_lock:>11.2f}")
    print(f"{'env-level async (queue)':<24} {t_queue:>8.2f} {n / t_queue:>11.2f}")
    print(f"ratio queue / lock-step: {t_lock / t_queue:.2f}x (goal >= 1.5x); {turns} agent "
          f"turns; same rows in both: {same}")

    if a.pipeline:
        slots = int(spec.args.get("slots", 64))
        common = [f"tasks.{name}.args.time_scale={a.time_scale}"]
        runs = {"queue": common + [f"tasks.{name}.schedule=queue",
                                   f"tasks.{name}.args.env_threads={slots}"],
                "batch": common + [f"tasks.{name}.schedule=batch"]}
        print(f"whole pipeline ({a.backend} backend, rollout time_scale={a.time_scale}; "
              f"episodes in flight per replica: batch leases up to slots={slots} rows a "
              f"generate call, queue runs env_threads={slots})")
        for key, sets in runs.items():
            try:
                got = pipeline_run(a.file, sets, a.backend)
            except Exception as e:  # a compiler without the `schedule` key rejects it (AF201)
                print(f"  {key}: not run ({type(e).__name__}: "
                      f"{(str(e).strip().splitlines() or [''])[0]}): pending the compiler's "
                      "`schedule` key")
                got = None
            else:
                print(f"  {key:<5}: {got['steady_sps']:>7.1f} samples/s steady (steps 2..N), "
                      f"{got['steps']} steps, {got['wall_s']:.1f} s")
            res[f"pipeline_{key}"] = got
        q, b = res["pipeline_queue"], res["pipeline_batch"]
        if q and b and b["steady_sps"]:
            res["pipeline_ratio"] = q["steady_sps"] / b["steady_sps"]
            print(f"  ratio queue / batch: {res['pipeline_ratio']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
