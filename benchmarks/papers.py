"""Both papers' scaling figures, in simulation: ROLL Flash (arXiv 2510.11345) and AsyncFlow
(arXiv 2507.01663), with ``asyncflow simulate`` (:func:`asyncflow.simulate.simulate`).

    python benchmarks/papers.py [--quick] [--only roll,alpha,asyncflow] [--jobs 2]
                                [--json PATH] [--no-plots] [--out DIR]

Every number is a steady-state throughput in virtual time of a simulated run of the pipeline
files in ``benchmarks/papers/``, changed per run as listed below: samples over the time from the
end of step alpha + 1 to the end of step n - 1 - alpha (:func:`steady`; the run has enough steps
for two repeats of the alpha + 1 step pattern in that window); each ratio is computed from two
runs of the same invocation. Write-up, settings and the figures: ``docs/papers.md``.

Figures (PNG into ``docs/``, tables on stdout):

1. ROLL Flash, speedup of asynchronous training (staleness alpha = 2) over synchronous against
   the number of devices K, at a fixed batch (1024 samples a step), for an RLVR workload
   (``roll_flash.yaml``: one long-tailed generation per sample) and an agentic one
   (``roll_flash_agentic.yaml``: 4-turn episodes against a heavy-tailed tool). Synchronous:
   the trainer colocated with the rollout on all K devices (it trains after the rollout, on
   all of them), alpha 0. Asynchronous: the K devices split between rollout and trainer so
   that their work balances, alpha 2. Beside it the paper's closed-form bound
   ``1 + K * L_gen / (N * (mu_gen + E * mu_train))`` (dashed) and the bound the staleness gate
   adds (dashed; ours). ``papers_roll_flash_speedup.png``, ``papers_roll_flash_throughput.png``.
2. ROLL Flash, the alpha sweep (0, 1, 2, 4, 8) at K = 64 and K = 512 (RLVR) and K = 64
   (agentic), against the same synchronous run. ``papers_roll_flash_alpha.png``.
3. AsyncFlow, the ablation and throughput against cluster size D: a synchronous colocated
   baseline (verl-like; the reference forward folded into the train phase), then AsyncFlow's
   task-separated layout (``asyncflow.yaml``: rollout, reference and trainer on pools of their
   own, the split balancing their work) synchronous (alpha 0, no streaming), + streaming into
   the trainer (``stream: true``), + asynchrony (alpha 1). ``papers_asyncflow_scaling.png``,
   ``papers_asyncflow_speedup.png``.

``--transfer``: figures 1a and 3 again with a 7B model's weight sync included (bf16, 14 GB a
sync: ``params`` and ``dtype`` on the trained model; docs/weight-sync.md, "In the simulator"),
by each method over its usual link -- ``store`` over Ethernet (25 Gb/s), ``collective`` over
InfiniBand (NDR) -- beside the transfer-free runs: ``papers_roll_flash_speedup_7b.png``,
``papers_roll_flash_throughput_7b.png``, ``papers_asyncflow_speedup_7b.png`` (the other figures
are left as they are).

``--quick``: fewer sizes and runs, 512 samples a step (< 40 s); its numbers differ from the
full run's, and its PNGs go to a temporary folder unless ``--out`` says otherwise. The script
prints its own wall time and the simulator's cost at the largest size.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from papers_report import (ALPHA, PAPER, TRANSFERS, f1, f2, plot_asyncflow,  # noqa: E402
                           plot_roll, table, transfer_figures)

ROOT = Path(__file__).resolve().parents[1]
PAPERS = ROOT / "benchmarks" / "papers"
DOCS = ROOT / "docs"
OUT = {"dir": DOCS}  # where the PNGs go (--out)

# the papers' own numbers (abstracts): ROLL Flash's largest speedups; AsyncFlow's average and
# peak throughput gain over its (synchronous) state-of-the-art baseline

FULL = {"sizes": [8, 16, 32, 64, 128, 256, 512, 1024], "alpha_sizes": {"rlvr": [64, 512],
        "agentic": [64]}, "alphas": [0, 1, 2, 4, 8], "cluster": [16, 32, 64, 128, 256, 512],
        "ablation_at": 64, "prompts": 128, "steps": 10, "periods": 2}
QUICK = {"sizes": [8, 64, 512], "alpha_sizes": {"rlvr": [64]}, "alphas": [0, 1, 2, 4],
         "cluster": [16, 64, 256], "ablation_at": 64, "prompts": 64, "steps": 8, "periods": 2}
# --transfer: a 7B model in bf16 (14 GB a sync), by each method over its usual link
PARAMS_7B = 7e9
WORKLOADS = {"rlvr": "roll_flash.yaml", "agentic": "roll_flash_agentic.yaml"}


# -- pipeline files, changed per run ---------------------------------------------------------------

def load(name: str, prompts: int, steps: int) -> dict:
    cfg = yaml.safe_load((PAPERS / name).read_text())
    cfg["step"].update(prompts_per_step=prompts, steps=steps)
    return cfg


def _tasks(cfg: dict, kind: str) -> str:
    return next(n for n, t in cfg["tasks"].items() if t["kind"] == kind)


def roll_sync(base: dict, k: int) -> dict:
    """Synchronous (alpha 0): the trainer colocated with the rollout, on all ``k`` devices."""
    cfg = copy.deepcopy(base)
    gen, upd = _tasks(cfg, "rollout"), _tasks(cfg, "train")
    cfg["pools"] = {"gpus": {"devices": k}}
    cfg["tasks"][gen].update(pool="gpus", replicas=k)
    cfg["tasks"][upd].update(pool="gpus", devices_per_replica=k, stream=False)
    cfg["sync"][0]["max_staleness"] = 0
    return cfg


def roll_async(base: dict, k: int, kt: int, alpha: int) -> dict:
    """Asynchronous: ``k - kt`` rollout devices, ``kt`` trainer devices, staleness ``alpha``."""
    cfg = copy.deepcopy(base)
    gen, upd = _tasks(cfg, "rollout"), _tasks(cfg, "train")
    cfg["pools"] = {"rollout": {"devices": k - kt}, "train": {"devices": kt}}
    cfg["tasks"][gen].update(pool="rollout", replicas=k - kt)
    cfg["tasks"][upd].update(pool="train", devices_per_replica=kt)
    cfg["sync"][0]["max_staleness"] = alpha
    return cfg


def af_split(base: dict, d: int) -> tuple[int, int, int]:
    """AsyncFlow's task-separated split of ``d`` devices: (rollout, reference, trainer), the
    whole numbers that balance the three tasks' work (the slowest one's seconds a step, each
    task's device-seconds a sample over its devices, as small as it can be)."""
    w = work(base)
    best = min((max(w["gen"] / (d - r - t), w["ref"] / r, w["train"] / t), -t, r)
               for t in range(1, d - 1) for r in range(1, d - t))
    t, r = -best[1], best[2]
    return d - r - t, r, t


def af_separated(base: dict, d: int, *, stream: bool, alpha: int) -> dict:
    cfg = copy.deepcopy(base)
    g, r, t = af_split(base, d)
    cfg["pools"] = {"rollout": {"devices": g}, "ref": {"devices": r}, "train": {"devices": t}}
    cfg["tasks"]["generate"].update(replicas=g)
    cfg["tasks"]["ref"].update(devices_per_replica=r)
    cfg["tasks"]["update"].update(devices_per_replica=t, stream=stream)
    cfg["sync"][0]["max_staleness"] = alpha
    return cfg


def af_colocated(base: dict, d: int) -> dict:
    """The verl-like baseline: every task on the same ``d`` devices, one phase after another
    (rollout, then the reference forward and the update, folded into one train call: the
    simulator does not model colocated tasks competing for devices), alpha 0."""
    cfg = copy.deepcopy(base)
    ref = cfg["tasks"].pop("ref")
    cfg["models"].pop("reference")
    upd = cfg["tasks"]["update"]
    upd["inputs"] = [f for f in upd["inputs"] if f not in ref["outputs"]]
    upd["args"]["seconds_per_sample"] += ref["args"]["seconds_per_sample"]
    cfg["pools"] = {"gpus": {"devices": d}}
    cfg["tasks"]["generate"].update(pool="gpus", replicas=d)
    upd.update(pool="gpus", devices_per_replica=d, stream=False)
    cfg["sync"][0]["max_staleness"] = 0
    return cfg


# -- the workload's own numbers (for the bounds and the splits) ------------------------------------

_WORK: dict = {}


def work(cfg: dict) -> dict:
    """Device-seconds a sample of each task, and the rollout's latencies by step, as the
    simulator draws them (``mu_gen`` = mean latency / concurrent samples a device, ``L``: the
    longest latency, ``L_step``: the mean over steps of each step's longest)."""
    key = json.dumps(cfg, sort_keys=True)
    if key in _WORK:
        return _WORK[key]
    from asyncflow.simulate.core import device

    plan = compile_cfg(cfg)
    gen = next(t for t in plan.tasks if t.kind == "rollout")
    d = device(plan, gen)
    n = plan.step.samples_per_step
    lat = [d.latency_of(r) for r in range(n * plan.step.steps)]
    steps = [max(lat[i:i + n]) for i in range(0, len(lat), n)]
    train = float(cfg["tasks"][_tasks(cfg, "train")]["args"]["seconds_per_sample"])
    ref = float(cfg["tasks"].get("ref", {}).get("args", {}).get("seconds_per_sample", 0.0))
    w = {"N": n, "slots": d.slots, "mean": statistics.fmean(lat), "median": statistics.median(lat),
         "L": max(lat), "L_step": statistics.fmean(steps), "gen": statistics.fmean(lat) / d.slots,
         "train": train, "ref": ref}
    w["total"] = w["gen"] + w["train"] + w["ref"]
    _WORK[key] = w
    return w


def train_devices(w: dict, k: int) -> int:
    """The async split: the trainer's share of ``k`` that balances rollout and trainer (the
    slower one's device-seconds a sample over its devices, as small as it can be)."""
    return min(range(1, k), key=lambda t: (max(w["gen"] / (k - t), w["train"] / t), t))


def paper_bound(w: dict, k: int) -> float:
    """ROLL Flash's bound, our reading: synchronous step <= N mu_gen / K + L_gen + N E mu_train
    / K (list scheduling of the rollout, then the colocated update), asynchronous step >= N
    (mu_gen + E mu_train) / K (all K devices busy)."""
    return 1 + k * w["L"] / (w["N"] * (w["gen"] + w["train"]))


def gate_bound(w: dict, k: int, kt: int, alpha: int) -> float:
    """The same with the staleness gate (ours): a step's rows start only once the weights of
    alpha + 1 steps before exist, so an asynchronous step takes at least (L_step + train) /
    (alpha + 1) on average, besides each side's own work (N mu_gen / K_r, N E mu_train / K_t)."""
    n, tr = w["N"], w["N"] * w["train"] / kt
    sync = n * w["gen"] / k + w["L_step"] + n * w["train"] / k
    asyn = max(n * w["gen"] / (k - kt), tr, (w["L_step"] + tr) / (alpha + 1),
               n * (w["gen"] + w["train"]) / k)
    return sync / asyn


# -- running ---------------------------------------------------------------------------------------

def compile_cfg(cfg: dict):
    from asyncflow.compiler.pipeline import compile_file

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix=cfg["pipeline"] + "_",
                                     delete=False) as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    try:
        return compile_file(f.name)
    finally:
        os.unlink(f.name)


def steps_for(cfg: dict, alpha: int) -> int:
    """Steps of a run at staleness ``alpha``: the measured window (:func:`steady`) spans
    ``periods`` times alpha + 1 steps (the pattern repeats every alpha + 1 steps when the tail
    sets the pace)."""
    return max(cfg["steps"], (cfg["periods"] + 1) * (alpha + 1) + alpha + 1)


def steady(ends: list[float], samples: list[int], alpha: int) -> tuple[float, float]:
    """(samples/s, seconds a step) from the end of step alpha + 1 to the end of step
    n - 1 - alpha: the rollout works alpha steps ahead of the trainer all through the window
    (the pipeline has filled before it, and the feed has not yet stopped before its end, when
    the last steps' rows, generated ahead, would finish faster than in a steady run)."""
    w0, w1 = alpha + 1, len(ends) - 1 - alpha
    if w1 <= w0:
        raise SystemExit(f"{len(ends)} steps are too few to measure alpha {alpha}")
    t = ends[w1] - ends[w0]
    return sum(samples[w0 + 1:w1 + 1]) / t, t / (w1 - w0)


def with_7b(cfg: dict) -> dict:
    """``cfg`` with its trained model a 7B one in bf16 (the simulator charges its 14 GB a
    sync; the sim engine's device times stay as they are)."""
    cfg = copy.deepcopy(cfg)
    model = cfg["tasks"][_tasks(cfg, "train")]["model"]
    cfg["models"][model].update(params=PARAMS_7B, dtype="bfloat16")
    return cfg


# Qwen2.5-7B's layout (its config.json): the LoRA row's adapter is laid out from it
QWEN_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
           "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}
LORA = {"r": 16, "alpha": 32, "target_modules": "all-linear"}


@functools.cache
def _qwen7b_layout() -> Path:
    """A folder holding :data:`QWEN_7B` as ``config.json``: one per process (forked workers
    share their parent's, made before they start), removed when the process exits."""
    import atexit
    import shutil

    folder = Path(tempfile.mkdtemp(prefix="qwen7b_layout_"))
    (folder / "config.json").write_text(json.dumps(QWEN_7B))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def with_lora(plan, cfg: dict):
    """``plan`` with its trained model a Qwen2.5-7B layout (a ``config.json`` alone, in a temporary
    folder, one per process) trained through a LoRA adapter (:data:`LORA`): the simulator charges
    each sync the adapter's bytes (asyncflow.simulate.transfer.adapter_params), in float32."""
    import dataclasses

    folder = _qwen7b_layout()
    name = cfg["tasks"][_tasks(cfg, "train")]["model"]
    return dataclasses.replace(plan, models=[
        dataclasses.replace(m, source_kind="directory", path=str(folder), params=0,
                            lora=dict(LORA)) if m.name == name else m for m in plan.models])


def transfer_jobs(jobs: list) -> list:
    """Each job again per method of :data:`TRANSFERS`, a 7B model's sync included (key
    ``<method>:<key>``). The method is set on the compiled plan: the sim engine only syncs
    through the store at run time (AF216), the simulator charges either."""
    return [(f"{m}:{key}", with_7b(cfg), steps, TRANSFERS[m]) for m in TRANSFERS
            for key, cfg, steps, *_ in jobs]


def run_one(job: tuple) -> tuple[str, dict]:
    import dataclasses

    from asyncflow.simulate import simulate

    key, cfg, steps, *sync = job
    alpha = int(cfg["sync"][0]["max_staleness"])
    plan, link = compile_cfg(cfg), None
    if sync and sync[0]:
        via, link, *lora = sync[0]
        plan = dataclasses.replace(plan, sync=[dataclasses.replace(s, via=via)
                                               for s in plan.sync])
        if lora:
            plan = with_lora(plan, cfg)
    r = simulate(plan, steps=steps, link=link)
    rate, step_s = steady(r.step_ends, r.samples, alpha) if not r.stalled else (0.0, 0.0)
    return key, {"samples_per_s": rate, "step_time_s": step_s,
                 "samples_per_s_from_step0": r.samples_per_s,
                 "staleness_max": max(r.staleness_max, default=0), "events": r.events,
                 "wall_s": r.wall_s, "samples": sum(r.samples), "steps": len(r.step_ends),
                 "stalled": r.stalled}


def run_all(jobs: list[tuple[str, dict, int]], n_jobs: int) -> dict[str, dict]:
    """Run the simulations (``n_jobs`` processes), longest first; key -> summary."""
    jobs = sorted(jobs, key=lambda j: -_cost(j))
    if n_jobs <= 1:
        out = dict(map(run_one, jobs))
    else:
        if any(len(j) > 3 and j[3] == TRANSFERS["lora"] for j in jobs):
            _qwen7b_layout()  # made here, so the forked workers share it and it is removed
        with mp.get_context("fork").Pool(n_jobs) as pool:
            out = dict(pool.imap_unordered(run_one, jobs))
    bad = {k: v["stalled"] for k, v in out.items() if v["stalled"]}
    if bad:
        raise SystemExit(f"simulations stalled: {bad}")
    return out


def _cost(job) -> float:
    _, cfg, steps, *_ = job
    st = cfg["step"]
    return st["prompts_per_step"] * st["samples_per_prompt"] * steps * len(cfg["tasks"])


# -- the figures -----------------------------------------------------------------------------------

def roll_jobs(cfg: dict, bases: dict) -> list:
    jobs = []
    for wl, base in bases.items():
        w = work(base)
        sizes = set(cfg["sizes"]) | set(cfg["alpha_sizes"].get(wl, []))
        for k in sorted(sizes):
            kt = train_devices(w, k)
            jobs.append((f"{wl}/sync/{k}", roll_sync(base, k), steps_for(cfg, 0)))
            alphas = cfg["alphas"] if k in cfg["alpha_sizes"].get(wl, []) else []
            for a in sorted(set(alphas) | ({ALPHA} if k in cfg["sizes"] else set())):
                jobs.append((f"{wl}/async{a}/{k}", roll_async(base, k, kt, a),
                             steps_for(cfg, a)))
    return jobs


def asyncflow_jobs(cfg: dict, base: dict) -> list:
    jobs = []
    for d in cfg["cluster"]:
        s0, s1 = steps_for(cfg, 0), steps_for(cfg, 1)
        jobs += [(f"af/colocated/{d}", af_colocated(base, d), s0),
                 (f"af/sync/{d}", af_separated(base, d, stream=False, alpha=0), s0),
                 (f"af/stream/{d}", af_separated(base, d, stream=True, alpha=0), s0),
                 (f"af/async/{d}", af_separated(base, d, stream=True, alpha=1), s1)]
    return jobs


def roll_figures(cfg: dict, bases: dict, res: dict, plots: bool) -> dict:
    out: dict = {"speedup": {}, "alpha": {}}
    for wl, base in bases.items():
        if not cfg["sizes"]:
            break
        w = work(base)
        rows = []
        for k in cfg["sizes"]:
            kt = train_devices(w, k)
            s, a = res[f"{wl}/sync/{k}"], res[f"{wl}/async{ALPHA}/{k}"]
            sp = a["samples_per_s"] / s["samples_per_s"]
            pb, gb = paper_bound(w, k), gate_bound(w, k, kt, ALPHA)
            paper = f"up to {PAPER[wl]}" if k == cfg["sizes"][-1] else ""
            rows.append([k, f"{k - kt}:{kt}", f1(s["samples_per_s"]), f1(a["samples_per_s"]),
                         f2(sp), f2(pb), f2(gb), paper])
            out["speedup"].setdefault(wl, []).append(
                {"K": k, "split": [k - kt, kt], "sync": s["samples_per_s"],
                 "async": a["samples_per_s"], "speedup": sp, "paper_bound": pb, "gate_bound": gb})
        table(f"ROLL Flash, figure 1a ({wl}): speedup of alpha={ALPHA} over synchronous vs "
              f"devices K (N={w['N']} samples a step; mu_gen={w['gen']:.3f} s, "
              f"E*mu_train={w['train']:.3f} s, L_gen={w['L']:.1f} s, mean step max "
              f"{w['L_step']:.1f} s)",
              ["K", "async R:T", "sync sa/s", "async sa/s", "speedup", "paper bound",
               "gate bound", "paper"], rows)
    for wl, sizes in cfg["alpha_sizes"].items():
        w = work(bases[wl])
        for k in sizes:
            kt = train_devices(w, k)
            base = res[f"{wl}/sync/{k}"]["samples_per_s"]
            rows = []
            for a in cfg["alphas"]:
                r = res[f"{wl}/async{a}/{k}"]
                sp = r["samples_per_s"] / base
                rows.append([a, f1(base), f1(r["samples_per_s"]), f2(sp),
                             f2(gate_bound(w, k, kt, a)), r["staleness_max"]])
                out["alpha"].setdefault(f"{wl}/{k}", []).append(
                    {"alpha": a, "sync": base, "async": r["samples_per_s"], "speedup": sp,
                     "gate_bound": gate_bound(w, k, kt, a), "staleness_max": r["staleness_max"]})
            table(f"ROLL Flash, figure 1b ({wl}, K={k}, async split {k - kt}:{kt}): alpha sweep "
                  f"(paper bound at this K: {paper_bound(w, k):.2f}; the paper gives no number "
                  "per alpha)",
                  ["alpha", "sync sa/s", "async sa/s", "speedup", "gate bound", "max stale"],
                  rows)
    if plots:
        plot_roll(cfg, bases, out, work(bases["rlvr"])["N"], OUT["dir"])
    return out


def asyncflow_figures(cfg: dict, base: dict, res: dict, plots: bool) -> dict:
    variants = [("colocated", "sync, colocated (verl-like)"),
                ("sync", "sync, task-separated"),
                ("stream", "+ streaming (stream: true)"),
                ("async", "+ asynchrony (alpha 1)")]
    d0 = cfg["ablation_at"]
    g, r, t = af_split(base, d0)
    rows = []
    for v, label in variants:
        x = res[f"af/{v}/{d0}"]
        rows.append([label, f1(x["samples_per_s"]), f2(x["step_time_s"]),
                     f2(x["samples_per_s"] / res[f"af/sync/{d0}"]["samples_per_s"]),
                     f2(x["samples_per_s"] / res[f"af/colocated/{d0}"]["samples_per_s"])])
    w = work(base)
    table(f"AsyncFlow, ablation at D={d0} devices (separated split rollout:ref:train = "
          f"{g}:{r}:{t}; N={w['N']})",
          ["variant", "samples/s", "step s", "vs sep. sync", "vs colocated"], rows)
    rows, out = [], []
    for d in cfg["cluster"]:
        xs = {v: res[f"af/{v}/{d}"]["samples_per_s"] for v, _ in variants}
        sp = xs["async"] / xs["colocated"]
        rows.append([d, ":".join(map(str, af_split(base, d))), f1(xs["colocated"]),
                     f1(xs["sync"]), f1(xs["stream"]), f1(xs["async"]), f2(sp),
                     f2(xs["async"] / xs["sync"])])
        out.append({"D": d, "split": af_split(base, d), **xs, "speedup": sp,
                    "speedup_vs_separated_sync": xs["async"] / xs["sync"]})
    mean = statistics.fmean(o["speedup"] for o in out)
    table("AsyncFlow, throughput against cluster size D (samples/s; speedup = full AsyncFlow "
          f"over the colocated baseline; paper: {PAPER['asyncflow_avg']} average, up to "
          f"{PAPER['asyncflow_max']}; here: {mean:.2f} average, up to "
          f"{max(o['speedup'] for o in out):.2f})",
          ["D", "R:ref:T", "colocated", "sep. sync", "+stream", "+async", "speedup",
           "vs sep. sync"], rows)
    if plots:
        plot_asyncflow(cfg, variants, out, w["N"], OUT["dir"])
    return {"ablation_at": d0, "scaling": out, "mean_speedup": mean}


# -- main ------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller version (< 40 s)")
    ap.add_argument("--only", default="roll,alpha,asyncflow",
                    help="figures to make: roll (1a), alpha (1b), asyncflow (2)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="simulations at once (processes)")
    ap.add_argument("--json", help="write every number to this file")
    ap.add_argument("--no-plots", action="store_true", help="tables only")
    ap.add_argument("--transfer", action="store_true",
                    help="figures 1a and 3 again with a 7B model's weight sync (store over "
                         "Ethernet, collective over InfiniBand), beside the transfer-free ones")
    ap.add_argument("--out", help="folder for the PNGs (default: docs/; with --quick, a "
                                  "temporary folder, so the full run's figures stay)")
    args = ap.parse_args(argv)
    OUT["dir"] = Path(args.out) if args.out else (
        Path(tempfile.gettempdir()) / "asyncflow_papers_quick" if args.quick else DOCS)
    OUT["dir"].mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cfg = QUICK if args.quick else FULL
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    if "alpha" not in only:
        cfg = {**cfg, "alpha_sizes": {}}
    bases = {wl: load(f, cfg["prompts"], cfg["steps"]) for wl, f in WORKLOADS.items()}
    af = load("asyncflow.yaml", cfg["prompts"], cfg["steps"])
    jobs = []
    if only & {"roll", "alpha"}:
        if "roll" not in only:
            cfg = {**cfg, "sizes": []}
        jobs += roll_jobs(cfg, bases)
    if "asyncflow" in only:
        jobs += asyncflow_jobs(cfg, af)
    if args.transfer:
        jobs += transfer_jobs([j for j in jobs if "/sync/" in j[0] or f"/async{ALPHA}/" in j[0]
                               or j[0].startswith(("af/colocated/", "af/async/"))])
    print(f"{len(jobs)} simulations, {args.jobs} at a time"
          f"{' (--quick)' if args.quick else ''} ...", flush=True)
    res = run_all(jobs, args.jobs)
    report: dict = {"quick": args.quick, "workloads": {}, "runs": res}
    plots = not args.no_plots
    if only & {"roll", "alpha"}:
        report["roll_flash"] = roll_figures(cfg, bases, res, plots)
        report["workloads"].update({wl: work(b) for wl, b in bases.items()})
    if "asyncflow" in only:
        report["asyncflow"] = asyncflow_figures(cfg, af, res, plots)
        report["workloads"]["asyncflow"] = work(af)
    if args.transfer:
        report["transfer"] = transfer_figures(cfg, bases if "roll" in only else {},
                                              af if "asyncflow" in only else None, res, plots,
                                              OUT["dir"])
    wall = time.perf_counter() - t0
    sim_s = sum(v["wall_s"] for v in res.values())
    largest = [f"rlvr/async{ALPHA}/{cfg['sizes'][-1]}"] if cfg["sizes"] else []
    largest = [k for k in largest if k in res] + [max(res, key=lambda k: res[k]["events"])]
    print()
    for key in dict.fromkeys(largest):
        v = res[key]
        print(f"simulator cost, {key}: {v['wall_s']:.2f} s wall, {v['events']} events, "
              f"{v['samples']} samples trained in {v['steps']} steps "
              f"({1e6 * v['wall_s'] / max(1, v['samples']):.0f} us a sample)")
    print(f"all {len(res)} simulations: {sim_s:.1f} s of simulation; this script: {wall:.1f} s "
          f"wall ({args.jobs} processes)")
    if plots:
        pngs = sorted(str(p) for p in OUT["dir"].glob("papers_*.png"))
        print("figures: " + ", ".join(pngs))
    report["wall_s"] = wall
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
