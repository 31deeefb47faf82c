"""How compile time grows with pipeline size: 100, 1,000 and 10,000 tasks.

    .venv/bin/python benchmarks/compile_scale.py [--sizes 100 1000 10000] [--profile N]

A synthetic pipeline of N tasks is N/4 independent GRPO blocks sharing one prompt source; block i
is ``gen_i (rollout, model m_i, pool p_i) -> score_i (reward) -> adv_i (grpo) -> train_i (train,
pool p_i)`` with a sync edge ``train_i -> gen_i`` (staleness i % 3). The AST is built directly
(no YAML), then every pass after parse is timed. Goal: 1,000 tasks under 1 s, near-linear growth
(the growth factor per 10x tasks should stay near 10).
"""
from __future__ import annotations

import argparse
import time

from asyncflow.compiler.pipeline import FRONT, PASSES
from asyncflow.compiler.runner import Context
from asyncflow.dsl import ast


def synthetic(n_tasks: int) -> ast.Pipeline:
    blocks = max(1, n_tasks // 4)
    models, pools, tasks, sync = {}, {}, {}, []
    for i in range(blocks):
        m, p = f"m{i}", f"p{i}"
        models[m] = ast.ModelDef(m, init="asyncflow.models:tiny_decoder", args={"layers": 1})
        pools[p] = ast.PoolDef(p, devices=1)
        tasks[f"gen_{i}"] = ast.TaskDef(
            f"gen_{i}", "rollout", inputs=("prompt",), outputs=(f"resp_{i}", f"lp_{i}"), engine="sim",
            model=m, pool=p, args={"slots": 8, "latency": {"dist": "lognormal", "median": 0.05,
                                                          "sigma": 1.0, "max": 1.0, "seed": i}})
        tasks[f"score_{i}"] = ast.TaskDef(
            f"score_{i}", "reward", inputs=("prompt", "answer", f"resp_{i}"), outputs=(f"r_{i}",),
            fn="asyncflow.rewards:digits_match")
        tasks[f"adv_{i}"] = ast.TaskDef(f"adv_{i}", "advantage", inputs=(f"r_{i}",),
                                        outputs=(f"a_{i}",), estimator="grpo")
        tasks[f"train_{i}"] = ast.TaskDef(
            f"train_{i}", "train", inputs=("prompt", f"resp_{i}", f"lp_{i}", f"a_{i}"), engine="sim",
            model=m, pool=p, loss="grpo", args={"seconds_per_sample": 0.001, "micro_batch": 8})
        sync.append(ast.SyncDef(f"train_{i}", f"gen_{i}", i % 3))
    return ast.Pipeline(
        name=f"synthetic_{n_tasks}", tasks=tasks, step=ast.StepDef(8, 100, 4), models=models,
        data={"prompts": ast.DataDef("prompts", "asyncflow.datasets:digits", {"n": 100},
                                     ("prompt", "answer"))},
        pools=pools, sync=tuple(sync))


def compile_timed(p: ast.Pipeline) -> tuple[float, dict[str, float]]:
    ctx = Context(source_file=p.name)
    ctx.pipeline = p
    value, times = p, {}
    t0 = time.perf_counter()
    for ps in [*FRONT, *PASSES]:
        t = time.perf_counter()
        value = ps.fn(value, ctx)
        times[ps.name] = time.perf_counter() - t
        if ctx.diags.errors:
            raise SystemExit(f"{ps.name}: {ctx.diags.errors[0].headline()}")
    return time.perf_counter() - t0, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--profile", type=int, default=0, help="cProfile a compile of this many tasks")
    args = ap.parse_args()
    prev = None
    names = [ps.name for ps in [*FRONT, *PASSES]]
    print(f"{'tasks':>7} {'total s':>9} {'growth':>7}  " + "  ".join(f"{n:>9}" for n in names))
    for n in args.sizes:
        p = synthetic(n)
        total, times = compile_timed(p)
        growth = f"{total / prev:6.1f}x" if prev else "      -"
        print(f"{len(p.tasks):>7} {total:>9.3f} {growth:>7}  "
              + "  ".join(f"{times[k]:>9.3f}" for k in names), flush=True)
        prev = total
    if args.profile:
        import cProfile
        import pstats

        p = synthetic(args.profile)
        prof = cProfile.Profile()
        prof.enable()
        compile_timed(p)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
