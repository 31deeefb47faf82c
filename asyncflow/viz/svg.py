"""A tiny drawing surface for the run pictures: record shapes once, write them as SVG (no
dependency) or PNG (through the system's libcairo, by ctypes), so both formats look the same.

libcairo ships with Graphviz (``apt-get install graphviz`` pulls in ``libcairo2``); where it is
missing, :func:`png_available` is false and :meth:`Canvas.save` of a ``.png`` raises
:class:`VizError`. SVG and HTML always work.

Shapes: ``rect``, ``line``, ``polyline``, ``polygon``, ``circle``, ``text``. Every shape takes
``attrs`` (extra SVG attributes such as ``class`` or ``data-*``, for tests and styling) and
``title`` (a hover tooltip in SVG and HTML).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import html
import math
import os

from asyncflow.errors import AsyncflowError

FONT = "DejaVu Sans"
FONT_STACK = "DejaVu Sans, Liberation Sans, Arial, Helvetica, sans-serif"

# Okabe-Ito and Tableau-like colours: distinguishable, colour-blind friendly first.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9", "#8C564B",
           "#7F7F7F", "#9467BD", "#17BECF", "#BCBD22", "#F0E442")


class VizError(AsyncflowError):
    """A picture could not be written (unknown suffix, no PNG renderer, unreadable input)."""


def text_width(s: str, size: float) -> float:
    """Approximate width of ``s`` in DejaVu Sans at ``size`` px (for layout only)."""
    wide = sum(1 for c in s if c in "mwMW@%")
    narrow = sum(1 for c in s if c in "ilj.,:;|!'()[]1 ")
    return size * (0.62 * len(s) + 0.25 * wide - 0.28 * narrow)


def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round tick values covering [lo, hi] (1, 2, 2.5, 5 x 10^k steps)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, target)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step + 1e-9) * step
    ticks, t = [], first
    while t <= hi + step * 1e-6:
        if t >= lo - step * 1e-6:
            ticks.append(round(t, 12))
        t += step
    return ticks


def fmt_num(x: float) -> str:
    """A short label for a tick or a table cell."""
    if x == 0:
        return "0"
    if abs(x) >= 1e4 or abs(x) < 1e-3:
        return f"{x:.2g}"
    return f"{x:.4g}" if abs(x) < 10 else f"{x:,.6g}"


class Canvas:
    """Shapes in draw order; ``to_svg()``, ``write_png(path)``, ``save(path)``."""

    def __init__(self, width: float, height: float, background: str = "#ffffff"):
        self.width, self.height, self.background = width, height, background
        self.shapes: list[tuple[str, dict]] = []

    # -- recording -------------------------------------------------------------------------
    def rect(self, x, y, w, h, fill, stroke=None, stroke_width=1.0, opacity=1.0, rx=0.0,
             title=None, attrs=None):
        self.shapes.append(("rect", dict(x=x, y=y, w=max(w, 0.0), h=max(h, 0.0), fill=fill,
                                          stroke=stroke, sw=stroke_width, opacity=opacity, rx=rx,
                                          title=title, attrs=attrs)))

    def line(self, x1, y1, x2, y2, stroke="#000000", width=1.0, dash=None, opacity=1.0,
             title=None, attrs=None):
        self.polyline([(x1, y1), (x2, y2)], stroke, width, dash, opacity, title, attrs)

    def polyline(self, points, stroke="#000000", width=1.0, dash=None, opacity=1.0, title=None,
                 attrs=None):
        self.shapes.append(("polyline", dict(points=list(points), stroke=stroke, sw=width,
                                             dash=dash, opacity=opacity, title=title,
                                             attrs=attrs)))

    def polygon(self, points, fill, opacity=1.0, title=None, attrs=None):
        self.shapes.append(("polygon", dict(points=list(points), fill=fill, opacity=opacity,
                                            title=title, attrs=attrs)))

    def circle(self, cx, cy, r, fill, title=None, attrs=None):
        self.shapes.append(("circle", dict(cx=cx, cy=cy, r=r, fill=fill, title=title,
                                           attrs=attrs)))

    def text(self, x, y, s, size=12.0, anchor="start", color="#222222", bold=False, rotate=0.0,
             title=None, attrs=None):
        """``(x, y)`` is the baseline point; ``anchor`` start | middle | end."""
        self.shapes.append(("text", dict(x=x, y=y, s=str(s), size=size, anchor=anchor,
                                         color=color, bold=bold, rotate=rotate, title=title,
                                         attrs=attrs)))

    # -- SVG -------------------------------------------------------------------------------
    def to_svg(self) -> str:
        w, h = _n(self.width), _n(self.height)
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
               f'viewBox="0 0 {w} {h}" font-family="{FONT_STACK}">',
               f'<rect x="0" y="0" width="{w}" height="{h}" fill="{self.background}"/>']
        for kind, s in self.shapes:
            out.append(_svg_shape(kind, s))
        out.append("</svg>")
        return "\n".join(out) + "\n"

    # -- PNG -------------------------------------------------------------------------------
    def write_png(self, path: str, scale: float = 2.0) -> None:
        """Render with libcairo at ``scale`` x (2 = crisp on high-DPI screens and in READMEs)."""
        _CairoPainter(self, scale).write(path)

    def save(self, path: str, html_extra: str = "", title: str = "") -> str:
        """Write ``.svg``, ``.png`` or ``.html`` (the SVG inline, then ``html_extra``)."""
        ext = os.path.splitext(path)[1].lower()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if ext == ".svg":
            with open(path, "w", encoding="utf-8") as f:
                f.write(self.to_svg())
        elif ext == ".png":
            self.write_png(path)
        elif ext in (".html", ".htm"):
            with open(path, "w", encoding="utf-8") as f:
                f.write(html_page(title or os.path.basename(path), self.to_svg() + html_extra))
        else:
            raise VizError(f"cannot write {path!r}: use a .svg, .png or .html file name")
        return path


def html_page(title: str, body: str) -> str:
    """One self-contained page (no scripts, no external resources)."""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: {FONT_STACK}; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin: 16px 0; font-size: 14px; }}
th, td {{ border: 1px solid #ccc; padding: 4px 10px; text-align: right; }}
th {{ background: #f2f2f2; }} td.l, th.l {{ text-align: left; }}
caption {{ text-align: left; font-weight: bold; padding: 6px 0; }}
svg {{ max-width: 100%; height: auto; }}
</style></head><body>
<h2>{html.escape(title)}</h2>
{body}
</body></html>
"""


def html_table(caption: str, header: list[str], rows: list[list], left: int = 1) -> str:
    """A table; the first ``left`` columns are left-aligned (names), the rest numbers."""
    def cell(tag, i, v):
        cls = ' class="l"' if i < left else ""
        v = fmt_num(v) if isinstance(v, float) else v
        return f"<{tag}{cls}>{html.escape(str(v))}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(header))
    body = "\n".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>"
                     for r in rows)
    return f"<table><caption>{html.escape(caption)}</caption>\n<tr>{head}</tr>\n{body}\n</table>\n"


def _n(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def _attrs(s: dict) -> str:
    extra = s.get("attrs") or {}
    return "".join(f' {k}="{html.escape(str(v), quote=True)}"' for k, v in extra.items())


def _title(s: dict) -> str:
    t = s.get("title")
    return f"<title>{html.escape(t)}</title>" if t else ""


def _svg_shape(kind: str, s: dict) -> str:
    a, t = _attrs(s), _title(s)
    if kind == "rect":
        stroke = f' stroke="{s["stroke"]}" stroke-width="{_n(s["sw"])}"' if s["stroke"] else ""
        op = f' fill-opacity="{s["opacity"]:.3g}"' if s["opacity"] < 1 else ""
        rx = f' rx="{_n(s["rx"])}"' if s["rx"] else ""
        body = (f'<rect x="{_n(s["x"])}" y="{_n(s["y"])}" width="{_n(s["w"])}" '
                f'height="{_n(s["h"])}" fill="{s["fill"]}"{op}{stroke}{rx}{a}')
    elif kind == "polyline":
        pts = " ".join(f"{_n(x)},{_n(y)}" for x, y in s["points"])
        dash = f' stroke-dasharray="{" ".join(_n(d) for d in s["dash"])}"' if s["dash"] else ""
        op = f' stroke-opacity="{s["opacity"]:.3g}"' if s["opacity"] < 1 else ""
        body = (f'<polyline points="{pts}" fill="none" stroke="{s["stroke"]}" '
                f'stroke-width="{_n(s["sw"])}" stroke-linejoin="round"{dash}{op}{a}')
    elif kind == "polygon":
        pts = " ".join(f"{_n(x)},{_n(y)}" for x, y in s["points"])
        op = f' fill-opacity="{s["opacity"]:.3g}"' if s["opacity"] < 1 else ""
        body = f'<polygon points="{pts}" fill="{s["fill"]}"{op}{a}'
    elif kind == "circle":
        body = (f'<circle cx="{_n(s["cx"])}" cy="{_n(s["cy"])}" r="{_n(s["r"])}" '
                f'fill="{s["fill"]}"{a}')
    else:
        anchor = {"start": "start", "middle": "middle", "end": "end"}[s["anchor"]]
        weight = ' font-weight="bold"' if s["bold"] else ""
        rot = (f' transform="rotate({_n(s["rotate"])} {_n(s["x"])} {_n(s["y"])})"'
               if s["rotate"] else "")
        return (f'<text x="{_n(s["x"])}" y="{_n(s["y"])}" font-size="{_n(s["size"])}" '
                f'text-anchor="{anchor}" fill="{s["color"]}"{weight}{rot}{a}>{t}'
                f'{html.escape(s["s"], quote=False)}</text>')
    return f"{body}>{t}</{kind}>" if t else f"{body}/>"


# -- PNG through libcairo -------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _cairo():
    name = ctypes.util.find_library("cairo") or "libcairo.so.2"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    P, D, I, C = ctypes.c_void_p, ctypes.c_double, ctypes.c_int, ctypes.c_char_p
    sig = {
        "cairo_image_surface_create": (P, [I, I, I]),
        "cairo_create": (P, [P]),
        "cairo_surface_status": (I, [P]),
        "cairo_surface_write_to_png": (I, [P, C]),
        "cairo_destroy": (None, [P]),
        "cairo_surface_destroy": (None, [P]),
        "cairo_scale": (None, [P, D, D]),
        "cairo_translate": (None, [P, D, D]),
        "cairo_rotate": (None, [P, D]),
        "cairo_save": (None, [P]),
        "cairo_restore": (None, [P]),
        "cairo_set_source_rgba": (None, [P, D, D, D, D]),
        "cairo_rectangle": (None, [P, D, D, D, D]),
        "cairo_arc": (None, [P, D, D, D, D, D]),
        "cairo_move_to": (None, [P, D, D]),
        "cairo_line_to": (None, [P, D, D]),
        "cairo_close_path": (None, [P]),
        "cairo_new_path": (None, [P]),
        "cairo_fill": (None, [P]),
        "cairo_fill_preserve": (None, [P]),
        "cairo_stroke": (None, [P]),
        "cairo_set_line_width": (None, [P, D]),
        "cairo_set_line_join": (None, [P, I]),
        "cairo_set_dash": (None, [P, ctypes.POINTER(D), I, D]),
        "cairo_select_font_face": (None, [P, C, I, I]),
        "cairo_set_font_size": (None, [P, D]),
        "cairo_show_text": (None, [P, C]),
        "cairo_text_extents": (None, [P, C, ctypes.POINTER(D * 6)]),
    }
    try:
        for fn, (res, args) in sig.items():
            f = getattr(lib, fn)
            f.restype, f.argtypes = res, args
    except AttributeError:
        return None
    return lib


def png_available() -> bool:
    """Whether ``.png`` output works here (libcairo found)."""
    return _cairo() is not None


def _rgb(color: str) -> tuple[float, float, float]:
    c = color.lstrip("#")
    if len(c) == 3:
        c = "".join(ch * 2 for ch in c)
    return tuple(int(c[i:i + 2], 16) / 255 for i in (0, 2, 4))


class _CairoPainter:
    def __init__(self, canvas: Canvas, scale: float):
        self.canvas, self.scale = canvas, scale

    def write(self, path: str) -> None:
        lib = _cairo()
        if lib is None:
            raise VizError("PNG output needs libcairo (it comes with Graphviz: "
                           "apt-get install graphviz); write .svg or .html instead")
        c, k = self.canvas, self.scale
        surf = lib.cairo_image_surface_create(0, int(math.ceil(c.width * k)),
                                              int(math.ceil(c.height * k)))  # 0 = ARGB32
        if lib.cairo_surface_status(surf) != 0:
            raise VizError(f"cairo could not make a {c.width}x{c.height} image")
        cr = lib.cairo_create(surf)
        try:
            lib.cairo_scale(cr, k, k)
            lib.cairo_set_line_join(cr, 1)  # round
            self._fill(lib, cr, c.background)
            lib.cairo_rectangle(cr, 0, 0, c.width, c.height)
            lib.cairo_fill(cr)
            for kind, s in c.shapes:
                getattr(self, "_" + kind)(lib, cr, s)
            if lib.cairo_surface_write_to_png(surf, os.fsencode(path)) != 0:
                raise VizError(f"cairo could not write {path!r}")
        finally:
            lib.cairo_destroy(cr)
            lib.cairo_surface_destroy(surf)

    @staticmethod
    def _fill(lib, cr, color, opacity=1.0):
        lib.cairo_set_source_rgba(cr, *_rgb(color), opacity)

    def _rect(self, lib, cr, s):
        lib.cairo_new_path(cr)
        lib.cairo_rectangle(cr, s["x"], s["y"], s["w"], s["h"])
        self._fill(lib, cr, s["fill"], s["opacity"])
        if s["stroke"]:
            lib.cairo_fill_preserve(cr)
            self._fill(lib, cr, s["stroke"])
            lib.cairo_set_line_width(cr, s["sw"])
            lib.cairo_stroke(cr)
        else:
            lib.cairo_fill(cr)

    @staticmethod
    def _trace(lib, cr, pts) -> None:
        """A new cairo path through ``pts``."""
        lib.cairo_new_path(cr)
        lib.cairo_move_to(cr, *pts[0])
        for p in pts[1:]:
            lib.cairo_line_to(cr, *p)

    def _polyline(self, lib, cr, s):
        pts = s["points"]
        if len(pts) < 2:
            return
        self._trace(lib, cr, pts)
        self._fill(lib, cr, s["stroke"], s["opacity"])
        lib.cairo_set_line_width(cr, s["sw"])
        dash = s["dash"] or ()
        arr = (ctypes.c_double * max(1, len(dash)))(*dash)
        lib.cairo_set_dash(cr, arr, len(dash), 0.0)
        lib.cairo_stroke(cr)
        lib.cairo_set_dash(cr, arr, 0, 0.0)

    def _polygon(self, lib, cr, s):
        pts = s["points"]
        if len(pts) < 3:
            return
        self._trace(lib, cr, pts)
        lib.cairo_close_path(cr)
        self._fill(lib, cr, s["fill"], s["opacity"])
        lib.cairo_fill(cr)

    def _circle(self, lib, cr, s):
        lib.cairo_new_path(cr)
        lib.cairo_arc(cr, s["cx"], s["cy"], s["r"], 0.0, 2 * math.pi)
        self._fill(lib, cr, s["fill"])
        lib.cairo_fill(cr)

    def _text(self, lib, cr, s):
        data = s["s"].encode("utf-8")
        lib.cairo_select_font_face(cr, FONT.encode(), 0, 1 if s["bold"] else 0)
        lib.cairo_set_font_size(cr, s["size"])
        ext = (ctypes.c_double * 6)()
        lib.cairo_text_extents(cr, data, ctypes.byref(ext))
        advance = ext[4]
        dx = {"start": 0.0, "middle": -advance / 2, "end": -advance}[s["anchor"]]
        lib.cairo_save(cr)
        lib.cairo_translate(cr, s["x"], s["y"])
        if s["rotate"]:
            lib.cairo_rotate(cr, math.radians(s["rotate"]))
        self._fill(lib, cr, s["color"])
        lib.cairo_new_path(cr)
        lib.cairo_move_to(cr, dx, 0.0)
        lib.cairo_show_text(cr, data)
        lib.cairo_restore(cr)
