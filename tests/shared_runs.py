"""One run of a shipped pipeline, shared by every test that reads facts of it.

Several test files run the same shipped pipeline with the same command line (``asyncflow run
pipelines/<name> --backend B --steps 3 --quiet``) and only read different facts of the result:
test_trace_vs_plan.py holds each run's trace against its plan, test_multiturn.py reads the
agentic pipeline's metrics, test_export.py the Ray run's ``final/``, test_perf_instrumentation.py
the start-up phases of the sim run. :func:`shipped_run` runs each (pipeline, backend) once per
pytest session, through the CLI's entry point as the user would, and hands every caller the same
:class:`Run` (read it, never write into it). A failed run fails each test that asks for it,
with the run's output.
"""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from asyncflow.runtime.ray_connect import local_worker_priority

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3
# per pipeline stem: shorter sim latencies (the claims read do not depend on them)
SHRINK = {
    "sim_longtail": ["--set", "tasks.generate.args.latency.median=0.002",
                     "--set", "tasks.generate.args.latency.max=0.02",
                     "--set", "tasks.update.args.seconds_per_sample=0.0001"],
}


@dataclass(frozen=True)
class Run:
    """A finished ``asyncflow run``: its run directory and what the command printed."""
    out: str
    returncode: int
    stdout: str
    stderr: str

    def ok(self) -> "Run":
        """This run, after asserting it exited 0 (else the end of its output)."""
        assert self.returncode == 0, self.stdout[-3000:] + self.stderr[-3000:]
        return self


_RUNS: dict[tuple[str, str], Run] = {}


def shipped_run(tmp_path_factory, name: str, backend: str) -> Run:
    """``asyncflow run pipelines/<name> --backend <backend> --steps 3 --quiet`` (sim latencies
    shrunk), run once per session from the repository root into a directory of pytest's
    session-wide ``tmp_path_factory``; the same :class:`Run` after. The CLI's entry point runs
    in this process (a subprocess would import torch and the engines again), except for the
    pipelines of :data:`OWN_PROCESS`."""
    key = (name, backend)
    if key not in _RUNS:
        stem = os.path.splitext(name)[0]
        out = str(tmp_path_factory.mktemp(f"shared-{stem}-{backend}") / "run")
        args = ["run", os.path.join(ROOT, "pipelines", name), "--backend", backend, "--out", out,
                "--quiet", "--steps", str(STEPS), *SHRINK.get(stem, [])]
        if any(part in stem for part in OWN_PROCESS):
            p = subprocess.run([sys.executable, "-m", "asyncflow.cli", *args], capture_output=True,
                               text=True, timeout=900, cwd=ROOT)
            _RUNS[key] = Run(out, p.returncode, p.stdout, p.stderr)
        else:
            _RUNS[key] = _in_process(out, args)
    return _RUNS[key]


# a DeepSpeed trainer on the local backend makes this process a torch.distributed rank (and
# sets RANK, WORLD_SIZE, ...): later in-process engines would find it; its run keeps a process
OWN_PROCESS = ("_deepspeed", "_vllm")


def _in_process(out: str, args: list[str]) -> Run:
    """``asyncflow ARGS`` from the repository root in this process, what it printed kept."""
    r = in_process(args)
    return Run(out, r.returncode, r.stdout, r.stderr)


class CliTimeout(Exception):
    """An in-process ``asyncflow`` command ran past its time limit (see :func:`in_process`)."""


def in_process(args: list[str], cwd: str = ROOT, timeout: float | None = None) -> "CliResult":
    """``asyncflow ARGS`` run from ``cwd`` in this process, what it printed kept (stdout and
    stderr apart). With ``timeout`` (seconds; main thread only), a command still running then
    is interrupted by ``SIGALRM`` and :class:`CliTimeout` is raised with what it had printed: a
    hang fails the test that ran it instead of the session."""
    import signal
    import threading

    from asyncflow.cli import main

    stdout, stderr, here = io.StringIO(), io.StringIO(), os.getcwd()
    alarm = timeout is not None and threading.current_thread() is threading.main_thread()

    def _expired(signum, frame):
        raise CliTimeout(f"asyncflow {' '.join(args)} did not finish in {timeout} s")

    old = signal.signal(signal.SIGALRM, _expired) if alarm else None
    os.chdir(cwd)
    try:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, timeout)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                main(list(args))
                rc = 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except CliTimeout as e:
                raise CliTimeout(f"{e}\n--- stdout\n{stdout.getvalue()[-3000:]}\n"
                                 f"--- stderr\n{stderr.getvalue()[-5000:]}") from None
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        os.chdir(here)
    return CliResult(rc, stdout.getvalue(), stderr.getvalue())


@dataclass(frozen=True)
class CliResult:
    """What an in-process ``asyncflow`` command returned and printed (stdout, stderr apart)."""
    returncode: int
    stdout: str
    stderr: str


def cli_result(capsys, *args: str) -> CliResult:
    """``asyncflow ARGS`` in this process, its stdout and stderr apart (a subprocess would
    import asyncflow, typer, rich and the engines again: seconds a call). Relative paths are
    read from the current directory (``monkeypatch.chdir`` where a test needs another)."""
    from asyncflow.cli import main

    capsys.readouterr()
    try:
        main(list(args))
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    got = capsys.readouterr()
    return CliResult(rc, got.out, got.err)


def cli(capsys, *args: str) -> tuple[int, str]:
    """``asyncflow ARGS`` in this process (torch, transformers and peft are imported already,
    a subprocess would import them again): (exit code, stdout + stderr)."""
    r = cli_result(capsys, *args)
    return r.returncode, r.stdout + r.stderr


@pytest.fixture(scope="module")
def ray_session():
    """Ray for a module (import it there), started only when a test asks for it (a "ray"
    param) and stopped at the module's end; a Ray already up is used and left up."""
    import ray

    started = not ray.is_initialized()
    if started:
        with local_worker_priority():  # the workers' niceness, as asyncflow's own
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()
