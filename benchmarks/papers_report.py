"""The tables and PNGs of ``benchmarks/papers.py`` (ROLL Flash's and AsyncFlow's figures in
simulation; docs/papers.md): tables on stdout, PNGs drawn with
:func:`asyncflow.viz.chart.line_chart` into ``out_dir``."""
from __future__ import annotations

from pathlib import Path

# the papers' own figures, drawn beside ours
PAPER = {"rlvr": 2.24, "agentic": 2.72, "asyncflow_avg": 1.59, "asyncflow_max": 2.03}
ALPHA = 2  # ROLL Flash's asynchronous runs in figure 1
SIZE = {"width": 1000, "height": 560}
# --transfer: each method of syncing a 7B model over its usual link (asyncflow.simulate.links);
# "lora": the same model trained with a LoRA adapter (r 16, all-linear), synced through the store
TRANSFERS = {"store": ("store", "ethernet"), "collective": ("collective", "infiniband"),
             "lora": ("store", "ethernet", "lora")}


def fmt_row(cells: list, widths: list[int]) -> str:
    return "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))


def table(title: str, head: list[str], rows: list[list]) -> None:
    widths = [max(len(str(x)) for x in [h] + [r[i] for r in rows]) for i, h in enumerate(head)]
    print(f"\n{title}")
    print(fmt_row(head, widths))
    print(fmt_row(["-" * w for w in widths], widths))
    for r in rows:
        print(fmt_row(r, widths))


def f1(x: float) -> str:
    return f"{x:.1f}"


def f2(x: float) -> str:
    return f"{x:.2f}"


def transfer_figures(cfg: dict, bases: dict, af: dict, res: dict, plots: bool,
                     out_dir: Path) -> dict:
    """Figures 1a and 3 with a 7B model's sync by each method, beside the transfer-free runs."""
    methods = ["none", *TRANSFERS]

    def compare(x_name: str, xs: list, names: tuple[str, str], keys) -> tuple[list, list]:
        """Per x, per method: the baseline run, the asynchronous one and their ratio."""
        pts, rows = [], []
        for x in xs:
            pt, row = {x_name: x}, [x]
            for m in methods:
                base, asy = (res[k if m == "none" else f"{m}:{k}"]["samples_per_s"]
                             for k in keys(x))
                pt[m] = {names[0]: base, names[1]: asy, "speedup": asy / base}
                row += [f1(base), f1(asy), f2(asy / base)]
            pts.append(pt)
            rows.append(row)
        return pts, rows

    out: dict = {"roll": {}, "asyncflow": []}
    for wl in bases if cfg["sizes"] else ():
        out["roll"][wl], rows = compare(
            "K", cfg["sizes"], ("sync", "async"),
            lambda k: (f"{wl}/sync/{k}", f"{wl}/async{ALPHA}/{k}"))  # noqa: B023
        table(f"ROLL Flash, figure 1a ({wl}) with a 7B model's weight sync (bf16, 14 GB; store "
              "over 25 GbE, collective over NDR InfiniBand; lora: its r 16 adapter, 161 MB, "
              "through the store; none: the figure above), samples/s",
              ["K"] + [f"{m} {x}" for m in methods for x in ("sync", "async", "speedup")], rows)
    if af is not None and any(k.startswith("af/") for k in res):
        out["asyncflow"], rows = compare("D", cfg["cluster"], ("colocated", "async"),
                                         lambda d: (f"af/colocated/{d}", f"af/async/{d}"))
        table("AsyncFlow, throughput against cluster size D with a 7B model's weight sync "
              "(colocated sync baseline, full AsyncFlow, speedup), samples/s",
              ["D"] + [f"{m} {x}" for m in methods for x in ("coloc.", "async", "speedup")],
              rows)
    if plots:
        plot_transfer(cfg, out, out_dir)
    return out


def plot_roll(cfg: dict, bases: dict, out: dict, n: int, out_dir: Path) -> None:
    from asyncflow.viz.chart import line_chart

    colors = {"rlvr": "#0072B2", "agentic": "#D55E00"}
    if cfg["sizes"]:
        sizes, top = cfg["sizes"], 4.2  # the paper's bound above ``top`` leaves the chart
        series = [_headroom(sizes[0], 6.6)]
        for wl in bases:
            series.append({"label": f"{wl}: simulated", "xs": sizes, "color": colors[wl],
                           "ys": [p["speedup"] for p in out["speedup"][wl]]})
        for wl in bases:  # 1 + c K: drawn as far as it stays on the chart
            pts = [p for p in out["speedup"][wl] if p["paper_bound"] <= top]
            last = f" (off the chart past K={pts[-1]['K']})" if len(pts) < len(sizes) else ""
            series.append({"label": f"{wl}: ROLL Flash's bound{last}",
                           "xs": [p["K"] for p in pts], "ys": [p["paper_bound"] for p in pts],
                           "color": colors[wl], "dash": True, "points": False})
        for wl in bases:
            series.append({"label": f"{wl}: bound with the staleness gate (ours)", "xs": sizes,
                           "ys": [p["gate_bound"] for p in out["speedup"][wl]],
                           "color": _light(colors[wl]), "dash": True, "points": False})
        for wl, c in (("rlvr", "#444444"), ("agentic", "#999999")):
            series.append({"label": f"paper's largest {wl} speedup ({PAPER[wl]}x)",
                           "xs": [sizes[0], sizes[-1]], "ys": [PAPER[wl]] * 2, "color": c,
                           "dash": True, "points": False})
        line_chart(series, title=f"ROLL Flash, simulated: async (alpha {ALPHA}) over sync, "
                   "fixed batch",
                   subtitle=f"{n} samples a step, K devices either way (sync: trainer "
                   "colocated; async: K split to balance the work); the paper's bound: 1 + c K",
                   xlabel="devices K (log scale)", ylabel="speedup (x)", log_x=True,
                   **SIZE).save(out_dir / "papers_roll_flash_speedup.png")

        ymax = max(p["async"] for wl in bases for p in out["speedup"][wl])
        series = [_headroom(sizes[0], ymax * 1.45)]
        for wl in bases:
            pts = out["speedup"][wl]
            series.append({"label": f"{wl}: async (alpha {ALPHA})", "xs": sizes,
                           "ys": [p["async"] for p in pts], "color": colors[wl]})
            series.append({"label": f"{wl}: sync", "xs": sizes, "ys": [p["sync"] for p in pts],
                           "color": colors[wl], "dash": True})
        line_chart(series, title="ROLL Flash, simulated: throughput against devices",
                   subtitle=f"{n} samples a step; synchronous training stops scaling once the "
                   "longest sample of a step sets the step time",
                   xlabel="devices K (log scale)", ylabel="samples / s (virtual time)",
                   log_x=True, **SIZE).save(out_dir / "papers_roll_flash_throughput.png")

    if out["alpha"]:
        alphas = cfg["alphas"]
        idx = list(range(len(alphas)))
        palette = ["#0072B2", "#009E73", "#D55E00"]
        ymax = max(max(p["speedup"], p["gate_bound"]) for v in out["alpha"].values() for p in v)
        series = [_headroom(0, ymax * (1.2 + 0.13 * len(out["alpha"])))]
        for i, (key, pts) in enumerate(out["alpha"].items()):
            wl, k = key.split("/")
            c = palette[i % len(palette)]
            series.append({"label": f"{wl}, K={k}: simulated", "xs": idx,
                           "ys": [p["speedup"] for p in pts], "color": c})
            series.append({"label": f"{wl}, K={k}: bound with the staleness gate (ours)",
                           "xs": idx, "ys": [p["gate_bound"] for p in pts], "color": c,
                           "dash": True, "points": False})
        line_chart(series, title="ROLL Flash, simulated: the staleness sweep",
                   subtitle="speedup over the synchronous colocated run at the same K; alpha 0 "
                   "is the split layout without asynchrony (slower than colocated)",
                   xlabel="max staleness alpha (steps)", ylabel="speedup (x)",
                   x_labels=[str(a) for a in alphas],
                   **SIZE).save(out_dir / "papers_roll_flash_alpha.png")


def plot_asyncflow(cfg: dict, variants, out: list, n: int, out_dir: Path) -> None:
    from asyncflow.viz.chart import line_chart

    ds = cfg["cluster"]
    colors = ["#7F7F7F", "#0072B2", "#009E73", "#D55E00"]
    series = [_headroom(ds[0], max(o["async"] for o in out) * 1.35)]
    series += [{"label": label, "xs": ds, "ys": [o[v] for o in out], "color": c}
               for (v, label), c in zip(variants, colors)]
    line_chart(series, title="AsyncFlow, simulated: the ablation against cluster size",
               subtitle=f"GRPO with a reference model, {n} samples a step; gray: colocated "
               "baseline; blue, green, orange: task-separated, one feature added each",
               xlabel="devices D (log scale)", ylabel="samples / s (virtual time)",
               log_x=True, **SIZE).save(out_dir / "papers_asyncflow_scaling.png")
    series = [_headroom(ds[0], max(max(o["speedup"], o["speedup_vs_separated_sync"])
                                   for o in out) * 1.5),
              {"label": "full AsyncFlow over the colocated sync baseline (simulated)", "xs": ds,
               "ys": [o["speedup"] for o in out], "color": "#D55E00"},
              {"label": "over the task-separated sync run (simulated)", "xs": ds,
               "ys": [o["speedup_vs_separated_sync"] for o in out], "color": "#0072B2"},
              {"label": f"paper: {PAPER['asyncflow_avg']}x average", "xs": [ds[0], ds[-1]],
               "ys": [PAPER["asyncflow_avg"]] * 2, "color": "#999999", "dash": True,
               "points": False},
              {"label": f"paper: {PAPER['asyncflow_max']}x peak", "xs": [ds[0], ds[-1]],
               "ys": [PAPER["asyncflow_max"]] * 2, "color": "#444444", "dash": True,
               "points": False}]
    line_chart(series, title="AsyncFlow, simulated: speedup against cluster size",
               subtitle="full AsyncFlow (task-separated, streaming, staleness 1) over synchronous "
               "runs on the same number of devices", xlabel="devices D (log scale)",
               ylabel="speedup (x)", log_x=True,
               **SIZE).save(out_dir / "papers_asyncflow_speedup.png")


def plot_transfer(cfg: dict, out: dict, out_dir: Path) -> None:
    from asyncflow.viz.chart import line_chart

    colors = {"none": "#7F7F7F", "store": "#D55E00", "collective": "#0072B2",
              "lora": "#009E73"}
    label = {"none": "no transfer (as above)", "store": "store, 25 GbE",
             "collective": "collective, InfiniBand NDR",
             "lora": "LoRA r 16 (161 MB), store, 25 GbE"}
    if out["roll"]:
        sizes = cfg["sizes"]
        top = max(p[m]["speedup"] for pts in out["roll"].values() for p in pts for m in colors)
        series = [_headroom(sizes[0], top * 1.8)]  # (8 legend rows)
        for wl, pts in out["roll"].items():
            for m in colors:
                series.append({"label": f"{wl}: {label[m]}", "xs": sizes,
                               "ys": [p[m]["speedup"] for p in pts], "color": colors[m],
                               "dash": wl == "agentic"})
        line_chart(series, title=f"ROLL Flash, simulated: async (alpha {ALPHA}) over sync with "
                   "a 7B model's weight sync",
                   subtitle="14 GB a sync (bf16; LoRA: 161 MB, its lines over the no-transfer "
                   "ones), charged to both runs; solid: RLVR, dashed: agentic",
                   xlabel="devices K (log scale)",
                   ylabel="speedup (x)", log_x=True,
                   **SIZE).save(out_dir / "papers_roll_flash_speedup_7b.png")
        pts = out["roll"]["rlvr"]
        top = max(p[m]["async"] for p in pts for m in colors)
        series = [_headroom(sizes[0], top * 1.5)]
        for m in colors:
            series.append({"label": f"async: {label[m]}", "xs": sizes,
                           "ys": [p[m]["async"] for p in pts], "color": colors[m]})
            series.append({"label": f"sync: {label[m]}", "xs": sizes,
                           "ys": [p[m]["sync"] for p in pts], "color": colors[m], "dash": True})
        line_chart(series, title="ROLL Flash (RLVR), simulated: throughput with a 7B model's "
                   "weight sync", subtitle="14 GB a sync (bf16; LoRA: 161 MB); solid: async "
                   "(alpha 2), dashed: sync", xlabel="devices K (log scale)",
                   ylabel="samples / s (virtual time)", log_x=True,
                   **SIZE).save(out_dir / "papers_roll_flash_throughput_7b.png")
    if out["asyncflow"]:
        ds = [p["D"] for p in out["asyncflow"]]
        top = max(p[m]["speedup"] for p in out["asyncflow"] for m in colors)
        series = [_headroom(ds[0], top * 1.5)]
        for m in colors:
            series.append({"label": f"full AsyncFlow over colocated sync: {label[m]}", "xs": ds,
                           "ys": [p[m]["speedup"] for p in out["asyncflow"]],
                           "color": colors[m], "dash": m == "lora"})  # (on "none" if cheap)
        series.append({"label": f"paper: {PAPER['asyncflow_avg']}x average",
                       "xs": [ds[0], ds[-1]], "ys": [PAPER["asyncflow_avg"]] * 2,
                       "color": "#999999", "dash": True, "points": False})
        line_chart(series, title="AsyncFlow, simulated: speedup with a 7B model's weight sync",
                   subtitle="14 GB a sync (bf16; LoRA: 161 MB), charged to both runs",
                   xlabel="devices D (log scale)", ylabel="speedup (x)", log_x=True,
                   **SIZE).save(out_dir / "papers_asyncflow_speedup_7b.png")


def _headroom(x: float, y: float) -> dict:
    """An invisible one-point series: room above the lines for the legend (put it first: its
    legend row, blank, is the top one)."""
    return {"label": "", "xs": [x], "ys": [y], "color": "#ffffff", "points": False}


def _light(color: str) -> str:
    """``color`` mixed half with white."""
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return "#%02x%02x%02x" % ((r + 255) // 2, (g + 255) // 2, (b + 255) // 2)
