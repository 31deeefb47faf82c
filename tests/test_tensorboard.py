"""metrics.jsonl is mirrored into TensorBoard event files when tensorboard is installed."""
import json

import pytest

pytest.importorskip("tensorboard")
pytest.importorskip("torch")

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
