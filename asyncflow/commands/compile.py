"""``asyncflow compile FILE``: the execution plan, as tables (or --json / --dot / --mermaid / --html)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import List, Optional

import typer

from asyncflow.console import SetOpt, err, out, usage_error


def _fmt_s(x: float) -> str:
    if x == 0:
        return "0"
    if x < 1e-3:
        return f"{x * 1e6:.1f} us"
    if x < 1:
        return f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s"


def processes_table(plan, most: int = 12):
    """Which workers share a process (one Ray actor each on the ray backend; placement rule 6:
    the workers that time-share a device). At most ``most`` rows; the rest are counted."""
    from rich.table import Table

    by: dict[str, list[str]] = {}
    for w in plan.workers:
        by.setdefault(w.process or w.id, []).append(w.id)
    t = Table(title=f"processes ({len(by)} for {len(plan.workers)} workers; one Ray actor each)",
              title_justify="left")
    for col in ("process", "workers"):
        t.add_column(col, overflow="fold")
    for i, (proc, ws) in enumerate(by.items()):
        if i == most:
            t.add_row(f"... {len(by) - most} more", "")
            break
        t.add_row(proc, ", ".join(ws))
    return t


def models_table(plan):
    """Where each model comes from, as the compiler resolved it (the plan's ``models``)."""
    from rich.table import Table

    t = Table(title="models", title_justify="left")
    for col in ("model", "from", "source", "dtype", "trained by"):
        t.add_column(col, overflow="fold")
    for m in plan.models:
        kind = getattr(m, "source_kind", "") or "?"
        src = getattr(m, "source", "") or (m.init or "")
        if kind == "hub":
            src += f" ({getattr(m, 'path', '') or 'not cached: downloaded at start-up'})"
        if m.copy_of:
            kind = f"copy of {m.copy_of}: {kind}"
        by = m.updated_by or ("frozen" if m.frozen else "")
        ad = getattr(m, "lora", None)
        if ad and by:  # asyncflow.lora: what trains is the adapter
            mods = ad["target_modules"] if isinstance(ad["target_modules"], str) else \
                ",".join(ad["target_modules"])
            by += f" (LoRA r={ad['r']} alpha={ad['alpha']:g} on {mods})"
        t.add_row(m.name, kind, src, getattr(m, "dtype", "float32"), by)
    return t


def eval_table(plan):
    """The plan's ``eval:`` as resolved (:class:`asyncflow.plan.EvalPlan`), or None."""
    from rich.table import Table

    ev = plan.eval
    if ev is None:
        return None
    t = Table(title="evaluation (eval:)", title_justify="left", show_header=False)
    t.add_column("key")
    t.add_column("value", overflow="fold")
    vs = ev.versions
    shown = ", ".join(map(str, vs)) if len(vs) <= 12 else \
        f"{', '.join(map(str, vs[:6]))}, ..., {', '.join(map(str, vs[-2:]))} ({len(vs)} in all)"
    whose = f" (the function of task {ev.metric_task})" if ev.metric_task else ""
    sampling = "greedy" if ev.greedy else f"temperature {ev.temperature:g}"
    rows = [("held-out data", ev.data + (f" (first {ev.max_prompts} rows)" if ev.max_prompts else "")),
            ("versions", shown), ("runs on", f"{ev.worker} (rollout {ev.rollout}), between requests"),
            ("metric", f"eval/{ev.name} = mean of {ev.fn}({', '.join(ev.inputs)}){whose}"),
            ("sampling", f"{sampling}, {ev.samples_per_prompt} per prompt")]
    for k, v in rows:
        t.add_row(k, v)
    return t


def plan_tables(plan):
    """The plan as rich tables (the compile command prints them; viz HTML reuses the data)."""
    from rich.table import Table

    by_dst: dict[str, list] = {}
    for ch in plan.channels:
        by_dst.setdefault(ch.dst, []).append(ch)
    tasks = Table(title="tasks", title_justify="left")
    for col in ("task", "kind", "engine/fn", "pool", "replicas", "inputs from (granularity)",
                "lag", "ahead"):
        tasks.add_column(col, overflow="fold")
    for t in plan.tasks:
        ins = "\n".join(f"{ch.src} ({ch.granularity})" for ch in by_dst.get(t.name, []))
        what = t.engine or (t.fn.split(":")[-1] if t.fn else "") or t.estimator or ""
        if t.loss:
            what += f" ({t.loss})"
        pool = t.pool or "cpu"
        if t.pool:
            pool += f" #{t.time_share}"
        tasks.add_row(t.name, t.kind, what, pool, f"{t.replicas}x{t.devices_per_replica}"
                      if t.pool else str(t.replicas), ins, str(t.version_lag), str(t.run_ahead))

    binds = bindings_table(plan)

    pools = Table(title=f"pools ({plan.device_kind} devices)", title_justify="left")
    for col in ("pool", "devices", "bundle", "tasks (time-sharing order)"):
        pools.add_column(col)
    for p in plan.pools:
        b = p.bundles[0].resources if p.bundles else {}
        pools.add_row(p.name, str(p.devices), ", ".join(f"{k}: {v}" for k, v in b.items()),
                      " -> ".join(p.tasks))
    procs = processes_table(plan)

    chans = Table(title="channels", title_justify="left")
    for col in ("channel", "fields", "granularity", "staleness", "capacity (rows)"):
        chans.add_column(col)
    for ch in plan.channels:
        chans.add_row(ch.id, ", ".join(ch.fields), ch.granularity
                      + (f" ({ch.unit_rows})" if ch.granularity != "sample" else ""),
                      str(ch.staleness), str(ch.capacity))

    sync = Table(title="weight sync", title_justify="left")
    for col in ("from", "to", "model", "max_staleness", "mode", "via"):
        sync.add_column(col)
    for s in plan.sync:
        via = s.via if s.via == "store" else (
            f"collective, {s.bucket_bytes / 2**20:g} MB buckets" + (", delta" if s.delta else ""))
        sync.add_row(s.src, s.dst, s.model, str(s.max_staleness), s.mode, via)

    sched = scheduling_table(plan)

    st = plan.step
    batch = Table(title="batch", title_justify="left")
    batch.add_column("quantity")
    batch.add_column("value", justify="right")
    batch.add_row("prompts_per_step", str(st.prompts_per_step))
    batch.add_row("samples_per_prompt", str(st.samples_per_prompt))
    batch.add_row("samples_per_step", str(st.samples_per_step))
    batch.add_row("steps", str(st.steps))
    if st.launch_groups:
        extra = st.launch_groups - st.prompts_per_step
        spare = ("trained by later steps or dropped when too stale (first_ready)"
                 if any(t.consume == "first_ready" for t in plan.tasks) else "cancelled when not needed")
        batch.add_row("groups launched per step" + (f" ({extra} extra, {spare})"
                                                    if extra > 0 else ""), str(st.launch_groups))
    if st.replace:
        batch.add_row("dropped groups replaced by new prompts", ", ".join(st.replace))
    from asyncflow.compiler.kinds import rules_of

    for t in plan.tasks:
        for label, value in rules_of(t.kind).batch_rows(t, st):
            batch.add_row(label, value)
    out = [models_table(plan), tasks, binds, sched, pools, procs, chans, sync, batch]
    if plan.eval is not None:
        out.append(eval_table(plan))
    e = plan.estimate
    if e is not None:
        how = "simulated" if e.notes and e.notes[0].startswith("simulated") else "closed form"
        est = Table(title=f"estimate (steady state, {how})", title_justify="left")
        est.add_column("quantity")
        est.add_column("value", justify="right")
        est.add_row("step time, this plan", _fmt_s(e.step_time))
        est.add_row("step time, synchronous", _fmt_s(e.step_time_sync))
        est.add_row("speedup", f"{e.speedup:.2f}x")
        est.add_row("ideal (busiest pool)", _fmt_s(e.ideal_step_time))
        est.add_row("samples/s, this plan", f"{e.samples_per_s:.1f}")
        est.add_row("samples/s, synchronous", f"{e.samples_per_s_sync:.1f}")
        if e.bottleneck:
            est.add_row("bound by", e.bottleneck)
        out.append(est)
    return out


def scheduling_text(task, plan) -> tuple[str, str]:
    """A task's scheduling keys, short (``queue, redundancy 1.25, on_update finish``), and what
    they mean, in words; ("", "") for a kind that takes none (its kind's rules say)."""
    from asyncflow.compiler.kinds import rules_of

    return rules_of(task.kind).scheduling_text(task, plan)


def scheduling_table(plan):
    """One row per task that has scheduling keys (rollout, train, filter)."""
    from rich.table import Table

    t = Table(title="scheduling", title_justify="left")
    for col in ("task", "kind", "scheduling", "what it means"):
        t.add_column(col, overflow="fold")
    for task in plan.tasks:
        short, words = scheduling_text(task, plan)
        if short:
            t.add_row(task.name, task.kind, short, words)
    return t


def bindings_table(plan):
    """Every task's fields and what they mean to it: ``field -> role`` for its inputs (by role,
    or the user function's parameter it fills) and its outputs (the role it writes), with types."""
    from rich.table import Table

    from asyncflow.kinds import describe_type

    def kind_of(field: str) -> str:
        info = plan.fields.get(field)
        return describe_type(info["type"]) if info else "?"

    t = Table(title="bindings (field -> role; names are yours, roles are what tasks read)",
              title_justify="left")
    for col in ("task", "reads", "writes"):
        t.add_column(col, overflow="fold")
    for task in plan.tasks:
        fn = bool(task.fn)
        reads = [f"{f} -> {'param ' if fn else ''}{r} ({kind_of(f)})" for f, r in task.bind_in]
        writes = [f"{f} -> {r} ({kind_of(f)})" for f, r in task.bind_out]
        t.add_row(task.name, "\n".join(reads), "\n".join(writes) or "-")
    return t


def register(app: typer.Typer) -> None:
    @app.command("compile")
    def compile_(file: str = typer.Argument(..., help="pipeline file (.yaml, .yml, .af)"),
                 set_: Optional[List[str]] = SetOpt,
                 json_: bool = typer.Option(False, "--json", help="print the plan as JSON"),
                 dot: bool = typer.Option(False, "--dot", help="print the graph as Graphviz dot"),
                 mermaid: bool = typer.Option(False, "--mermaid", help="print the graph as Mermaid"),
                 html: bool = typer.Option(False, "--html", help="write one self-contained HTML page"),
                 output: Optional[str] = typer.Option(None, "-o", "--output", help="write to this file"),
                 dump_after: Optional[str] = typer.Option(
                     None, "--dump-after", metavar="PASS",
                     help="print the graph after this pass (parse, build IR, validate, staleness, "
                          "placement, overlap, lower, cost) and stop"),
                 device_kind: str = typer.Option("auto", "--device-kind",
                                                 help="what a pool device is: gpu, cpu or auto"),
                 backend: str = typer.Option("ray", "--backend",
                                             help="the backend the plan is for (ray or local): "
                                                  "a sync edge's default via depends on it"),
                 closed_form: bool = typer.Option(
                     False, "--closed-form", help="estimate with the cost pass's closed form "
                     "only (by default the estimate is simulated: asyncflow simulate)")) -> None:
        """Compile a pipeline; print the plan (tasks, bindings, scheduling, pools, channels, sync,
        batch, estimate)."""
        from asyncflow.compiler import Context, compile_file
        from asyncflow.compiler.pipeline import PASS_NAMES
        from asyncflow.compiler.runner import DEVICE_KINDS

        if device_kind.lower() not in DEVICE_KINDS:
            usage_error(f"--device-kind must be one of {', '.join(DEVICE_KINDS)}")
        if backend not in ("ray", "local"):
            usage_error("--backend must be ray or local")
        if dump_after is not None:  # `build_ir` and `build-ir` name the pass `build IR`
            dump_after = {n.lower().replace(" ", "_"): n for n in PASS_NAMES}.get(
                dump_after.lower().replace("-", "_").replace(" ", "_"), dump_after)
        if dump_after is not None and dump_after not in PASS_NAMES:
            usage_error(f"--dump-after must be one of {', '.join(PASS_NAMES)}")
        if sum((json_, dot, mermaid, html, dump_after is not None)) > 1:
            usage_error("give at most one of --json, --dot, --mermaid, --html, --dump-after")
        ctx = Context()
        try:
            result = compile_file(file, set_ or (), device_kind=device_kind.lower(),
                                  backend=backend, dump_after=dump_after, ctx=ctx)
        finally:
            for d in ctx.diags.items:
                if d.severity != "error":
                    err.print(d.render(), markup=False)

        def emit(text: str) -> None:
            if output:
                Path(output).write_text(text)
                out.print(f"wrote {output}", markup=False)
            else:
                out.print(text, markup=False, end="")

        if dump_after is not None:
            return emit(result)
        plan = result
        if not closed_form and plan.estimate is not None:  # the estimate, simulated
            from asyncflow.simulate.estimate import simulated

            est = simulated(plan, file, set_ or ())
            if est is not None:
                plan = dataclasses.replace(plan, estimate=est)
        if json_:
            return emit(plan.to_json())
        if dot or mermaid:
            from asyncflow.viz.graph import to_dot, to_mermaid

            return emit(to_dot(plan) if dot else to_mermaid(plan))
        if html:
            from asyncflow.viz.html import plan_html

            target = output or str(Path(file).with_suffix(".html").name)
            Path(target).write_text(plan_html(plan))
            out.print(f"wrote {target}", markup=False)
            return
        if output:
            from rich.console import Console

            with open(output, "w") as f:
                c = Console(file=f, width=140, highlight=False)
                for t in plan_tables(plan):
                    c.print(t)
            out.print(f"wrote {output}", markup=False)
            return
        out.print(f"{plan.pipeline} ({plan.source_file}): {len(plan.tasks)} tasks, "
                  f"{len(plan.workers)} workers, {len(plan.channels)} channels", markup=False)
        for t in plan_tables(plan):
            out.print(t)
        if plan.estimate and plan.estimate.notes:
            for n in plan.estimate.notes:
                out.print(f"note: {n}", style="dim", markup=False)
