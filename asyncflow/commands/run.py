"""``asyncflow run FILE``: compile the pipeline and execute it.

Writes ``RUN_DIR`` (``--out``, default ``runs/<pipeline>-<time>``): ``plan.json``,
``metrics.jsonl`` (one line per train step) and ``trace.json`` (Chrome trace; open it in
Perfetto or draw it with ``asyncflow viz``). Shows a progress bar (step, samples/s, reward,
staleness) and a summary table. Ctrl-C stops the workers, keeps the partial trace and metrics,
and exits 130; a mistake in the file exits 2 with located diagnostics. ``--checkpoint-every K``
writes ``RUN_DIR/checkpoints/step_N`` every K steps; ``--resume RUN_DIR`` continues a killed run
from its newest complete checkpoint (:mod:`asyncflow.runtime.checkpoint`); ``--keep-checkpoints K``
keeps the newest K. After the last step every trained model is written to ``RUN_DIR/final/<model>``
(a Hugging Face directory; :mod:`asyncflow.runtime.export`) and the summary says where. The run directory's
rules (a lock; no run into a directory holding another without ``--resume`` or ``--force``; a
changed plan is not resumed without ``--force``) are :mod:`asyncflow.runtime.rundir`'s.
"""
from __future__ import annotations

import os
import time
from typing import List, Optional

import typer

from asyncflow.console import SetOpt, err, out, state


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _gpu_visible() -> bool:
    """Whether this machine has a GPU, without importing torch or starting Ray."""
    import glob
    import shutil

    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*")) or bool(shutil.which("nvidia-smi") and glob.glob("/proc/driver/nvidia/gpus/*"))


#: the environment variables asyncflow itself reads (README, "Environment variables"), each a
#: RunOptions field; read here and nowhere else
ENV_OPTIONS = {"ASYNCFLOW_CALL_TIMEOUT_S": "call_timeout_s", "ASYNCFLOW_PG_TIMEOUT_S": "pg_timeout_s",
               "ASYNCFLOW_RAY_FULL": "ray_full"}


def env_options(environ=None) -> dict:
    """The ``ASYNCFLOW_*`` variables set in ``environ`` (default: this process's) as
    :class:`~asyncflow.runtime.options.RunOptions` fields; a bad number is a bad parameter."""
    environ = os.environ if environ is None else environ
    out: dict = {}
    for var, name in ENV_OPTIONS.items():
        value = environ.get(var)
        if value is None or value == "":
            continue
        if name == "ray_full":
            out[name] = value == "1"
            continue
        try:
            out[name] = float(value)
        except ValueError:
            raise typer.BadParameter(f"{var}={value!r} is not a number of seconds") from None
        if out[name] <= 0:
            raise typer.BadParameter(f"{var}={value!r} must be more than 0 seconds")
    return out


def register(app: typer.Typer) -> None:
    @app.command()
    def run(ctx: typer.Context,
            file: str = typer.Argument(..., help="pipeline file (.yaml, .yml, .af)"),
            set_: Optional[List[str]] = SetOpt,
            backend: str = typer.Option("ray", "--backend",
                                        help="ray (default: local Ray, or --address) | local (threads)"),
            address: Optional[str] = typer.Option(None, "--address", help="Ray cluster to join"),
            out_dir: Optional[str] = typer.Option(None, "--out", help="run directory (default runs/<pipeline>-<time>)"),
            steps: Optional[int] = typer.Option(None, "--steps", min=1, help="train steps (overrides step.steps)"),
            lease_s: float = typer.Option(60.0, "--lease-s", help="seconds before an unacked lease is re-issued"),
            quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
            log: Optional[List[str]] = typer.Option(
                None, "--log", help="also log metrics and samples to wandb | mlflow (repeatable; "
                                    "TensorBoard, RUN_DIR/tensorboard, is always on)"),
            log_samples: int = typer.Option(
                10, "--log-samples", min=0,
                help="RUN_DIR/samples.jsonl: 4 samples (prompt, completion, reward, version) at "
                     "the first and last step and every K steps (0: off)"),
            checkpoint_every: Optional[int] = typer.Option(
                None, "--checkpoint-every", min=1,
                help="checkpoint every K train steps into RUN_DIR/checkpoints/step_N (default off)"),
            resume: Optional[str] = typer.Option(
                None, "--resume", help="continue RUN_DIR from its newest complete checkpoint"),
            keep_checkpoints: Optional[int] = typer.Option(
                None, "--keep-checkpoints", min=1,
                help="keep only the newest K complete checkpoints (default: all)"),
            force: bool = typer.Option(
                False, "--force", help="--out: remove what an earlier asyncflow run there wrote "
                                       "(nothing else) and run; --resume: run a changed plan "
                                       "from the checkpoint anyway"),
            device_kind: str = typer.Option(
                "auto", "--device-kind",
                help="what a pool device is: gpu | cpu (a CPU slot) | auto (GPU only where one is visible)"),
            store_shards: int = typer.Option(
                1, "--store-shards", min=1,
                help="ray: sample-store shard actors (more spread a big step's store work; one is "
                     "fastest on a small machine)"),
            max_restarts: int = typer.Option(
                3, "--max-restarts", min=0,
                help="restarts of a worker that dies (its process, out of memory) before the run "
                     "fails (AF631); a train worker restarts from the newest checkpoint"),
            stall_timeout: float = typer.Option(
                300.0, "--stall-timeout", min=0.1,
                help="seconds without a finished step or any worker's progress before the "
                     "watchdog ends the run (AF630), naming the worker, its op and its stack"),
            inject: Optional[List[str]] = typer.Option(
                None, "--inject",
                help="fault injection, repeatable: KIND@WHEN:TARGET. KIND: kill (the worker's "
                     "process; or an actor: control, store[/N], Ray only) | hang (stops making "
                     "progress) | nan (its outputs become NaN) | oom (MemoryError in its compute) "
                     "| raise | exit (its function raises / calls sys.exit). WHEN: stepN (when the "
                     "worker starts on train step N's rows) | Ns (seconds into the run). TARGET: task, task/REPLICA, control, "
                     "store/N. E.g. kill@step5:generate/0, hang@20s:score, nan@step3:score")) -> None:
        """Compile and run a pipeline; write RUN_DIR/{plan.json,metrics.jsonl,trace.json}.

        Faults: a worker that dies is restarted (--max-restarts) and loses no sample; a trainer
        that dies restarts from the newest checkpoint (--checkpoint-every) in the same command;
        a run without progress for --stall-timeout s ends with the stuck worker's stack (AF630).
        """
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.table import Table

        from asyncflow.compiler.pipeline import compile_file
        from asyncflow.runtime.driver import Driver, RunError
        from asyncflow.runtime.faults import parse_inject
        from asyncflow.runtime.options import RunOptions

        if backend not in ("ray", "local"):
            raise typer.BadParameter(f"--backend must be ray or local, not {backend!r}")
        if keep_checkpoints is not None and not checkpoint_every:
            raise typer.BadParameter("--keep-checkpoints needs --checkpoint-every K")
        env = env_options()  # ASYNCFLOW_*: checked before anything starts
        if device_kind not in ("auto", "gpu", "cpu"):
            raise typer.BadParameter(f"--device-kind must be auto, gpu or cpu, not {device_kind!r}")
        if device_kind == "auto" and address is None and not _gpu_visible():
            device_kind = "cpu"  # a GPU bundle could never be placed on this machine
        plan = compile_file(file, sets=tuple(set_ or ()), device_kind=device_kind,
                            backend=backend)  # UserError -> exit 2
        if steps is not None:  # --steps: one plan transformation, applied here once
            plan = plan.with_steps(steps)
        faults = [parse_inject(spec, plan, backend) for spec in (inject or [])]  # AF634: exit 2
        total = plan.step.steps
        run_dir = resume or out_dir or os.path.join("runs", f"{plan.pipeline}-{time.strftime('%Y%m%d-%H%M%S')}")
        from asyncflow.runtime import loggers

        # --log: checked before anything starts (AF670 not installed, AF671 unknown)
        logs = loggers.make(log, run_dir, os.path.basename(os.path.normpath(run_dir)),
                            warn=lambda m: err.print(m, style="yellow", markup=False))
        from asyncflow.runtime import rundir

        claim = rundir.claim(run_dir, plan, resume=resume is not None, force=force)  # AF62x
        try:  # the lock is released when this run ends, also inside a longer-lived process
            for note in claim.notes:
                err.print(note, style="yellow", markup=False)
            progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                TextColumn("{task.completed}/{task.total}"),
                                TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                console=err, disable=quiet, transient=False)
            bar = progress.add_task(f"{plan.pipeline}", total=total, info="starting workers")

            seen = {"samples": 0, "t0": None}

            def on_step(m: dict) -> None:
                # samples/s since the first step began, as the summary's "samples/s (steps
                # only)" counts them (one step's own rate swings: at alpha >= 1 a step whose rows
                # were made ahead of it ends in a blink)
                if seen["t0"] is None and m.get("time") is not None:
                    seen["t0"] = m["time"] - (m.get("step_time") or 0.0)
                seen["samples"] += m.get("samples") or 0
                span = m["time"] - seen["t0"] if seen["t0"] is not None else 0.0
                info = (f"{_fmt(seen['samples'] / span if span > 0 else None, '.1f')} samples/s  "
                        f"reward {_fmt(m.get('reward_mean'))}  "
                        f"staleness {_fmt(m.get('staleness_mean'), '.2f')}/{m.get('staleness_max')}")
                progress.update(bar, completed=m["step"] + 1, info=info)

            # steps: the plan already runs them (with_steps above), so not again here
            options = RunOptions(backend=backend, address=address, lease_s=lease_s,
                                 shards=store_shards, checkpoint_every=checkpoint_every,
                                 keep_checkpoints=keep_checkpoints, resume=resume is not None,
                                 max_restarts=max_restarts, stall_timeout=stall_timeout,
                                 inject=tuple(faults), **env)
            driver = Driver(plan, out_dir=run_dir, run=options, on_step=on_step)
            import asyncflow

            driver.process_start = asyncflow.STARTED
            driver.options["log_samples"] = log_samples  # samples.jsonl (runtime/samples.py)
            driver.loggers = logs
            logs.start(loggers.run_config(plan.to_dict(), backend=backend, run_dir=run_dir,
                                          steps=total))  # AF672: a logger that cannot start
            status = "failed"  # what the loggers are told at the end
            interrupted = False

            def on_term(signum, frame):  # `kill`, `timeout`, a scheduler: stop as cleanly as Ctrl-C
                raise KeyboardInterrupt

            import signal

            previous = signal.signal(signal.SIGTERM, on_term)
            try:
                with progress:
                    result = driver.run()
                status = "finished"
            except KeyboardInterrupt:
                interrupted, status = True, "interrupted"
                result = getattr(driver, "result", None)
            except RunError as e:
                err.print(f"run failed: {e}", style="red", markup=False)
                if state(ctx).debug and e.details:
                    err.print(e.details, markup=False)
                raise typer.Exit(1)
            finally:
                signal.signal(signal.SIGTERM, previous)
                logs.finish(status)
            if result is not None:
                _summary(out, result, run_dir, Table)
                _samples_and_logs(out, run_dir, logs)
            if interrupted:
                err.print(f"interrupted: workers stopped; partial trace and metrics in {run_dir}",
                          style="yellow", markup=False)
                raise typer.Exit(130)
        finally:
            claim.release()


def _eval_rows(evals: list[dict]) -> list[tuple[str, str]]:
    """eval: each eval/<metric> at its first and last evaluation, with the versions and the
    time the evaluations took (runtime/evaluate.py)."""
    if not evals:
        return []
    keys = [k for k in evals[0] if k.startswith("eval/") and not k.endswith("_std")
            and k not in ("eval/n", "eval/version", "eval/target", "eval/seconds")]
    first, last = evals[0], evals[-1]
    span = f"v{first['eval/version']} -> v{last['eval/version']}"
    out = [(f"{k} ({span})", f"{_fmt(first.get(k))} -> {_fmt(last.get(k))}") for k in keys]
    secs = sum(e.get("eval/seconds") or 0.0 for e in evals)
    out.append(("evaluations (n each, total s)", f"{len(evals)} ({first.get('eval/n')}, {secs:.2f})"))
    return out


def _summary(out, result, run_dir: str, Table) -> None:
    ms = result.metrics
    t = Table(title=f"run summary ({run_dir})", show_header=True)
    t.add_column("metric")
    t.add_column("value", justify="right")
    stl = [m["staleness_max"] for m in ms if m.get("staleness_max") is not None]
    sm = [m["staleness_mean"] for m in ms if m.get("staleness_mean") is not None]
    rw = [m["reward_mean"] for m in ms if m.get("reward_mean") is not None]
    bub = [m["bubble_fraction"] for m in ms if m.get("bubble_fraction") is not None]
    sync = sum(m.get("exposed_sync_s") or 0.0 for m in ms)
    busy = ms[-1]["time"] - (ms[0]["time"] - ms[0]["step_time"]) if ms else 0.0
    rows = [
        ("steps", str(len(ms))),
        ("samples", str(result.samples)),
        ("wall time (s)", f"{result.wall_s:.2f}"),
        ("samples/s (steps only)", _fmt(result.samples / busy if busy > 0 else None, ".1f")),
        ("reward (first -> last)", f"{_fmt(rw[0] if rw else None)} -> {_fmt(rw[-1] if rw else None)}"),
        *_eval_rows(getattr(result, "evals", None) or []),
        ("staleness mean / max", f"{_fmt(sum(sm) / len(sm) if sm else None, '.2f')} / {max(stl) if stl else '-'}"),
        ("dropped (staleness)", str(sum(v for k, v in result.dropped.items()
                                        if k not in ("filter", "redundant")))),
        ("filtered", str(result.dropped.get("filter", 0))),
        # the scheduling keys: redundancy's cancelled samples, refill's new groups, aborts
        ("cancelled (redundancy)", str(result.dropped.get("redundant", 0))),
        ("refilled groups", str(ms[-1].get("refilled", 0) if ms else 0)),
        ("aborted (new weights)", str(ms[-1].get("aborted", 0) if ms else 0)),
        ("bubble fraction (mean)", _fmt(sum(bub) / len(bub) if bub else None)),
        ("exposed sync (s)", f"{sync:.3f}"),
        ("leases re-issued", str(result.stats.get("leases_reissued", 0))),
        ("workers restarted", str(sum(1 for e in result.events if e["event"] in ("restart", "trainer_restart")))),
    ]
    if result.startup:  # until every worker is ready (RunResult.startup; phases below)
        rows.insert(3, ("start-up (s)", f"{sum(result.startup.values()):.2f}"))
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)
    if result.startup:
        out.print("start-up (s): " + " · ".join(f"{k} {v:.2f}" for k, v in result.startup.items()),
                  markup=False)
    _exports(out, result)


def _exports(out, result) -> None:
    """Where each trained model was written (RUN_DIR/final/<model>; runtime/export.py)."""
    for model, e in sorted(getattr(result, "exports", {}).items()):
        if e.get("dir"):
            out.print(f"trained model {model}: {e['dir']} ({e.get('dtype', 'float32')})",
                      markup=False, soft_wrap=True)
        else:
            out.print(f"trained model {model}: not exported: {e.get('skipped')}", markup=False,
                      soft_wrap=True)


def _samples_and_logs(out, run_dir: str, logs) -> None:
    """One sample of the last logged step (RUN_DIR/samples.jsonl) and where the --log loggers
    wrote."""
    from asyncflow.runtime import samples

    last = samples.last(run_dir)
    if last:
        s = last[0]
        prompt = s.get("prompt")
        prompt = prompt if isinstance(prompt, str) else str(prompt)
        out.print(f"sample (step {s.get('step')}, row {s.get('row')}, reward "
                  f"{_fmt(s.get('reward'))}, version {s.get('version')}; all in "
                  f"{os.path.join(run_dir, samples.FILE)}):", markup=False, soft_wrap=True)
        out.print(f"  prompt:     {_short(prompt)}", markup=False, soft_wrap=True)
        out.print(f"  completion: {_short(str(s.get('completion')))}", markup=False,
                  soft_wrap=True)
    for lg in logs.loggers:
        if getattr(lg, "where", ""):
            out.print(f"logged to {lg.name}: {lg.where}", markup=False, soft_wrap=True)
    for name, why in logs.failed.items():
        out.print(f"logger {name} was switched off during the run: {why}", markup=False,
                  soft_wrap=True)


def _short(text: str, n: int = 300) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= n else text[:n] + f"... ({len(text)} chars)"
