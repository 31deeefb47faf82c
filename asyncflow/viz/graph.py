"""The dataflow graph of a plan as Graphviz dot / Mermaid text, and rendered (svg, png).

Drawing conventions: tasks are grouped by pool (one cluster each, labelled with its devices and
its processes -- placement rule 6; tasks listed in time-sharing order), pool-less tasks run on
CPU workers and sit outside the clusters, data sources are cylinders; a data edge is labelled
with its fields and streaming granularity (and its staleness when > 0); a weight-sync back edge
is dashed and labelled with the model and ``max_staleness``. Only rendering (:func:`render`)
needs the ``graphviz`` package and the ``dot`` program; :func:`to_dot` is plain text.
"""
from __future__ import annotations

from pathlib import Path

KIND_COLOR = {  # fill colours by task kind (colour-blind-safe pastels)
    "rollout": "#cfe2f3", "train": "#f4cccc", "logprob": "#d9ead3", "value": "#d9ead3",
    "reward": "#fff2cc", "advantage": "#ead1dc", "filter": "#fce5cd", "custom": "#eeeeee",
}
GRAN_STYLE = {"sample": "solid", "micro_batch": "solid", "group": "bold", "step": "bold"}
GRAN_SHORT = {"sample": "per sample", "micro_batch": "micro-batch", "group": "per group",
              "step": "per step"}


def _q(s: str) -> str:
    s = str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return '"' + s + '"'


def _id(name: str) -> str:
    return _q("n_" + name)


def _label(plan, t) -> str:
    what = t.engine or (t.fn.split(":")[-1] if t.fn else "") or t.estimator or ""
    extra = f"{t.kind}" + (f" · {what}" if what else "")
    if t.loss:
        extra += f" · {t.loss}"
    reps = f"×{t.replicas}" if t.replicas > 1 else ""
    return f"{t.name}{reps}\n{extra}"


def to_dot(plan) -> str:
    lines = [f"digraph {_q(plan.pipeline)} {{",
             "  graph [rankdir=LR, fontname=Helvetica, fontsize=12, nodesep=0.35, ranksep=0.7, "
             f"labelloc=t, label={_q(_title(plan))}];",
             "  node [fontname=Helvetica, fontsize=11, shape=box, style=\"rounded,filled\", "
             "color=\"#555555\", margin=\"0.15,0.06\"];",
             "  edge [fontname=Helvetica, fontsize=9, color=\"#444444\", arrowsize=0.7];"]
    tasks = {t.name: t for t in plan.tasks}
    for d in plan.data:
        lines.append(f"  {_id(d.name)} [shape=cylinder, fillcolor=\"#f3f3f3\", "
                     f"label={_q(d.name + chr(10) + ', '.join(d.fields))}];")
    placed = set()
    for p in plan.pools:
        kind = "GPU" if plan.device_kind == "GPU" else "CPU slot"
        lines.append(f"  subgraph {_q('cluster_' + p.name)} {{")
        nproc = len({w.process or w.id for w in plan.workers if w.pool == p.name})
        procs = f" · {nproc} process" + ("es" if nproc != 1 else "")
        lines.append(f"    label={_q(f'pool {p.name} · {p.devices} {kind}' + ('s' if p.devices > 1 else '') + procs)};"
                     " style=\"rounded,dashed\"; color=\"#888888\"; fontsize=11;")
        for i, n in enumerate(p.tasks):
            t = tasks[n]
            share = f"\n(time-share {i + 1}/{len(p.tasks)})" if len(p.tasks) > 1 else ""
            lines.append(f"    {_id(n)} [fillcolor={_q(KIND_COLOR.get(t.kind, '#eeeeee'))}, "
                         f"label={_q(_label(plan, t) + share)}];")
            placed.add(n)
        lines.append("  }")
    for t in plan.tasks:
        if t.name not in placed:
            lines.append(f"  {_id(t.name)} [fillcolor={_q(KIND_COLOR.get(t.kind, '#eeeeee'))}, "
                         f"label={_q(_label(plan, t))}];")
    sources = {d.name for d in plan.data}
    ev = plan.eval
    if ev is not None and ev.data in sources and ev.rollout in tasks:  # the held-out source
        when = f"every {ev.every} steps" if ev.every else "at the start and the end"
        lab = f"eval/{ev.name} ({ev.fn.split(':')[-1]})\n{when}, held out"
        lines.append(f"  {_id(ev.data)} -> {_id(ev.rollout)} [style=dotted, color=\"#aaaaaa\", "
                     f"fontcolor=\"#777777\", label={_q(lab)}];")
    for ch in plan.channels:
        lab = ", ".join(ch.fields) + "\n" + GRAN_SHORT.get(ch.granularity, ch.granularity)
        if ch.staleness:
            lab += f" · lag≤{ch.staleness}"
        attrs = [f"label={_q(lab)}", f"style={GRAN_STYLE.get(ch.granularity, 'solid')}"]
        if ch.src in sources:
            attrs += ["color=\"#aaaaaa\"", "fontcolor=\"#777777\""]
        lines.append(f"  {_id(ch.src)} -> {_id(ch.dst)} [{', '.join(attrs)}];")
    for s in plan.sync:
        lab = f"weights {s.model}\nmax_staleness={s.max_staleness} ({s.mode})"
        lines.append(f"  {_id(s.src)} -> {_id(s.dst)} [style=dashed, color=\"#cc0000\", "
                     f"fontcolor=\"#cc0000\", constraint=false, label={_q(lab)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _title(plan) -> str:
    st = plan.step
    t = (f"{plan.pipeline}: {st.prompts_per_step} prompts × {st.samples_per_prompt} samples "
         f"= {st.samples_per_step} per step, {st.steps} steps")
    e = plan.estimate
    if e is not None and e.step_time > 0:
        t += f"\nestimate: {e.step_time:.3g} s/step vs {e.step_time_sync:.3g} s synchronous ({e.speedup:.2f}x)"
    return t


def to_mermaid(plan) -> str:
    def mid(n: str) -> str:
        return "n_" + n

    lines = ["flowchart LR"]
    for d in plan.data:
        lines.append(f"  {mid(d.name)}[({d.name})]")
    placed = set()
    for p in plan.pools:
        lines.append(f"  subgraph pool_{p.name}[\"pool {p.name} ({p.devices} {plan.device_kind})\"]")
        for n in p.tasks:
            t = plan.task(n)
            lines.append(f"    {mid(n)}[\"{n}<br/>{t.kind}\"]")
            placed.add(n)
        lines.append("  end")
    for t in plan.tasks:
        if t.name not in placed:
            lines.append(f"  {mid(t.name)}[\"{t.name}<br/>{t.kind}\"]")
    for ch in plan.channels:
        lines.append(f"  {mid(ch.src)} -->|\"{', '.join(ch.fields)} ({ch.granularity})\"| {mid(ch.dst)}")
    for s in plan.sync:
        lines.append(f"  {mid(s.src)} -.->|\"weights, max_staleness={s.max_staleness}\"| {mid(s.dst)}")
    return "\n".join(lines) + "\n"


def render(plan, out: str | Path) -> Path:
    """Render the graph to ``out`` (.svg, .png or .pdf) with Graphviz's ``dot``."""
    out = Path(out)
    fmt = out.suffix.lstrip(".").lower()
    if fmt not in ("svg", "png", "pdf"):
        raise ValueError(f"cannot render to '{out.suffix}': use .svg, .png or .pdf")
    out.write_bytes(pipe(plan, fmt))
    return out


def pipe(plan, fmt: str = "svg") -> bytes:
    """The rendered bytes (needs the graphviz package and the dot program)."""
    try:
        import graphviz
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("drawing needs the graphviz package: pip install 'asyncflow[viz]'") from exc
    extra = {"png": ["-Gdpi=110"]}.get(fmt, [])
    src = graphviz.Source(to_dot(plan))
    try:
        return graphviz.pipe("dot", fmt, src.source.encode(), quiet=True) if not extra else \
            _pipe_args(fmt, src.source, extra)
    except graphviz.ExecutableNotFound as exc:  # pragma: no cover
        raise RuntimeError("drawing needs Graphviz's `dot` program on PATH") from exc


def _pipe_args(fmt: str, source: str, extra: list[str]) -> bytes:
    import subprocess

    import graphviz

    exe = "dot"
    try:
        return subprocess.run([exe, f"-T{fmt}", *extra], input=source.encode(), check=True,
                              capture_output=True).stdout
    except FileNotFoundError as exc:
        raise graphviz.ExecutableNotFound([exe]) from exc
