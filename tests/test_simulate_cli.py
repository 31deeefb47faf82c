"""`asyncflow simulate` and compile's simulated estimate on the command line (the CLI's own
entry point, ``asyncflow.cli.main``, in this process from the repository root: exit code,
stdout and stderr as a user's shell sees them, without a Python start-up a call)."""
import json
from pathlib import Path

import pytest
from shared_runs import cli_result

ROOT = Path(__file__).resolve().parent.parent
LONGTAIL = "pipelines/sim_longtail.yaml"


@pytest.fixture
def af(capsys, monkeypatch):
    """af(*args) -> the CliResult of ``asyncflow ARGS`` run from the repository root."""
    monkeypatch.chdir(ROOT)  # the paths below are relative to it
    return lambda *args: cli_result(capsys, *args)


def test_json_has_the_language_keys_and_consistent_numbers(af):
    r = af("simulate", LONGTAIL, "--json", "--steps", "6")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for k in ("samples_per_s", "step_time_s", "devices", "wall_s"):
        assert k in d, k
    assert d["devices"] == 5  # pools rollout 4 + train 1
    assert d["steps"] == 6 and len(d["step_ends_s"]) == 6
    # steady state: samples of steps 1..5 over the time from the end of step 0
    span = d["step_ends_s"][-1] - d["step_ends_s"][0]
    assert abs(d["samples_per_s"] - 5 * 128 / span) < 1e-6 * d["samples_per_s"]
    assert abs(d["step_time_s"] - span / 5) < 1e-9
    assert d["staleness_max"] <= 2
    # the trainer sleeps 0.005 s a sample: no step is faster than 128 * 0.005 s
    assert min(b - a for a, b in zip(d["step_ends_s"], d["step_ends_s"][1:])) >= 0.64 - 1e-9


def test_human_output_names_pools_and_utilization(af):
    r = af("simulate", LONGTAIL, "--steps", "4")
    assert r.returncode == 0, r.stderr
    for word in ("samples/s, steady state", "step time", "pools", "utilization", "bubble",
                 "rollout", "train", "generate", "update"):
        assert word in r.stdout, word


def test_sweep_over_staleness_orders_the_runs(af, tmp_path):
    png = tmp_path / "sweep.png"
    r = af("simulate", LONGTAIL, "--steps", "8", "--json", "--sweep",
           "sync.0.max_staleness=0,2", "-o", str(png))
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["values"] == ["0", "2"] and [x["value"] for x in d["runs"]] == ["0", "2"]
    sync, async_ = (x["samples_per_s"] for x in d["runs"])
    assert async_ > 1.15 * sync  # the long tail is hidden at staleness 2
    assert d["best"] == "2" and d["samples_per_s"] == async_
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_split_planner_finds_the_best_split_of_the_budget(af):
    r = af("simulate", LONGTAIL, "--steps", "6", "--json", "--sweep", "split=auto")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["budget"] == 5 and d["file_split"] == "4:1"
    for x in d["runs"]:
        roll, train = map(int, x["value"].split(":"))
        assert roll + train == 5 and x["devices"] == 5
    best = max(d["runs"], key=lambda x: x["samples_per_s"])
    assert d["best"] == best["value"]
    # the file's 4:1 is train-bound (128 x 5 ms a step on one device): a second train device
    # must win
    own = next(x for x in d["runs"] if x["value"] == "4:1")
    assert best["samples_per_s"] > 1.2 * own["samples_per_s"]
    assert best["value"] != "4:1"
    r = af("simulate", LONGTAIL, "--steps", "4", "--sweep", "split=3:2,2:3")
    assert r.returncode == 0, r.stderr
    assert "best split:" in r.stdout


def test_bad_sweeps_are_af642(af):
    for spec in ("foo", "split=3:x", "sync.0.max_staleness=", "split=1:1,1:1"):
        r = af("simulate", LONGTAIL, "--sweep", spec)
        assert r.returncode == 2, (spec, r.stdout, r.stderr)
        assert "AF642" in r.stderr, spec
        assert "Traceback" not in r.stderr


def test_bad_sweep_value_is_the_compilers_located_error(af):
    r = af("simulate", LONGTAIL, "--sweep", "sync.0.max_staleness=1,-1")
    assert r.returncode == 2 and "AF206" in r.stderr and "--set" in r.stderr


def test_split_needs_separate_pools(af, tmp_path):
    text = (ROOT / LONGTAIL).read_text().replace("    pool: train\n", "    pool: rollout\n")
    f = tmp_path / "colocated.yaml"
    f.write_text(text)
    r = af("simulate", str(f), "--sweep", "split=auto")
    assert r.returncode == 2 and "AF642" in r.stderr and "share pool" in r.stderr


def test_no_cost_hint_is_af640_at_the_rollout(af):
    r = af("simulate", "pipelines/grpo_digits.yaml")
    assert r.returncode == 2
    assert "AF640" in r.stderr and "pipelines/grpo_digits.yaml:" in r.stderr
    assert "Traceback" not in r.stderr


def test_usage_errors(af):
    assert af("simulate", LONGTAIL, "--steps", "0").returncode == 2
    assert af("simulate", LONGTAIL, "-o", "plot.jpg").returncode == 2
    r = af("simulate", "no/such/file.yaml")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_plot_without_sweep(af, tmp_path):
    png = tmp_path / "steps.png"
    r = af("simulate", LONGTAIL, "--steps", "4", "-o", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compile_estimate_is_simulated_and_closed_form_on_request(af):
    r = af("compile", LONGTAIL, "--json")
    assert r.returncode == 0, r.stderr
    est = json.loads(r.stdout)["estimate"]
    assert est["notes"][0].startswith("simulated")
    # the simulated synchronous figure sees the streaming trainer at staleness 0: well above
    # the closed form's 97.7 samples/s (a real run measures ~150)
    assert est["samples_per_s_sync"] > 130
    r = af("compile", LONGTAIL, "--closed-form")
    assert r.returncode == 0 and "closed form" in r.stdout
    r = af("compile", LONGTAIL)
    assert "estimate (steady state, simulated)" in r.stdout


def test_multiturn_pipeline_simulates(af):
    r = af("simulate", "pipelines/agentic_sim.yaml", "--json", "--steps", "4")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["samples_per_s"] > 0 and d["steps"] == 4


def test_a_sweep_runs_its_simulations_at_once_with_the_same_results(af):
    """--jobs N: each value in a process of its own (asyncflow/simulate/parallel.py), the very
    runs --jobs 1 gives in this process (a simulation's draws are keyed by row)."""
    runs = {}
    for j in ("1", "3"):
        r = af("simulate", LONGTAIL, "--steps", "6", "--json", "--sweep",
               "split=4:1,3:2,2:3", "-j", j)
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        assert d["jobs"] == int(j)
        runs[j] = [{k: v for k, v in x.items() if k not in ("wall_s", "events_per_s")}
                   for x in d["runs"]]
        assert [x["value"] for x in d["runs"]] == ["4:1", "3:2", "2:3"]
    assert runs["1"] == runs["3"]
    assert len({x["samples_per_s"] for x in runs["1"]}) == 3  # three different runs
    r = af("simulate", LONGTAIL, "--steps", "4", "--sweep", "sync.0.max_staleness=0,1", "-j", "2")
    assert r.returncode == 0 and "2 simulations in" in r.stdout and "2 at once" in r.stdout


def test_jobs_usage_errors(af):
    r = af("simulate", LONGTAIL, "-j", "0", "--sweep", "split=auto")
    assert r.returncode == 2 and "--jobs must be >= 1" in r.stderr
    r = af("simulate", LONGTAIL, "-j", "2")
    assert r.returncode == 2 and "give --sweep too" in r.stderr


def test_a_parallel_sweep_checks_every_value_before_it_starts(af):
    """A value that cannot compile is the compiler's located error before any simulation runs,
    with or without --jobs."""
    r = af("simulate", LONGTAIL, "--sweep", "sync.0.max_staleness=1,-1", "-j", "2")
    assert r.returncode == 2 and "AF206" in r.stderr and "Traceback" not in r.stderr
