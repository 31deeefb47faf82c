"""Helpers of the fault tests: a tiny sim pipeline, the CLI in a subprocess, the checks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PPS, SPP = 8, 4
SPS = PPS * SPP

FNS = '''
import math, sys, time
from asyncflow.rewards import digits_match

def slow(prompt, answer, response):
    time.sleep(0.02)
    return digits_match(prompt, answer, response)

def slower(prompt, answer, response):
    time.sleep(0.05)
    return digits_match(prompt, answer, response)

def nan(prompt, answer, response):
    return math.nan

def text(prompt, answer, response):
    return "good"

def boom(prompt, answer, response):
    raise ValueError("boom")

def bye(prompt, answer, response):
    sys.exit(3)
'''

# the shipped long-tail sim pipeline, shrunk: 8 prompts x 4 samples a step, tiny latencies
SETS = [f"step.prompts_per_step={PPS}", f"step.samples_per_prompt={SPP}",
        "tasks.generate.args.latency.median=0.005", "tasks.generate.args.latency.max=0.05",
        "tasks.update.args.seconds_per_sample=0.001"]


def pipeline(tmp: Path) -> Path:
    (tmp / "faultfns.py").write_text(FNS)
    p = tmp / "p.yaml"
    p.write_text((ROOT / "pipelines/sim_longtail.yaml").read_text())
    return p


def run_args(tmp: Path, *args: str, backend: str = "local", steps: int = 4,
              sets=()) -> list[str]:
    """``run PIPELINE ...``: the arguments of ``asyncflow`` for a run of the shrunk pipeline."""
    cmd = ["run", str(pipeline(tmp)), "--backend", backend, "--steps", str(steps), "--out",
           str(tmp / "run"), "--quiet"]
    for s in list(SETS) + list(sets):
        cmd += ["--set", s]
    return cmd + list(args)


def run_cli(tmp: Path, *args: str, backend: str = "local", steps: int = 4, sets=(),
            timeout: float = 150) -> tuple[subprocess.CompletedProcess, float]:
    """The CLI on the shrunk pipeline; ``r.marker`` tags its processes (:func:`no_orphans`)."""
    cmd = [sys.executable, "-m", "asyncflow.cli", *run_args(tmp, backend=backend, steps=steps,
                                                             sets=sets)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    env["ASYNCFLOW_TEST_RUN"] = marker = uuid.uuid4().hex
    t = time.time()
    r = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout,
                       env=env, cwd=str(tmp))
    r.marker = marker
    return r, time.time() - t


def check_rows(run: Path, steps: int, sps: int = SPS) -> None:
    """train_rows.jsonl: every step's rows exactly once."""
    recs = [json.loads(x) for x in (run / "train_rows.jsonl").read_text().splitlines() if x]
    by: dict[int, list] = {}
    for r in recs:
        by.setdefault(r["step"], []).append(r["rows"])
    assert sorted(by) == list(range(steps)), sorted(by)
    for s, rs in by.items():
        assert len(rs) == 1, f"step {s} trained {len(rs)} times"
        assert sorted(rs[0]) == list(range(s * sps, (s + 1) * sps)), f"step {s} rows differ"


def processes_of(marker: str) -> list[str]:
    """Processes alive now whose environment holds ``ASYNCFLOW_TEST_RUN=marker``: the CLI run's
    own and every Ray process it started (raylet, gcs_server, workers inherit it); runs of
    other people on the machine are not ours."""
    key = f"ASYNCFLOW_TEST_RUN={marker}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if key not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found.append(f"{pid} {cmd[:120]}")
    return found


def no_orphans(marker: str) -> None:
    """Nothing of the run is left a few seconds after the command returned."""
    deadline = time.time() + 10  # Ray's processes take a moment to exit after shutdown
    left: list[str] = []
    while time.time() < deadline:
        left = processes_of(marker)
        if not left:
            return
        time.sleep(0.25)
    raise AssertionError(f"processes left behind: {left}")
