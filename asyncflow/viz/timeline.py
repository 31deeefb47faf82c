"""A run's timeline: RUN_DIR/trace.json (Chrome trace, :mod:`asyncflow.runtime.trace`) drawn as
a Gantt chart, as SVG, PNG or a self-contained HTML page with a utilisation table.

The picture, top to bottom: a title; the time axis (seconds since the run started); one lane per
worker (``tid``), grouped under its pool (``pid``; ``cpu`` last); the legend.

- A bar is one op (``ph: "X"`` event), coloured by its task (``cat``). ``COMPUTE`` ops are solid;
  other ops (``READ``/``WRITE`` on the store) are pale; ops whose name says ``SYNC``/``WEIGHT``
  are dark grey (weight sync). A bar wide enough shows the policy version it ran with (``v3``).
- Ops that overlap in one lane (a continuous-batching rollout running samples side by side)
  are stacked in up to three thin rows; beyond that the lane becomes a filled step chart of how
  many ops are in flight (full height = the lane's peak, printed beside its name), which shows
  a long tail as the thin sliver it is.
- Bars of one task closer than half a pixel are merged (a long run stays a small file); the
  tooltip says how many ops a bar stands for.
- A dashed vertical line marks where each policy version is first used (``v1``, ``v2``, ...):
  the train steps as the rollouts see them.
- The scheduling keys' events are small triangles at the top of their lane (:data:`EVENTS`):
  samples cancelled in flight (a redundant group not needed, a sample no step may take any
  more), samples dropped as too stale, samples restarted by new weights (``on_update: abort``).

Utilisation (:func:`timeline_summary`): a lane is busy while any of its ``COMPUTE``/sync ops
runs (all ops if the trace has no ``COMPUTE``); ``busy_fraction`` = busy time / the run's span;
a pool's utilisation is the mean over its lanes; ``bubble_fraction`` = 1 - the device lanes'
(all pools but ``cpu``) busy time / (their number x the span). Because a rollout lane counts as
busy while even one of its slots runs, the runtime's own ``utilization`` (slot occupancy, in
metrics.jsonl) is the stricter figure for continuous batching.
"""
from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field

from asyncflow.viz.svg import PALETTE, Canvas, VizError, fmt_num, html_table, nice_ticks, \
    text_width

WIDTH = 1100
LANE_H = 22
POOL_H = 22
MAX_SUBROWS = 3
SYNC_COLOR = "#444444"
#: zero-length trace events of the scheduling keys: name -> (colour, legend)
EVENTS = {"CANCEL": ("#d62728", "cancelled in flight"),
          "DROP": ("#ff7f0e", "dropped: too stale"),
          "ABORT": ("#9467bd", "restarted: new weights")}


@dataclass
class Op:
    pool: str
    worker: str
    task: str
    name: str
    start: float  # seconds since the first event
    end: float
    args: dict = field(default_factory=dict)

    @property
    def compute(self) -> bool:
        return self.name.upper() == "COMPUTE"

    @property
    def sync(self) -> bool:
        n = self.name.upper()
        return "SYNC" in n or "WEIGHT" in n


@dataclass
class Trace:
    ops: list[Op]
    pools: list[str]  # display order
    lanes: list[tuple[str, str]]  # (pool, worker) in display order
    tasks: list[str]  # colour order
    span: float  # seconds from the first event's start to the last event's end


def _natural(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(s))]


def load_trace(path_or_doc) -> Trace:
    """Read a Chrome trace (a path, a ``{"traceEvents": [...]}`` document, or a bare list)."""
    doc = path_or_doc
    if isinstance(path_or_doc, (str, bytes)) or hasattr(path_or_doc, "__fspath__"):
        try:
            with open(path_or_doc, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise VizError(f"cannot read trace {str(path_or_doc)!r}: {e}") from e
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise VizError("a trace is {\"traceEvents\": [...]} or a list of events")
    pool_names: dict = {}
    thread_names: dict = {}
    lanes_seen: dict = {}  # (pid, tid) -> None, in metadata-then-event order
    raw = []
    for e in events:
        if not isinstance(e, dict):
            continue
        ph, pid, tid = e.get("ph"), e.get("pid", "cpu"), e.get("tid", "")
        if ph == "M":
            name = (e.get("args") or {}).get("name")
            if e.get("name") == "process_name" and name is not None:
                pool_names[pid] = str(name)
            elif e.get("name") == "thread_name" and name is not None:
                thread_names[(pid, tid)] = str(name)
                lanes_seen.setdefault((pid, tid), None)
        elif ph == "X" and "ts" in e:
            lanes_seen.setdefault((pid, tid), None)
            raw.append(e)
    t0 = min((float(e["ts"]) for e in raw), default=0.0)
    ops = []
    for e in raw:
        pid, tid = e.get("pid", "cpu"), e.get("tid", "")
        start = (float(e["ts"]) - t0) / 1e6
        ops.append(Op(pool_names.get(pid, str(pid)), thread_names.get((pid, tid), str(tid)),
                      str(e.get("cat") or e.get("name") or "op"), str(e.get("name", "")),
                      start, start + max(0.0, float(e.get("dur", 0.0))) / 1e6,
                      dict(e.get("args") or {})))
    ops.sort(key=lambda o: (o.start, o.end))
    lanes = sorted({(pool_names.get(p, str(p)), thread_names.get((p, t), str(t)))
                    for p, t in lanes_seen})
    pools = sorted({p for p, _ in lanes}, key=lambda p: (p == "cpu", _natural(p)))
    lanes.sort(key=lambda pw: (pools.index(pw[0]), _natural(pw[1])))
    first_lane = {}
    for o in ops:
        first_lane.setdefault(o.task, lanes.index((o.pool, o.worker)))
    tasks = sorted(first_lane, key=lambda t: first_lane[t])  # stable: then by first start
    span = max((o.end for o in ops), default=0.0)
    return Trace(ops, pools, lanes, tasks, span)


# -- utilisation ---------------------------------------------------------------------------

def _union(intervals) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + ((cur_e - cur_s) if cur_e is not None else 0.0)


def timeline_summary(trace: Trace) -> dict:
    """``{"span_s", "workers": [{pool, worker, ops, busy_s, busy_fraction}],
    "pools": {pool: utilization}, "bubble_fraction"}`` (module docstring for the definitions)."""
    busy_ops = [o for o in trace.ops if o.compute or o.sync]
    if not any(o.compute for o in trace.ops):
        busy_ops = trace.ops
    span = trace.span or 1e-12
    workers, per_pool = [], {}
    for pool, worker in trace.lanes:
        mine = [o for o in trace.ops if (o.pool, o.worker) == (pool, worker)]
        busy = _union((o.start, o.end) for o in busy_ops if (o.pool, o.worker) == (pool, worker))
        workers.append({"pool": pool, "worker": worker, "ops": len(mine), "busy_s": busy,
                        "busy_fraction": busy / span})
        per_pool.setdefault(pool, []).append(busy / span)
    device = [w for w in workers if w["pool"] != "cpu"]
    bubble = (1 - sum(w["busy_s"] for w in device) / (len(device) * span)) if device else None
    return {"span_s": trace.span, "workers": workers,
            "pools": {p: sum(v) / len(v) for p, v in per_pool.items()},
            "bubble_fraction": bubble}


# -- drawing -------------------------------------------------------------------------------

def _rows_for(ops: list[Op]) -> tuple[list[int], int]:
    """Greedy interval colouring: a sub-row per op, and how many rows were needed."""
    ends: list[float] = []
    rows = []
    for o in ops:
        for i, e in enumerate(ends):
            if e <= o.start + 1e-12:
                ends[i] = o.end
                rows.append(i)
                break
        else:
            ends.append(o.end)
            rows.append(len(ends) - 1)
    return rows, len(ends)


def _merge(ops: list[Op], eps: float) -> list[tuple[Op, float, int]]:
    """Consecutive ops of one task and kind closer than ``eps`` seconds -> (first, end, count)."""
    out: list[list] = []
    for o in ops:
        if out:
            last, end, n = out[-1]
            if (last.task, last.name) == (o.task, o.name) and o.start - end < eps:
                out[-1] = [last, max(end, o.end), n + 1]
                continue
        out.append([o, o.end, 1])
    return [tuple(x) for x in out]


def _version_marks(trace: Trace) -> list[tuple[float, int]]:
    """(time, v): where each policy version is first used, after the first one."""
    first: dict[int, float] = {}
    for o in trace.ops:
        v = o.args.get("version")
        if isinstance(v, int) and (v not in first or o.start < first[v]):
            first[v] = o.start
    if not first:
        return []
    v0 = min(first)
    return sorted((t, v) for v, t in first.items() if v != v0)


def task_colors(tasks: list[str]) -> dict[str, str]:
    return {t: PALETTE[i % len(PALETTE)] for i, t in enumerate(tasks)}


def render_timeline(trace: Trace, title: str = "Run timeline") -> Canvas:
    """The Gantt chart of ``trace`` as a :class:`Canvas`."""
    colors = task_colors(trace.tasks)
    by_lane: dict[tuple[str, str], list[Op]] = {lane: [] for lane in trace.lanes}
    events = [o for o in trace.ops if o.name in EVENTS]
    for o in trace.ops:
        if o.name not in EVENTS:
            by_lane.setdefault((o.pool, o.worker), []).append(o)
    crowded = any(_rows_for(ops)[1] > MAX_SUBROWS for ops in by_lane.values())
    label_w = max([text_width(w, 12) for _, w in trace.lanes] +
                  [text_width(p, 13) for p in trace.pools] + [60]) + 28 + (46 if crowded else 0)
    left, right = label_w, 24
    plot_w = WIDTH - left - right
    span = trace.span if trace.span > 0 else 1.0
    px = plot_w / span
    top = 70  # title, subtitle and version labels above the plot

    # vertical layout: a pool header, then its lanes
    rows_y: list[tuple[str, object, float]] = []  # ("pool", name, y) / ("lane", (p, w), y)
    y = top
    for pool in trace.pools:
        rows_y.append(("pool", pool, y))
        y += POOL_H
        for lane in [ln for ln in trace.lanes if ln[0] == pool]:
            rows_y.append(("lane", lane, y))
            y += LANE_H
    plot_bottom = y
    legend_items = [(t, colors[t]) for t in trace.tasks]
    legend_rows = _legend_rows(legend_items, plot_w + left - 20)
    height = plot_bottom + 46 + 22 * (len(legend_rows) + 1 + (1 if events else 0)) + 10
    c = Canvas(WIDTH, height)
    summary = timeline_summary(trace)

    c.text(left, 24, title, 18, bold=True)
    sub = f"{len(trace.lanes)} workers in {len(trace.pools)} pools, {len(trace.ops)} ops, " \
          f"{span:.3g} s"
    if summary["bubble_fraction"] is not None:
        sub += f", device bubble {summary['bubble_fraction']:.0%}"
    c.text(left, 44, sub, 12, color="#555555")

    # lanes: zebra background, labels
    busy = {(w["pool"], w["worker"]): w["busy_fraction"] for w in summary["workers"]}
    for kind, name, yy in rows_y:
        if kind == "pool":
            c.rect(0, yy, WIDTH, POOL_H, "#e8ecf2", attrs={"class": "pool", "data-pool": name})
            c.text(8, yy + 15, f"pool {name}" if name != "cpu" else "cpu workers", 13, bold=True)
        else:
            pool, worker = name
            c.rect(left, yy, plot_w, LANE_H, "#fafafa",
                   attrs={"class": "lane", "data-pool": pool, "data-worker": worker},
                   title=f"{worker}: busy {busy.get(name, 0):.0%}")
            c.line(0, yy + LANE_H, WIDTH - right, yy + LANE_H, "#e2e2e2", 0.6)
            c.text(18, yy + 15, worker, 12)

    # time grid and axis
    ticks = nice_ticks(0.0, span, max(3, int(plot_w / 90)))
    for t in ticks:
        x = left + t * px
        if x > left + plot_w + 0.5:
            continue
        c.line(x, top, x, plot_bottom, "#dddddd", 0.6)
        c.line(x, plot_bottom, x, plot_bottom + 5, "#444444", 1)
        c.text(x, plot_bottom + 18, fmt_num(t), 11, "middle", "#333333")
    c.line(left, plot_bottom, left + plot_w, plot_bottom, "#444444", 1)
    c.text(left + plot_w / 2, plot_bottom + 36, "time since the run started (s)", 12, "middle")

    # bars
    eps = 0.5 / px
    lane_y = {name: yy for kind, name, yy in rows_y if kind == "lane"}
    for lane, ops in by_lane.items():
        if lane not in lane_y:
            continue
        y0 = lane_y[lane]
        rows, n = _rows_for(ops)
        if n > MAX_SUBROWS:  # many at once (continuous batching): how many are in flight
            _occupancy(c, ops, left, px, y0 + 3, LANE_H - 6, colors, lane)
            c.text(left - 6, y0 + 15, f"peak {n}", 10, "end", "#777777",
                   title=f"up to {n} ops of {lane[1]} ran at once")
            continue
        h = (LANE_H - 6) / n
        for r in range(n):
            mine = sorted((o for o, ro in zip(ops, rows) if ro == r), key=lambda o: o.start)
            for o, end, count in _merge(mine, eps):
                _bar(c, o, end, count, left + o.start * px, y0 + 3 + r * h,
                     max(1.0, (end - o.start) * px), h - (1 if n > 1 else 0), colors, lane)

    # the scheduling keys' events: a triangle at the top of the lane, merged within 3 px
    clusters: dict = {}  # (pool, worker, name) -> [[x, rows], ...]
    for o in events:
        if (o.pool, o.worker) not in lane_y:
            continue
        x = left + o.start * px
        mine = clusters.setdefault((o.pool, o.worker, o.name), [])
        rows = int(o.args.get("rows", 0) or 0)
        if mine and x - mine[-1][0] < 3:
            mine[-1][1] += rows
        else:
            mine.append([x, rows])
    for (pool, worker, name), mine in clusters.items():
        y0 = lane_y[(pool, worker)]
        color, what = EVENTS[name]
        for x, rows in mine:
            c.polygon([(x - 4, y0 + 1), (x + 4, y0 + 1), (x, y0 + 9)], color, 0.95,
                      title=f"{worker}: {rows} sample(s) {what}")

    # version changes
    marks = _version_marks(trace)
    min_gap = 26.0
    last_x = -1e9
    for t, v in marks:
        x = left + t * px
        c.line(x, top - 6, x, plot_bottom, "#555555", 0.8, dash=(3, 3), opacity=0.7,
               attrs={"class": "version-mark", "data-version": v},
               title=f"v{v} first used at {t:.3f} s")
        if x - last_x >= min_gap:
            c.text(x, top - 10, f"v{v}", 10, "middle", "#555555")
            last_x = x

    # legend
    ly = plot_bottom + 58
    c.text(left, ly, "task:", 12, bold=True)
    for row in legend_rows:
        x = left + 44
        for name, color in row:
            c.rect(x, ly - 10, 14, 12, color, rx=2)
            c.text(x + 19, ly, name, 12)
            x += 19 + text_width(name, 12) + 18
        ly += 22
    x = left + 44
    c.rect(x, ly - 10, 14, 12, "#888888", rx=2)
    c.text(x + 19, ly, "COMPUTE", 12)
    x += 19 + text_width("COMPUTE", 12) + 14
    c.rect(x, ly - 10, 14, 12, "#888888", opacity=0.35, rx=2)
    c.text(x + 19, ly, "READ / WRITE (store)", 12)
    x += 19 + text_width("READ / WRITE (store)", 12) + 14
    c.rect(x, ly - 10, 14, 12, SYNC_COLOR, rx=2)
    c.text(x + 19, ly, "weight sync", 12)
    x += 19 + text_width("weight sync", 12) + 18
    c.line(x, ly - 10, x, ly + 2, "#555555", 1, dash=(3, 2))
    c.text(x + 8, ly, "vN: first op on policy version N", 12)
    seen = [n for n in EVENTS if any(o.name == n for o in events)]
    if seen:
        ly += 22
        x = left + 44
        for name in seen:
            color, what = EVENTS[name]
            c.polygon([(x, ly - 10), (x + 12, ly - 10), (x + 6, ly)], color, 0.95)
            c.text(x + 18, ly, what, 12)
            x += 18 + text_width(what, 12) + 18
    return c


def _occupancy(c: Canvas, ops: list[Op], left: float, px: float, y: float, h: float, colors,
               lane) -> None:
    """A lane running many ops at once: a step chart of how many are in flight (full height =
    the lane's peak), one filled area per task."""
    peak = _rows_for(ops)[1]
    for task in dict.fromkeys(o.task for o in ops):
        edges = sorted([(o.start, 1) for o in ops if o.task == task] +
                       [(o.end, -1) for o in ops if o.task == task], key=lambda e: (e[0], e[1]))
        pts, k = [(left + edges[0][0] * px, y + h)], 0
        for t, d in edges:
            x = left + t * px
            pts.append((x, y + h - k / peak * h))
            k += d
            pts.append((x, y + h - k / peak * h))
        pts.append((pts[-1][0], y + h))
        n_ops = sum(1 for o in ops if o.task == task)
        c.polygon(pts, colors[task], 0.85, title=f"{task}: {n_ops} ops, up to {peak} at once",
                  attrs={"class": "occupancy", "data-task": task, "data-worker": lane[1],
                         "data-count": n_ops})


def _bar(c: Canvas, o: Op, end: float, count: int, x: float, y: float, w: float, h: float,
         colors, lane) -> None:
    color = SYNC_COLOR if o.sync else colors[o.task]
    opacity = 1.0 if (o.compute or o.sync) else 0.35
    a = o.args
    tip = [f"{o.task} {o.name}" + (f" x{count}" if count > 1 else ""), lane[1],
           f"{o.start:.3f} s - {end:.3f} s ({(end - o.start) * 1000:.1f} ms)"]
    tip.append(", ".join(f"{k}={a[k]}" for k in ("rows", "version", "step")
                         if a.get(k) is not None))
    c.rect(x, y, w, h, color, opacity=opacity, title="\n".join(t for t in tip if t),
           attrs={"class": "bar", "data-task": o.task, "data-op": o.name, "data-worker": lane[1],
                  "data-count": count})
    v = a.get("version")
    if v is not None and o.compute and count == 1 and h >= 12 and w >= text_width(f"v{v}", 10) + 6:
        c.text(x + w / 2, y + h / 2 + 3.5, f"v{v}", 10, "middle", "#ffffff")


def _legend_rows(items, width: float):
    rows, row, x = [], [], 0.0
    for name, color in items:
        w = 19 + text_width(name, 12) + 18
        if row and x + w > width:
            rows.append(row)
            row, x = [], 0.0
        row.append((name, color))
        x += w
    if row:
        rows.append(row)
    return rows or [[]]


def summary_html(trace: Trace) -> str:
    s = timeline_summary(trace)
    rows = [[w["pool"], w["worker"], w["ops"], round(w["busy_s"], 3), f"{w['busy_fraction']:.1%}"]
            for w in s["workers"]]
    out = html_table("Workers: busy time (COMPUTE and weight sync)",
                     ["pool", "worker", "ops", "busy (s)", "busy fraction"], rows, left=2)
    pools = [[p, f"{u:.1%}"] for p, u in s["pools"].items()]
    out += html_table("Pools: mean busy fraction of their workers", ["pool", "utilization"], pools)
    bubble = "n/a" if s["bubble_fraction"] is None else f"{s['bubble_fraction']:.1%}"
    out += (f"<p>Run span <b>{s['span_s']:.3f} s</b>; device bubble fraction "
            f"(idle share of device workers' time) <b>{html.escape(bubble)}</b>.</p>\n")
    return out


def draw_timeline(trace_path, out_path: str, title: str | None = None) -> str:
    """Draw RUN_DIR/trace.json as a Gantt chart; the format follows ``out_path``'s suffix
    (``.svg``, ``.png``, or ``.html`` with the per-worker busy table). Returns ``out_path``."""
    trace = load_trace(trace_path)
    name = title or "Run timeline"
    canvas = render_timeline(trace, name)
    extra = summary_html(trace) if str(out_path).lower().endswith((".html", ".htm")) else ""
    return canvas.save(str(out_path), html_extra=extra, title=name)
