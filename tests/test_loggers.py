"""asyncflow run --log wandb --log mlflow: the real libraries, wandb offline and MLflow's local
file store, read back; a missing library, an unknown name and a logger that cannot start are
coded errors before any worker starts (asyncflow.runtime.loggers)."""
from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from asyncflow.runtime import loggers

from test_runtime_props import PIPELINE, PPS, SPP

STEPS = 3


@pytest.fixture
def pipeline(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text(PIPELINE.format(alpha=1, replicas=1, seed=3, pps=PPS, spp=SPP, steps=STEPS,
                                 score_replicas=1))
    return p


def run_cli(args, env=None, pre=""):
    """``asyncflow run ARGS`` in a fresh interpreter (``pre``: Python run before the CLI)."""
    code = (f"import sys, runpy\n{pre}\nsys.argv = ['asyncflow'] + {list(args)!r}\n"
            "runpy.run_module('asyncflow.cli', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def wandb_records(run_dir: str):
    """The records of an offline wandb run's ``.wandb`` file (a LevelDB-style log of
    protobuf records: 32 KiB blocks, each chunk a 7-byte header crc32/length/type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(glob.glob(os.path.join(run_dir, "*.wandb"))[0], "rb").read()
    assert data[:4] == b":W&B"
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and n == 0:
            break
        buf += data[pos:pos + n]
        pos += n
        if kind in (1, 4):  # a full record, or the last chunk of one
            r = pb.Record()
            r.ParseFromString(buf)
            buf = b""
            yield r


def test_wandb_and_mlflow_get_every_metric_and_the_samples(tmp_path, pipeline, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    out = tmp_path / "run"
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wb"), "WANDB_SILENT": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    r = run_cli(["run", str(pipeline), "--backend", "local", "--out", str(out), "--quiet",
                 "--log", "wandb", "--log", "mlflow", "--log-samples", "1"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    metrics = [json.loads(x) for x in open(out / "metrics.jsonl")]
    samples = [json.loads(x) for x in open(out / "samples.jsonl")]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert "logged to wandb: offline in" in r.stdout and "logged to mlflow: file://" in r.stdout

    # wandb: the offline run's history holds every step's metrics; the samples are a table
    (run_dir,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))
    history, config = {}, {}
    for rec in wandb_records(run_dir):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                     for i in rec.history.item}
            history.setdefault(items["_step"], {}).update(items)
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
    assert sorted(history) == list(range(STEPS))
    for m in metrics:
        h = history[m["step"]]
        assert h["samples_per_s"] == pytest.approx(m["samples_per_s"])
        assert h["utilization/rollout"] == pytest.approx(m["utilization"]["rollout"])
        assert h["samples/_type"] == "table-file"
    assert config["pipeline"] == "props"
    assert config["tasks"]["update"]["args"]["micro_batch"] == 4
    table = json.load(open(os.path.join(run_dir, "files", history[STEPS - 1]["samples/path"])))
    last = [s for s in samples if s["step"] == STEPS - 1]
    col = table["columns"].index("completion")
    assert [row[col] for row in table["data"]] == [s["completion"] for s in last]

    # mlflow: one finished run in experiment 'props' of RUN_DIR/mlruns
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="file://" + str(out / "mlruns"))
    exp = client.get_experiment_by_name("props")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    hist = client.get_metric_history(run.info.run_id, "samples_per_s")
    assert [(h.step, round(h.value, 3)) for h in hist] == \
        [(m["step"], round(m["samples_per_s"], 3)) for m in metrics]
    assert run.data.params["tasks.update.args.micro_batch"] == "4"
    assert run.data.params["step.samples_per_prompt"] == str(SPP)
    path = client.download_artifacts(run.info.run_id, f"samples/step_{STEPS - 1}.jsonl",
                                     str(tmp_path))
    assert [json.loads(x)["completion"] for x in open(path)] == [s["completion"] for s in last]


def test_a_missing_library_is_af670_before_anything_starts(tmp_path, pipeline):
    out = tmp_path / "run"
    r = run_cli(["run", str(pipeline), "--backend", "local", "--out", str(out), "--quiet",
                 "--log", "mlflow"], pre="sys.modules['mlflow'] = None  # not installed")
    assert r.returncode == 2, r.stdout + r.stderr
    text = r.stdout + r.stderr
    assert "AF670" in text and "pip install 'asyncflow[mlflow]'" in text
    assert "Traceback" not in text
    assert not (out / "plan.json").exists() and not (out / "metrics.jsonl").exists()


def test_an_unknown_logger_is_af671(tmp_path, pipeline):
    out = tmp_path / "run"
    r = run_cli(["run", str(pipeline), "--backend", "local", "--out", str(out), "--quiet",
                 "--log", "wandbb"])
    text = r.stdout + r.stderr
    assert r.returncode == 2 and "AF671" in text and "did you mean 'wandb'?" in text, text
    assert not (out / "plan.json").exists()


def test_a_logger_that_cannot_start_is_af672(tmp_path, pipeline):
    pytest.importorskip("mlflow")
    out = tmp_path / "run"
    r = run_cli(["run", str(pipeline), "--backend", "local", "--out", str(out), "--quiet",
                 "--log", "mlflow"], {"MLFLOW_TRACKING_URI": "nosuchscheme://nowhere"})
    text = r.stdout + r.stderr
    assert r.returncode == 2 and "AF672" in text and "--log mlflow" in text, text
    assert "Traceback" not in text and not (out / "plan.json").exists()


def test_wandb_goes_offline_without_an_api_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    assert loggers.wandb_mode({}) == "offline"
    assert loggers.wandb_mode({"WANDB_API_KEY": "k"}) == "online"
    assert loggers.wandb_mode({"WANDB_MODE": "disabled", "WANDB_API_KEY": "k"}) == "disabled"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")
    assert loggers.wandb_mode({}) == "online"


class _Recorder:
    name = "recorder"

    def __init__(self):
        self.calls = []

    def start(self, config):
        self.calls.append(("start", config["pipeline"]))

    def log(self, step, metrics):
        self.calls.append(("log", step, dict(loggers.scalars(metrics))))

    def text(self, step, samples):
        self.calls.append(("text", step, len(samples)))

    def finish(self, status="finished"):
        self.calls.append(("finish", status))


class _Broken(_Recorder):
    name = "broken"

    def log(self, step, metrics):
        raise ConnectionError("server went away")


def test_a_logger_that_fails_mid_run_is_switched_off_with_a_warning():
    warned = []
    rec = _Recorder()
    group = loggers.Loggers([_Broken(), rec], warn=warned.append)
    group.start({"pipeline": "p"})
    row = {"step": 1, "reward_mean": 0.5, "eval/reward_mean": 0.25, "utilization": {"rollout": 0.3},
           "note": "text", "loss": None, "flag": True}
    group.log(1, row)
    group.text(1, [{"prompt": "p", "completion": "c"}])
    group.finish("finished")
    assert group.names == ["recorder"] and "server went away" in group.failed["broken"]
    assert len(warned) == 1 and "logger broken failed in log" in warned[0]
    assert rec.calls == [("start", "p"),
                         ("log", 1, {"reward_mean": 0.5, "eval/reward_mean": 0.25,
                                     "utilization/rollout": 0.3}),
                         ("text", 1, 1), ("finish", "finished")]
