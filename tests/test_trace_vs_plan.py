"""Every run's trace.json against its plan.json: the compiled plan is the program.

Each shipped pipeline that can run here is run briefly (``--steps 3``; sim latencies shrunk) on
the local backend, and a representative subset on Ray, and its trace is held against the plan's
op lists:

- every span's op kind is in its worker's op list (``START``, the engine build, is not an op);
- the workers with spans are exactly the plan's workers;
- a READ takes at most the op's ``rows`` (a serve loop's pull: at most ``chunk``), at least its
  ``min_rows`` (but a step's drops), and whole groups where the op says ``group``;
- a trainer READs micro-batches of the plan's size, within one step, and a step's READs add up
  to the rows it trained (``samples_per_step`` minus whole dropped groups);
- PUBLISH / ADOPT only on workers whose op list has them; one trainer COMPUTE per step.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
from collections import defaultdict

import pytest
from shared_runs import shipped_run

from asyncflow.engines.base import load_engine_class
from asyncflow.plan import Plan
from asyncflow.viz.timeline import EVENTS

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# dapo.yaml runs on the local backend only: on Ray it took 31 s, the most of any (CI's budget)
RAY_SUBSET = ("grpo_digits.yaml", "sim_longtail.yaml", "ppo_gae.yaml", "agentic_multiturn.yaml")


def _runnable(path: str) -> bool:
    name = os.path.basename(path)
    for extra, module in (("_vllm", "vllm"), ("_deepspeed", "deepspeed")):
        if extra in name and importlib.util.find_spec(module) is None:
            return False
    return True


PIPELINES = sorted(p for p in glob.glob(os.path.join(HERE, "pipelines", "*.yaml")) if _runnable(p))
CASES = [pytest.param(p, "local", id=f"{os.path.basename(p)}-local") for p in PIPELINES] + [
    pytest.param(p, "ray", id=f"{os.path.basename(p)}-ray")
    for p in PIPELINES if os.path.basename(p) in RAY_SUBSET]


def check(out: str) -> None:
    with open(os.path.join(out, "plan.json")) as f:
        plan = json.load(f)
    with open(os.path.join(out, "trace.json")) as f:
        spans = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"
                 and e["name"] != "START" and e["name"] not in EVENTS]  # events, not ops
    ops = {w["id"]: w["ops"] for w in plan["workers"]}
    task_of = {w["id"]: w["task"] for w in plan["workers"]}
    engines = {t["name"]: t["engine"] for t in plan["tasks"]}
    st = plan["step"]
    by_worker = defaultdict(list)
    for e in spans:
        by_worker[e["tid"].split("#")[0]].append(e)
    assert set(by_worker) == set(ops), (sorted(by_worker), sorted(ops))  # the plan's workers
    for wid, es in by_worker.items():
        kinds_here = {o["kind"] for o in ops[wid]}
        for e in es:
            assert e["name"] in kinds_here, (wid, e["name"], sorted(kinds_here))
        read = next(o for o in ops[wid] if o["kind"] == "READ")
        reads = [e for e in es if e["name"] == "READ"]
        engine = engines[task_of[wid]]
        loop = Plan.from_dict(plan).worker(wid).loop  # what the plan says the worker runs
        serve = loop == "serve"
        most = read["chunk"] if serve else read["rows"]
        for e in reads:
            n = e["args"]["rows"]
            assert 1 <= n <= most, (wid, n, read)
            if read["granularity"] == "group":
                assert n % read["unit"] == 0, (wid, n, read["unit"])
        if loop != "train":
            continue
        # a trainer: micro-batches of the plan's size inside one step; one COMPUTE per step, or
        # with stream: true one per micro-batch, of its rows
        assert read["granularity"] in ("micro_batch", "step")
        per_step = defaultdict(list)
        for e in sorted(reads, key=lambda e: e["ts"]):
            per_step[e["args"]["step"]].append(e["args"]["rows"])
        computes = [e for e in es if e["name"] == "COMPUTE"]
        compute = next(o for o in ops[wid] if o["kind"] == "COMPUTE")
        task = Plan.from_dict(plan).task(task_of[wid])
        if task.stream and hasattr(load_engine_class(engine), "train_stream"):
            assert compute["repeat"] > 1, compute  # a COMPUTE per micro-batch, as read
            assert all(1 <= e["args"]["rows"] <= compute["rows"] for e in computes), wid
            assert sum(e["args"]["rows"] for e in computes) == sum(
                n for sizes in per_step.values() for n in sizes), wid
        else:
            assert len(computes) == st["steps"], (wid, len(computes))
        trained = {}
        with open(os.path.join(out, "train_rows.jsonl")) as f:
            for line in f:
                r = json.loads(line)
                if r["task"] == task_of[wid]:
                    trained[r["step"]] = len(r["rows"])
        for s in range(st["steps"]):
            sizes = per_step.get(s, [])
            assert sum(sizes) == trained[s], (wid, s, sizes, trained[s])
            assert sum(1 for n in sizes if n != read["rows"]) <= 1, (wid, s, sizes, read["rows"])
            gone = st["samples_per_step"] - sum(sizes)  # rows dropped: whole groups only
            assert gone >= 0 and gone % st["samples_per_prompt"] == 0, (wid, s, sizes)
        if read["granularity"] == "micro_batch":
            assert len(per_step[0]) == -(-trained[0] // read["rows"])
    for wid, es in by_worker.items():  # explicit: PUBLISH / ADOPT only where the plan has them
        names = {e["name"] for e in es}
        have = {o["kind"] for o in ops[wid]}
        assert "PUBLISH" not in names or "PUBLISH" in have
        assert "ADOPT" not in names or "ADOPT" in have


@pytest.mark.parametrize("path,backend", CASES)
def test_trace_matches_plan(path, backend, tmp_path_factory):
    # the same run other files read other facts of (tests/shared_runs.py)
    check(shipped_run(tmp_path_factory, os.path.basename(path), backend).ok().out)
