"""A run's learning and speed curves: RUN_DIR/metrics.jsonl (one JSON object per train step,
:mod:`asyncflow.runtime.trace`) drawn as stacked line charts sharing the step axis, as SVG,
PNG or a self-contained HTML page with a summary table.

Keys are grouped into panels: ``reward_mean`` and ``reward_max`` share a ``reward`` panel (any
``X_mean``/``X_max``/``X_min``/``X_pNN`` share ``X``); where ``X_std`` is logged, ``X_mean`` gets
a shaded mean +- std band. A key whose values are mappings (``utilization: {pool: f}``,
``queue_depth: {task: n}``) draws one line per entry. Missing values break a line rather than
being invented; a line with few points shows its points.

Evaluation rows (``eval:``; lines of their own with an ``eval/version`` key,
:mod:`asyncflow.runtime.evaluate`) are drawn too: each ``eval/<metric>`` gets a panel of its own,
its points at the policy version they were evaluated on (the train steps done), and the train
curves are drawn from the step rows alone.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from asyncflow.viz.svg import PALETTE, Canvas, VizError, fmt_num, html_table, nice_ticks, \
    text_width

DEFAULT_KEYS = ("reward_mean", "samples_per_s", "staleness_mean", "staleness_max")
# keys of an eval row that are bookkeeping, not a metric to draw
EVAL_BOOKKEEPING = ("eval/n", "eval/version", "eval/target", "eval/seconds")
WIDTH = 900
PANEL_H = 190
GAP = 62
LEFT, RIGHT = 78, 28
ZERO_BASED = {"samples_per_s", "staleness", "utilization", "queue_depth", "dropped", "samples",
              "bubble_fraction", "exposed_sync_s", "step_time"}  # their axis starts at 0
SUFFIXES = ("mean", "max", "min", "p50", "p90", "p95", "p99")
TITLES = {
    "reward": "reward", "samples_per_s": "throughput (samples / s)",
    "staleness": "staleness (policy versions behind)", "utilization": "utilization (busy share)",
    "loss": "loss", "step_time": "step time (s)", "bubble_fraction": "device bubble fraction",
    "queue_depth": "queue depth (rows waiting)", "exposed_sync_s": "exposed weight sync (s)",
    "dropped": "dropped samples (too stale)", "samples": "samples per step",
}


@dataclass
class Series:
    label: str
    key: str
    sub: str | None = None  # an entry of a mapping-valued key
    color: str = "#000000"


@dataclass
class Panel:
    name: str
    title: str
    series: list[Series] = field(default_factory=list)
    band: tuple[str, str] | None = None  # (mean key, std key)


def load_metrics(path) -> list[dict]:
    """The step records of a metrics.jsonl; blank and unreadable lines (a run still writing its
    last line) are skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise VizError(f"cannot read metrics {str(path)!r}: {e}") from e
    out = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def _num(x) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def is_eval(rec: dict) -> bool:
    """An evaluation's row (runtime/evaluate.py), not a train step's."""
    return "eval/version" in rec


def eval_keys(records: list[dict]) -> list[str]:
    """The ``eval/<metric>`` keys the eval rows carry (their std and bookkeeping left out)."""
    out: list[str] = []
    for r in records:
        if is_eval(r):
            for k in r:
                if k.startswith("eval/") and k not in EVAL_BOOKKEEPING and not k.endswith("_std") \
                        and k not in out:
                    out.append(k)
    return out


def _of(records: list[dict], key: str) -> list[dict]:
    """The rows a series of ``key`` is drawn from: eval rows for ``eval/`` keys, else step rows."""
    return [r for r in records if is_eval(r) == key.startswith("eval/")]


def _value(rec: dict, s: Series) -> float | None:
    v = rec.get(s.key)
    if s.sub is not None:
        v = v.get(s.sub) if isinstance(v, dict) else None
    return _num(v)


def _group(key: str) -> str:
    base, _, suffix = key.rpartition("_")
    return base if base and suffix in SUFFIXES else key


def build_panels(records: list[dict], keys=DEFAULT_KEYS) -> list[Panel]:
    """Group ``keys`` into panels (module docstring); keys never logged are left out."""
    panels: dict[str, Panel] = {}
    n_colors = 0
    for key in keys:
        group = _group(key)
        values = [r.get(key) for r in records if r.get(key) is not None]
        if not values:
            continue
        title = TITLES.get(group, group.replace("_", " "))
        if group.startswith("eval/"):
            title = f"{group} (held-out prompts, by the policy version evaluated)"
        panel = panels.setdefault(group, Panel(group, title))
        if any(isinstance(v, dict) for v in values):
            subs = []
            for v in values:
                for k in (v if isinstance(v, dict) else {}):
                    if k not in subs:
                        subs.append(k)
            for sub in subs:
                panel.series.append(Series(str(sub), key, sub, PALETTE[n_colors % len(PALETTE)]))
                n_colors += 1
        else:
            label = key.rpartition("_")[2] if group != key else key.replace("_", " ")
            panel.series.append(Series(label, key, None, PALETTE[n_colors % len(PALETTE)]))
            n_colors += 1
        std = f"{group}_std"
        if key == f"{group}_mean" and any(_num(r.get(std)) is not None for r in records):
            panel.band = (key, std)
            panel.title = TITLES.get(group, group) + " (mean, shaded: +- std)"
    return list(panels.values())


def _xs(records: list[dict]) -> list[float]:
    xs = [_num(r.get("step")) for r in records]
    if any(x is None for x in xs):
        return [float(i + 1) for i in range(len(records))]
    return xs


def _y_range(values: list[float], zero: bool = False) -> tuple[float, float, bool]:
    lo, hi = min(values), max(values)
    integer = all(float(v).is_integer() for v in values)
    if lo >= 0 and (zero or lo <= 0.5 * hi):
        lo = 0.0  # a non-negative quantity near zero: show zero
    if hi - lo < 1e-12:
        pad = abs(hi) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
        if values and min(values) >= 0:
            lo = max(0.0, lo)
    else:
        pad = (hi - lo) * 0.06
        lo, hi = (lo if lo == 0 else lo - pad), hi + pad
    return lo, hi, integer


def render_metrics(records: list[dict], keys=DEFAULT_KEYS, title: str = "Run metrics") -> Canvas:
    panels = build_panels(records, keys)
    if not panels:
        c = Canvas(WIDTH, 120)
        c.text(LEFT, 28, title, 18, bold=True)
        c.text(LEFT, 70, "no metrics to draw (none of: " + ", ".join(keys) + ")", 13,
               color="#555555")
        return c
    xs = _xs(records)
    steps = [r for r in records if not is_eval(r)]
    top = 56
    height = top + len(panels) * (PANEL_H + GAP) + 10
    c = Canvas(WIDTH, height)
    c.text(LEFT, 26, title, 18, bold=True)
    n_eval = len(records) - len(steps)
    c.text(LEFT, 44, f"{len(steps)} train steps" + (f", {n_eval} evaluations" if n_eval else ""),
           12, color="#555555")
    plot_w = WIDTH - LEFT - RIGHT
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    pad = (x_hi - x_lo) * 0.015  # points on the first and last step stay inside the frame
    x_lo, x_hi = x_lo - pad, x_hi + pad
    fx = lambda x: LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w  # noqa: E731
    xticks = [t for t in nice_ticks(x_lo, x_hi, max(3, int(plot_w / 80))) if float(t).is_integer()]

    for i, panel in enumerate(panels):
        y0 = top + i * (PANEL_H + GAP) + 26
        values = [v for s in panel.series for v in (_value(r, s) for r in records) if v is not None]
        if panel.band:
            m, sd = panel.band
            for r in records:
                mv, sv = _num(r.get(m)), _num(r.get(sd))
                if mv is not None and sv is not None:
                    values += [mv - sv, mv + sv]
        lo, hi, integer = _y_range(values, panel.name in ZERO_BASED)
        fy = lambda y: y0 + PANEL_H - (y - lo) / (hi - lo) * PANEL_H  # noqa: E731
        c.text(LEFT, y0 - 10, panel.title, 13, bold=True, attrs={"class": "panel-title"})
        c.rect(LEFT, y0, plot_w, PANEL_H, "#ffffff", stroke="#bbbbbb", stroke_width=0.8,
               attrs={"class": "panel", "data-panel": panel.name})
        yticks = nice_ticks(lo, hi, 5)
        if integer:
            yticks = [t for t in yticks if float(t).is_integer()] or yticks
        for t in yticks:
            if lo - 1e-9 <= t <= hi + 1e-9:
                c.line(LEFT, fy(t), LEFT + plot_w, fy(t), "#e6e6e6", 0.7)
                c.text(LEFT - 6, fy(t) + 4, fmt_num(t), 11, "end", "#333333")
        for t in xticks:
            c.line(fx(t), y0 + PANEL_H, fx(t), y0 + PANEL_H + 4, "#444444", 1)
            c.text(fx(t), y0 + PANEL_H + 16, fmt_num(t), 11, "middle", "#333333")
        if i == len(panels) - 1:
            c.text(LEFT + plot_w / 2, y0 + PANEL_H + 36, "train step", 12, "middle")
        if panel.band:
            _band(c, steps, [x for r, x in zip(records, xs) if not is_eval(r)], panel.band, fx,
                  fy, panel.series[0].color)
        for s in panel.series:
            rs = _of(records, s.key)
            _line(c, rs, [x for r, x in zip(records, xs) if is_eval(r) == s.key.startswith("eval/")],
                  s, fx, fy, show_points=len(rs) <= 60)
        _legend(c, panel, LEFT + plot_w, y0 - 10)
    return c


def _segments(records, xs, getter):
    seg, out = [], []
    for r, x in zip(records, xs):
        v = getter(r)
        if v is None:
            if seg:
                out.append(seg)
            seg = []
        else:
            seg.append((x, v))
    if seg:
        out.append(seg)
    return out


def _line(c: Canvas, records, xs, s: Series, fx, fy, show_points: bool) -> None:
    for seg in _segments(records, xs, lambda r: _value(r, s)):
        pts = [(fx(x), fy(y)) for x, y in seg]
        c.polyline(pts, s.color, 2.0, attrs={"class": "series", "data-key": s.key,
                                             "data-sub": s.sub or ""})
        if show_points or len(seg) == 1:
            for (px, py), (x, y) in zip(pts, seg):
                c.circle(px, py, 2.6, s.color, title=f"step {fmt_num(x)}: {s.label} = {fmt_num(y)}")


def _band(c: Canvas, records, xs, band, fx, fy, color) -> None:
    m, sd = band

    def both(r):
        mv, sv = _num(r.get(m)), _num(r.get(sd))
        return None if mv is None or sv is None else (mv, sv)

    for seg in _segments(records, xs, both):
        upper = [(fx(x), fy(mv + sv)) for x, (mv, sv) in seg]
        lower = [(fx(x), fy(mv - sv)) for x, (mv, sv) in reversed(seg)]
        c.polygon(upper + lower, color, 0.18, attrs={"class": "band", "data-key": m})


def _legend(c: Canvas, panel: Panel, right: float, y: float) -> None:
    items = [(s.label, s.color) for s in panel.series]
    if len(items) < 2 and not panel.band:
        return
    if panel.band:
        items.append(("+- std", None))
    x = right
    for label, color in reversed(items):
        w = text_width(label, 11)
        x -= w
        c.text(x, y, label, 11, color="#333333")
        x -= 20
        if color:
            c.line(x, y - 4, x + 15, y - 4, color, 2.5)
        else:
            c.rect(x, y - 10, 15, 10, panel.series[0].color, opacity=0.18)
        x -= 14


def summary_html(records: list[dict], keys=DEFAULT_KEYS) -> str:
    rows = []
    for panel in build_panels(records, keys):
        for s in panel.series:
            vals = [v for v in (_value(r, s) for r in records) if v is not None]
            name = s.key + (f"[{s.sub}]" if s.sub is not None else "")
            rows.append([name, len(vals), vals[0], vals[-1], min(vals), max(vals),
                         sum(vals) / len(vals)])
    rows = [[r[0], r[1]] + [float(v) for v in r[2:]] for r in rows]
    return html_table(f"Metrics over {len(records)} train steps",
                      ["metric", "steps", "first", "last", "min", "max", "mean"], rows)


def draw_metrics(metrics_path, out_path: str, keys=DEFAULT_KEYS, title: str | None = None) -> str:
    """Draw RUN_DIR/metrics.jsonl as line charts per step; the format follows ``out_path``'s
    suffix (``.svg``, ``.png``, or ``.html`` with a first/last/min/max/mean table). Returns
    ``out_path``."""
    records = load_metrics(metrics_path)
    if tuple(keys) == DEFAULT_KEYS:  # and the evaluations' metrics, when the run has them
        keys = (*keys, *eval_keys(records))
    name = title or "Run metrics"
    canvas = render_metrics(records, tuple(keys), name)
    is_html = str(out_path).lower().endswith((".html", ".htm"))
    extra = summary_html(records, tuple(keys)) if is_html else ""
    return canvas.save(str(out_path), html_extra=extra, title=name)
