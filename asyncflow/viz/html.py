"""One self-contained HTML page for a plan: the graph's SVG inlined, then the plan's tables."""
from __future__ import annotations

import html as _html

CSS = """
body{font-family:Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:20px} h2{font-size:15px;margin-top:28px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3} .graph svg{max-width:100%;height:auto} .note{color:#777;font-size:12px}
"""


def _table(title: str, header: list[str], rows: list[list]) -> str:
    e = _html.escape
    out = [f"<h2>{e(title)}</h2><table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>"]
    for r in rows:
        out.append("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>")
    out.append("</table>")
    return "".join(out)


def _svg(plan) -> str:
    from asyncflow.viz.graph import pipe

    svg = pipe(plan, "svg").decode()
    i = svg.find("<svg")
    return svg[i:] if i >= 0 else svg


def plan_html(plan, svg: str | None = None) -> str:
    e = _html.escape
    svg = svg if svg is not None else _svg(plan)
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{e(plan.pipeline)}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>{e(plan.pipeline)} <span class='note'>{e(plan.source_file)}</span></h1>",
             f"<div class='graph'>{svg}</div>"]
    by_dst: dict[str, list] = {}
    for ch in plan.channels:
        by_dst.setdefault(ch.dst, []).append(ch)
    parts.append(_table("tasks", ["task", "kind", "engine / fn", "pool", "replicas", "inputs",
                                  "version lag", "run ahead"],
                        [[t.name, t.kind, t.engine or t.fn or t.estimator or "",
                          t.pool or "cpu", t.replicas,
                          "; ".join(f"{c.src}: {', '.join(c.fields)} [{c.granularity}]"
                                    for c in by_dst.get(t.name, [])),
                          t.version_lag, t.run_ahead] for t in plan.tasks]))
    parts.append(_table(f"pools ({plan.device_kind} devices)", ["pool", "devices", "bundle", "tasks"],
                        [[p.name, p.devices, p.bundles[0].resources if p.bundles else {},
                          " → ".join(p.tasks)] for p in plan.pools]))
    procs: dict[str, list[str]] = {}
    for w in plan.workers:  # placement rule 6: the workers that time-share a device share one
        procs.setdefault(w.process or w.id, []).append(w.id)
    parts.append(_table("processes (one Ray actor each)", ["process", "workers"],
                        [[proc, ", ".join(ws)] for proc, ws in procs.items()]))
    parts.append(_table("channels", ["channel", "fields", "granularity", "staleness", "capacity"],
                        [[c.id, ", ".join(c.fields), c.granularity, c.staleness, c.capacity]
                         for c in plan.channels]))
    parts.append(_table("weight sync", ["from", "to", "model", "max_staleness", "mode", "via"],
                        [[s.src, s.dst, s.model, s.max_staleness, s.mode,
                          s.via + (", delta" if s.delta else "")] for s in plan.sync]))
    st = plan.step
    parts.append(_table("batch", ["quantity", "value"],
                        [["prompts_per_step", st.prompts_per_step],
                         ["samples_per_prompt", st.samples_per_prompt],
                         ["samples_per_step", st.samples_per_step], ["steps", st.steps]]))
    parts.append(_table("concurrency (tasks that run at once)", ["group", "tasks"],
                        [[i, ", ".join(g)] for i, g in enumerate(plan.concurrency)]))
    est = plan.estimate
    if est is not None:
        parts.append(_table("estimate", ["quantity", "value"], [
            ["step time (this plan), s", est.step_time], ["step time (synchronous), s", est.step_time_sync],
            ["speedup", est.speedup], ["ideal (busiest pool), s", est.ideal_step_time],
            ["samples/s", est.samples_per_s], ["samples/s (synchronous)", est.samples_per_s_sync],
            ["bound by", est.bottleneck]]))
        for n in est.notes:
            parts.append(f"<p class='note'>{e(n)}</p>")
    parts.append("</body></html>\n")
    return "".join(parts)
