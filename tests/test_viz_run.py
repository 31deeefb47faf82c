"""Pictures of a run: the timeline (trace.json -> Gantt) and the metrics curves
(metrics.jsonl -> line charts), as SVG, PNG and HTML, from synthetic fixtures."""
import json
import math
import struct
import xml.etree.ElementTree as ET

import pytest

from asyncflow.viz.metrics import build_panels, draw_metrics, load_metrics
from asyncflow.viz.svg import Canvas, VizError, nice_ticks, png_available
from asyncflow.viz.timeline import draw_timeline, load_trace, timeline_summary

NS = "{http://www.w3.org/2000/svg}"
WORKERS = {"rollout": ["generate/0", "generate/1"], "train": ["update/0"], "cpu": ["score/0"]}
STEPS = 4


def _x(op, task, pool, worker, ts, dur, version):
    return {"name": op, "cat": task, "ph": "X", "ts": ts * 1e6, "dur": dur * 1e6, "pid": pool,
            "tid": worker, "args": {"rows": 8, "version": version, "step": 0}}


def make_trace(extra=()):
    """Per step (1 s): each generate replica READ 0.1 + COMPUTE 0.5, score COMPUTE 0.1,
    update COMPUTE 0.2 producing version s + 1. 4 + 1 + 1 = 6 ops a step."""
    events = []
    for pool, workers in WORKERS.items():
        events.append({"name": "process_name", "ph": "M", "pid": pool, "args": {"name": pool}})
        for w in workers:
            events.append({"name": "thread_name", "ph": "M", "pid": pool, "tid": w,
                           "args": {"name": w}})
    for s in range(STEPS):
        t = float(s)
        for w in WORKERS["rollout"]:
            events.append(_x("READ", "generate", "rollout", w, t, 0.1, s))
            events.append(_x("COMPUTE", "generate", "rollout", w, t + 0.1, 0.5, s))
        events.append(_x("COMPUTE", "score", "cpu", "score/0", t + 0.6, 0.1, s))
        events.append(_x("COMPUTE", "update", "train", "update/0", t + 0.7, 0.2, s + 1))
    events.extend(extra)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write(tmp_path, doc, name="trace.json"):
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


def svg_of(path):
    return ET.parse(path).getroot()


def by_class(root, cls, tag=None):
    return [e for e in root.iter() if e.get("class") == cls and (tag is None or e.tag == NS + tag)]


def assert_png(path, width=None):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    w, h = struct.unpack(">II", data[16:24])
    assert w > 100 and h > 100
    if width:
        assert w == width
    assert data.rstrip(b"\x00")[-8:-4] == b"IEND"


needs_png = pytest.mark.skipif(not png_available(), reason="libcairo not found (apt graphviz)")


# -- timeline ------------------------------------------------------------------------------

def test_load_trace_lanes_pools_and_times(tmp_path):
    tr = load_trace(write(tmp_path, make_trace()))
    assert tr.pools == ["rollout", "train", "cpu"]  # cpu last
    assert tr.lanes == [("rollout", "generate/0"), ("rollout", "generate/1"),
                        ("train", "update/0"), ("cpu", "score/0")]
    assert tr.tasks == ["generate", "update", "score"]
    assert len(tr.ops) == 6 * STEPS and tr.span == pytest.approx(STEPS - 1 + 0.9)


def test_summary_busy_and_bubble(tmp_path):
    s = timeline_summary(load_trace(write(tmp_path, make_trace())))
    span = STEPS - 1 + 0.9
    w = {x["worker"]: x for x in s["workers"]}
    assert w["generate/0"]["busy_s"] == pytest.approx(0.5 * STEPS)  # COMPUTE only, not READ
    assert w["update/0"]["busy_fraction"] == pytest.approx(0.2 * STEPS / span)
    assert s["pools"]["rollout"] == pytest.approx(0.5 * STEPS / span)
    device_busy = 0.5 * STEPS * 2 + 0.2 * STEPS  # the cpu pool does not count
    assert s["bubble_fraction"] == pytest.approx(1 - device_busy / (3 * span))


def test_timeline_svg_lanes_bars_and_version_marks(tmp_path):
    out = draw_timeline(write(tmp_path, make_trace()), str(tmp_path / "t.svg"))
    root = svg_of(out)
    assert root.tag == NS + "svg"
    lanes = by_class(root, "lane", "rect")
    assert [e.get("data-worker") for e in lanes] == ["generate/0", "generate/1", "update/0",
                                                    "score/0"]
    assert [e.get("data-pool") for e in by_class(root, "pool")] == ["rollout", "train", "cpu"]
    bars = by_class(root, "bar", "rect")
    assert len(bars) == 6 * STEPS
    assert sum(b.get("data-worker") == "generate/1" for b in bars) == 2 * STEPS
    assert {b.get("data-task") for b in bars} == {"generate", "update", "score"}
    # one colour per task, the same on every bar of the task
    colours = {}
    for b in bars:
        if b.get("data-op") == "COMPUTE":
            colours.setdefault(b.get("data-task"), set()).add(b.get("fill"))
    assert all(len(c) == 1 for c in colours.values()) and len(
        {next(iter(c)) for c in colours.values()}) == 3
    marks = by_class(root, "version-mark")
    assert [int(m.get("data-version")) for m in marks] == list(range(1, STEPS + 1))
    texts = "".join(root.itertext())
    assert "time since the run started (s)" in texts and "generate" in texts and "v1" in texts
    # bars lie inside their lane
    lane_y = {e.get("data-worker"): float(e.get("y")) for e in lanes}
    for b in bars:
        y = float(b.get("y"))
        assert lane_y[b.get("data-worker")] <= y < lane_y[b.get("data-worker")] + 22


def test_tiny_adjacent_ops_are_merged(tmp_path):
    extra = [_x("COMPUTE", "score", "cpu", "score/0", 10 + i * 1e-5, 1e-5, 0) for i in range(500)]
    root = svg_of(draw_timeline(write(tmp_path, make_trace(extra)), str(tmp_path / "t.svg")))
    merged = [b for b in by_class(root, "bar") if int(b.get("data-count")) > 1]
    assert len(merged) == 1 and merged[0].get("data-count") == "500"


def test_crowded_lane_becomes_an_occupancy_chart(tmp_path):
    extra = [_x("COMPUTE", "generate", "rollout", "generate/0", 20 + i * 0.01, 0.5, 0)
             for i in range(40)]
    root = svg_of(draw_timeline(write(tmp_path, make_trace(extra)), str(tmp_path / "t.svg")))
    occ = by_class(root, "occupancy", "polygon")
    assert len(occ) == 1 and occ[0].get("data-count") == str(40 + 2 * STEPS)
    assert not [b for b in by_class(root, "bar") if b.get("data-worker") == "generate/0"]
    assert "peak" in "".join(root.itertext())


@needs_png
def test_timeline_png(tmp_path):
    out = draw_timeline(write(tmp_path, make_trace()), str(tmp_path / "t.png"))
    assert_png(tmp_path / "t.png", width=2 * 1100)
    assert out.endswith("t.png")


def test_timeline_html_has_svg_and_table(tmp_path):
    out = draw_timeline(write(tmp_path, make_trace()), str(tmp_path / "t.html"))
    text = open(out).read()
    assert text.startswith("<!DOCTYPE html>") and "<svg" in text and "</svg>" in text
    assert "busy fraction" in text and "bubble" in text and "generate/1" in text
    assert "<script" not in text and "http://" not in text.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")


def test_empty_and_bare_list_traces(tmp_path):
    root = svg_of(draw_timeline(write(tmp_path, {"traceEvents": []}), str(tmp_path / "e.svg")))
    assert not by_class(root, "bar")
    events = [e for e in make_trace()["traceEvents"] if e["ph"] == "X"]  # no metadata
    tr = load_trace(write(tmp_path, events, "bare.json"))
    assert ("train", "update/0") in tr.lanes and len(tr.ops) == 6 * STEPS


def test_bad_inputs(tmp_path):
    with pytest.raises(VizError):
        draw_timeline(write(tmp_path, make_trace()), str(tmp_path / "t.gif"))
    with pytest.raises(VizError):
        load_trace(tmp_path / "missing.json")


# -- metrics -------------------------------------------------------------------------------

def make_metrics(tmp_path, n=30, gap_at=12, partial_tail=True):
    lines = []
    for s in range(1, n + 1):
        rec = {"step": s, "version": s, "samples_per_s": 50.0 + s,
               "reward_mean": 1 - math.exp(-s / 8), "reward_std": 0.1, "staleness_mean": 0.5,
               "staleness_max": 1,
               "utilization": {"rollout": 0.9, "train": 0.3}, "loss": 1.0 / s}
        if s == gap_at:
            del rec["reward_mean"]
        lines.append(json.dumps(rec))
    text = "\n".join(lines) + "\n\n" + ('{"step": 31, "rew' if partial_tail else "")
    p = tmp_path / "metrics.jsonl"
    p.write_text(text)
    return p


def test_load_metrics_skips_a_partial_last_line(tmp_path):
    assert [r["step"] for r in load_metrics(make_metrics(tmp_path))] == list(range(1, 31))


def test_panels_group_keys():
    recs = [{"step": 1, "reward_mean": 0.1, "reward_std": 0.01, "staleness_mean": 0.5,
             "staleness_max": 1, "samples_per_s": 3.0, "utilization": {"a": 0.5, "b": 0.2}}]
    panels = build_panels(recs, ("reward_mean", "samples_per_s", "staleness_mean",
                                 "staleness_max", "utilization", "never_logged"))
    assert [p.name for p in panels] == ["reward", "samples_per_s", "staleness", "utilization"]
    assert panels[0].band == ("reward_mean", "reward_std")
    assert [s.label for s in panels[2].series] == ["mean", "max"]
    assert [s.sub for s in panels[3].series] == ["a", "b"]


def test_metrics_svg(tmp_path):
    root = svg_of(draw_metrics(make_metrics(tmp_path), str(tmp_path / "m.svg")))
    assert [p.get("data-panel") for p in by_class(root, "panel")] == \
        ["reward", "samples_per_s", "staleness"]
    series = by_class(root, "series", "polyline")
    reward = [s for s in series if s.get("data-key") == "reward_mean"]
    assert len(reward) == 2  # the missing step breaks the line
    assert sum(len(s.get("points").split()) for s in reward) == 29
    assert len([s for s in series if s.get("data-key") == "staleness_max"]) == 1
    assert len(by_class(root, "band", "polygon")) == 2
    texts = "".join(root.itertext())
    assert "train step" in texts and "throughput (samples / s)" in texts and "std" in texts


def test_metrics_custom_keys_and_mappings(tmp_path):
    root = svg_of(draw_metrics(make_metrics(tmp_path), str(tmp_path / "m.svg"),
                               keys=("loss", "utilization")))
    assert [p.get("data-panel") for p in by_class(root, "panel")] == ["loss", "utilization"]
    subs = [s.get("data-sub") for s in by_class(root, "series")
            if s.get("data-key") == "utilization"]
    assert subs == ["rollout", "train"]


@needs_png
def test_metrics_png(tmp_path):
    draw_metrics(make_metrics(tmp_path), str(tmp_path / "m.png"))
    assert_png(tmp_path / "m.png", width=2 * 900)


def test_metrics_html(tmp_path):
    text = open(draw_metrics(make_metrics(tmp_path), str(tmp_path / "m.html"))).read()
    assert "<svg" in text and "reward_mean" in text and "<table>" in text


def test_metrics_empty_file(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    root = svg_of(draw_metrics(p, str(tmp_path / "m.svg")))
    assert "no metrics" in "".join(root.itertext())


# -- the drawing surface -------------------------------------------------------------------

def test_nice_ticks():
    assert nice_ticks(0, 10, 5) == [0, 2, 4, 6, 8, 10]
    assert nice_ticks(0, 1, 4) == [0, 0.25, 0.5, 0.75, 1.0]
    assert nice_ticks(-1, 1, 4) == [-1, -0.5, 0, 0.5, 1]
    assert nice_ticks(3, 3)[0] == 3  # a flat range still gets an axis


def test_canvas_escapes_text(tmp_path):
    c = Canvas(100, 50)
    c.text(5, 20, "a < b & c", title="x > y")
    root = ET.fromstring(c.to_svg())
    assert "a < b & c" in "".join(root.itertext())
