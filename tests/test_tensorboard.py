"""metrics.jsonl is mirrored into TensorBoard event files when tensorboard is installed."""
import json

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from asyncflow.runtime.trace import MetricsLog  # noqa: E402


def test_every_numeric_metric_becomes_a_scalar_series(tmp_path):
    log = MetricsLog(str(tmp_path / "metrics.jsonl"))
    rows = [{"step": i, "reward_mean": 0.1 * i, "utilization": {"rollout": 0.5 + 0.1 * i},
             "note": "text is skipped", "loss": None} for i in range(3)]
    for r in rows:
        log.append(r)
    log.close()
    assert [json.loads(x)["reward_mean"] for x in open(tmp_path / "metrics.jsonl")] == [0.0, 0.1, 0.2]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward_mean", "utilization/rollout"} <= tags and "note" not in tags and "loss" not in tags
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward_mean")] == [(0, 0.0), (1, 0.1), (2, 0.2)]


def test_no_event_files_when_disabled(tmp_path):
    log = MetricsLog(str(tmp_path / "metrics.jsonl"), tensorboard=False)
    log.append({"step": 0, "reward_mean": 1.0})
    log.close()
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_does_not_import_torch(tmp_path):
    # The local backend runs every worker as a thread of the driver's process: torch's import
    # there (torch.utils.tensorboard) held the GIL ~0.5 s after the first step and froze all of
    # them at once, so a 0.3 s lease renewed every 0.1 s expired
    # (faults/test_liveness.py::test_slow_reward_with_short_lease_finishes[local]).
    import subprocess
    import sys

    code = ("import sys; from asyncflow.runtime.trace import MetricsLog\n"
            f"log = MetricsLog({str(tmp_path / 'metrics.jsonl')!r})\n"
            "log.append({'step': 0, 'reward_mean': 1.0}); log.text(0, [{'prompt': 'p', 'completion': 'c'}])\n"
            "log.close(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", out.stdout
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert "reward_mean" in acc.Tags()["scalars"] and "samples/text_summary" in acc.Tags()["tensors"]


def test_a_steps_scalars_are_one_event(tmp_path):
    # an event per scalar and a flush per step cost the driver 1.6 ms of CPU a step (about 30
    # scalars): a step's scalars are written as one event holding every value
    import glob

    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    log = MetricsLog(str(tmp_path / "metrics.jsonl"))
    for i in range(4):
        log.append({"step": i, "reward_mean": float(i), "loss": 2.0 * i,
                    "utilization": {"train": 0.5}})
    log.close()
    [path] = glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
    events = [e for e in map(Event.FromString, RawEventFileLoader(path).Load())
              if e.HasField("summary")]
    assert [e.step for e in events] == [0, 1, 2, 3]
    assert [sorted((v.tag, v.simple_value) for v in e.summary.value) for e in events][2] == [
        ("loss", 4.0), ("reward_mean", 2.0), ("utilization/train", 0.5)]
