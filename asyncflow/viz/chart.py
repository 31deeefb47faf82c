"""One line chart: a few series over a shared x axis, as SVG, PNG or HTML (the
:class:`~asyncflow.viz.svg.Canvas` renderer). ``asyncflow simulate --sweep -o F.png`` draws its
series with it; ``benchmarks/papers.py`` draws the papers' figures.

A series is a mapping: ``label``, ``xs``, ``ys`` (None breaks the line), optional ``dash``
(a dashed line: a bound, a paper's figure), ``color`` and ``points`` (draw the points; default
when there are at most 40). ``x_labels`` names the x ticks by position instead of numbers (a
sweep over strings, such as a device split ``12:4``).
"""
from __future__ import annotations

import math

from asyncflow.viz.svg import PALETTE, Canvas, fmt_num, nice_ticks, text_width

WIDTH, HEIGHT = 860, 430
LEFT, RIGHT, TOP, BOTTOM = 84, 30, 70, 64


def _scale(lo: float, hi: float, log: bool):
    if log:
        lo, hi = math.log10(lo), math.log10(hi)
    if hi == lo:
        lo, hi = lo - 1, hi + 1
    return lo, hi


def line_chart(series: list[dict], *, title: str, xlabel: str, ylabel: str,
               subtitle: str = "", log_x: bool = False, zero_y: bool = True,
               x_labels: list[str] | None = None, width: int = WIDTH,
               height: int = HEIGHT) -> Canvas:
    """The chart as a :class:`Canvas` (``.save(path)`` writes .svg/.png/.html)."""
    c = Canvas(width, height)
    c.text(LEFT, 28, title, 17, bold=True)
    if subtitle:
        c.text(LEFT, 48, subtitle, 12, color="#555555")
    pw, ph = width - LEFT - RIGHT, height - TOP - BOTTOM
    xs = [x for s in series for x in s["xs"] if x is not None]
    ys = [y for s in series for y in s["ys"] if y is not None and math.isfinite(y)]
    if not xs or not ys:
        c.text(LEFT, TOP + 30, "nothing to draw", 13, color="#555555")
        return c
    log_x = log_x and min(xs) > 0
    x_lo, x_hi = _scale(min(xs), max(xs), log_x)
    pad = (x_hi - x_lo) * 0.03
    x_lo, x_hi = x_lo - pad, x_hi + pad
    y_lo, y_hi = (0.0 if zero_y else min(ys)), max(ys)
    if y_hi == y_lo:
        y_hi = y_lo + 1
    y_hi += (y_hi - y_lo) * 0.08

    def fx(x):
        v = math.log10(x) if log_x else x
        return LEFT + (v - x_lo) / (x_hi - x_lo) * pw

    def fy(y):
        return TOP + ph - (y - y_lo) / (y_hi - y_lo) * ph

    c.rect(LEFT, TOP, pw, ph, "#ffffff", stroke="#bbbbbb", stroke_width=0.8)
    for t in nice_ticks(y_lo, y_hi, 6):
        if y_lo - 1e-9 <= t <= y_hi + 1e-9:
            c.line(LEFT, fy(t), LEFT + pw, fy(t), "#e6e6e6", 0.7)
            c.text(LEFT - 6, fy(t) + 4, fmt_num(t), 11, "end", "#333333")
    if x_labels is not None:
        ticks = [(i, lab) for i, lab in enumerate(x_labels)]
    elif log_x:
        ticks = [(v, fmt_num(v)) for v in sorted(set(xs))]
    else:
        ticks = [(t, fmt_num(t)) for t in nice_ticks(min(xs), max(xs), 8)
                 if min(xs) - 1e-9 <= t <= max(xs) + 1e-9]
    for t, lab in ticks:
        c.line(fx(t), TOP + ph, fx(t), TOP + ph + 4, "#444444", 1)
        c.text(fx(t), TOP + ph + 17, lab, 11, "middle", "#333333")
    c.text(LEFT + pw / 2, height - 18, xlabel, 12, "middle")
    c.text(18, TOP + ph / 2, ylabel, 12, "middle", rotate=-90)
    for i, s in enumerate(series):
        color = s.get("color") or PALETTE[i % len(PALETTE)]
        seg: list = []
        segs = []
        for x, y in zip(s["xs"], s["ys"]):
            if x is None or y is None or not math.isfinite(y):
                if seg:
                    segs.append(seg)
                seg = []
            else:
                seg.append((fx(x), fy(y)))
        if seg:
            segs.append(seg)
        for pts in segs:
            c.polyline(pts, color, 2.0, dash=(6, 4) if s.get("dash") else None)
            if s.get("points", len(s["xs"]) <= 40):
                for px, py in pts:
                    c.circle(px, py, 3.0, color)
    # legend, top right inside the frame
    y = TOP + 18
    for i, s in enumerate(series):
        color = s.get("color") or PALETTE[i % len(PALETTE)]
        w = text_width(s["label"], 11)
        x = LEFT + pw - 12 - w
        c.rect(x - 30, y - 12, w + 36, 17, "#ffffff", opacity=0.85)
        c.line(x - 26, y - 4, x - 6, y - 4, color, 2.5, dash=(6, 4) if s.get("dash") else None)
        c.text(x, y, s["label"], 11, color="#222222")
        y += 18
    return c
