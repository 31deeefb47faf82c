"""`asyncflow compile` and `asyncflow viz` on the command line (subprocess: the real entry point)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow.commands.viz import kind_of

ROOT = Path(__file__).resolve().parent.parent
GRPO = "pipelines/grpo_digits.yaml"


def af(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "asyncflow.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_compile_prints_tables():
    r = af("compile", GRPO)
    assert r.returncode == 0, r.stderr
    for word in ("tasks", "pools", "channels", "weight sync", "samples_per_step", "micro-batches",
                 "estimate", "deferred", "micro_batch", "group"):
        assert word in r.stdout, word


def test_compile_prints_the_processes():
    """Placement rule 6 as the user sees it: which workers share a process."""
    r = af("compile", GRPO)
    assert r.returncode == 0, r.stderr
    assert "processes (3 for 5 workers; one Ray actor each)" in r.stdout
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in r.stdout.splitlines() if line.count("│") == 3}
    assert rows["rollout:0"] == "generate/0, ref/0"
    assert rows["cpu:0"] == "score/0, advantage/0"
    assert rows["train:0"] == "update/0"


def test_compile_json_round_trips():
    from asyncflow.plan import Plan

    r = af("compile", GRPO, "--json", "--set", "sync.0.max_staleness=0")
    assert r.returncode == 0, r.stderr
    plan = Plan.from_json(r.stdout)
    assert plan.sync[0].mode == "blocking"


def test_compile_dot_mermaid_dump(tmp_path):
    r = af("compile", GRPO, "--dot")
    assert r.returncode == 0 and r.stdout.startswith("digraph") and "cluster_train" in r.stdout
    r = af("compile", GRPO, "--mermaid")
    assert r.returncode == 0 and r.stdout.startswith("flowchart LR")
    r = af("compile", GRPO, "--dump-after", "overlap")
    assert r.returncode == 0 and "granularity='group'" in r.stdout
    out = tmp_path / "plan.json"
    r = af("compile", GRPO, "--json", "-o", str(out))
    assert r.returncode == 0 and json.loads(out.read_text())["pipeline"] == "grpo_digits"


def test_compile_user_error_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / GRPO).read_text().replace("train: {devices: 1}",
                                                     "train: {devices: 1, resources: {GPU: 1}}"))
    r = af("compile", str(bad))
    assert r.returncode == 2
    assert "AF402" in r.stderr and "^" in r.stderr


def test_compile_device_kind_gpu():
    r = af("compile", GRPO, "--json", "--device-kind", "gpu")
    assert json.loads(r.stdout)["pools"][0]["bundles"][0]["resources"] == {"GPU": 1, "CPU": 1}
    assert af("compile", GRPO, "--device-kind", "tpu").returncode == 2


@pytest.mark.parametrize("suffix", [".svg", ".png", ".html", ".dot"])
def test_viz_pipeline(tmp_path, suffix):
    out = tmp_path / f"g{suffix}"
    r = af("viz", "pipelines/sim_longtail.yaml", "-o", str(out))
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert len(data) > 500
    if suffix == ".html":
        text = data.decode()
        assert "<svg" in text and "channels" in text and "<script" not in text


def test_viz_plan_json(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(af("compile", GRPO, "--json").stdout)
    assert kind_of(str(plan)) == "plan"
    r = af("viz", str(plan), "-o", str(tmp_path / "p.svg"))
    assert r.returncode == 0 and (tmp_path / "p.svg").read_text().lstrip().startswith("<?xml")


def test_viz_dispatch(tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text('{"traceEvents": []}')
    assert kind_of(str(trace)) == "trace"
    assert kind_of("run/metrics.jsonl") == "metrics"
    assert kind_of("x.af") == "pipeline"
    r = af("viz", str(trace), "-o", str(tmp_path / "t.html"))
    # drawn by asyncflow.viz.timeline when it exists, else a clear message and exit 2
    assert r.returncode in (0, 2)
    if r.returncode == 2:
        assert "draw_timeline" in r.stderr
