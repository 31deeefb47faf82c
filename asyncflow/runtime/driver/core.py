"""The driver itself: :class:`Driver` runs one plan on a backend (the steps are in
:mod:`asyncflow.runtime.driver`), :class:`RunResult` is what it returns."""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from asyncflow.compiler.kinds import rules_of
from asyncflow import refs
from asyncflow.plan import Plan
from asyncflow.runtime.backends import make_backend
from asyncflow.runtime.control import ControlLost
from asyncflow.runtime.data import load_prompts
from asyncflow.runtime.driver.feeding import Feeder
from asyncflow.runtime.driver.metrics import StepBook
from asyncflow.runtime.driver.records import RunRecords, resume_point, write_plan
from asyncflow.runtime.driver.supervise import Restart, Supervisor
from asyncflow.runtime.faults import (RunError, fault, lost, parse_inject, worker_error,
                                      worker_options)
from asyncflow.runtime.options import RunOptions
from asyncflow.runtime.samples import DEFAULT_EVERY
from asyncflow.runtime.store import StoreLost
from asyncflow.runtime.trace import write_trace

log = logging.getLogger(__name__)

# worker loop settings (seconds): control-plane sync period, back-off after an empty READ, how
# long a batch READ waits in the store. Ray calls cost more, so Ray polls less often.
# The heartbeat only carries spans, counters and the stop flag (a gated rollout waits on the
# weight board itself), so on Ray it is slow: at 0.02 s the five workers' heartbeats and the
# driver's 0.01 s loop kept the control actor and the driver busy enough to slow the tiny main
# job's steps by ~10% on 2 cores.
LOCAL_DEFAULTS = {"sync_s": 0.005, "backoff_s": 0.002, "read_timeout_s": 0.02}
# A batch READ on Ray waits in the store up to 0.5 s for its rows (a read that comes back empty
# is a call wasted; the stop wakes a waiting read: SampleStore.stop_waits).
RAY_DEFAULTS = {"sync_s": 0.1, "backoff_s": 0.01, "read_timeout_s": 0.5}
DRIVER_POLL_S = {"local": 0.01, "ray": 0.05}
# on Ray the driver's turn waits in the control actor for news (a step report, a drop, an
# error) up to this long instead of sleeping poll_s between collects: a turn a step, not three,
# and each as the step ends (a set poll_s keeps the plain polling loop)
DRIVER_WAIT_S = {"ray": 0.25}


@dataclass
class RunResult:
    metrics: list[dict]
    out_dir: str | None
    wall_s: float
    samples: int
    interrupted: bool = False
    stats: dict = field(default_factory=dict)  # the store's stats at the end
    consumed: dict[str, list[int]] = field(default_factory=dict)  # task -> rows, in order
    workers: dict[str, dict] = field(default_factory=dict)  # worker -> its summary
    spans: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> rows
    events: list[dict] = field(default_factory=list)  # kills, deaths, restarts (Driver.events)
    # seconds per start-up phase, in order (Driver.startup): until every worker is ready
    startup: dict[str, float] = field(default_factory=dict)
    evals: list[dict] = field(default_factory=list)  # eval: rows (runtime/evaluate.py)
    # model -> {"dir", "dtype"} (or {"skipped": why}): RUN_DIR/final/<model> (runtime/export.py)
    exports: dict[str, dict] = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0


class Driver:
    """Runs one plan (:mod:`asyncflow.runtime.driver`). ``kill(worker_id)`` crashes a worker
    (tests)."""

    def __init__(self, plan: Plan, backend: str | None = None, out_dir: str | None = None, *,
                 run: RunOptions | None = None, options: dict | None = None,
                 on_step: Callable[[dict], Any] | None = None, **knobs):
        """``run``: the run's options; ``knobs``: fields of :class:`RunOptions` given one by
        one (over ``run``'s; ``backend`` over both). ``options``: extra worker options (loop
        settings, ``log_samples``); the workers get them with the run's."""
        if backend is not None:
            knobs["backend"] = backend
        if "inject" in knobs:
            knobs["inject"] = tuple(knobs["inject"] or ())
        self.run_options = ro = dataclasses.replace(run or RunOptions(), **knobs)
        backend, steps = ro.backend, ro.steps
        plan = copy.deepcopy(plan)
        if steps is not None:  # --steps: one plan transformation (eval versions follow)
            plan = plan.with_steps(steps)
        self.plan = plan
        self.evals: list[dict] = []  # eval: rows (runtime/evaluate.py), in arrival order
        self.out_dir = out_dir
        defaults = RAY_DEFAULTS if backend == "ray" else LOCAL_DEFAULTS
        self.options = {**defaults, **(options or {})}
        # where `module:name` references are imported from, by the driver and every worker
        # (absolute: Ray workers need not share our cwd), as `check` looks them up
        self.options.setdefault("search_path", refs.search_path(plan.source_file or None))
        self.on_step = on_step
        self.poll_s = DRIVER_POLL_S.get(backend, 0.01) if ro.poll_s is None else ro.poll_s
        self.wait_s = DRIVER_WAIT_S.get(backend, 0.0) if ro.poll_s is None else 0.0
        self.backend = None
        self.started = False
        self.startup: dict[str, float] = {}  # start-up phase -> seconds (RunResult.startup)
        self.process_start: float | None = None  # set by the CLI: asyncflow.STARTED
        # the --log loggers (asyncflow.runtime.loggers.Loggers), started and finished by the
        # CLI; every metrics row and logged sample goes to them (set by the CLI, or None)
        self.loggers = None
        self._kill_requests: list[str] = []
        # checkpoints (asyncflow.runtime.checkpoint): every K train steps into out_dir; resume
        # continues out_dir from its newest complete checkpoint
        self.checkpoint_every = int(ro.checkpoint_every or 0) or None
        self.resume = bool(ro.resume)
        if (self.checkpoint_every or self.resume) and not out_dir:
            raise RunError("checkpoints and --resume need a run directory (out_dir)")
        # --keep-checkpoints K: only the newest K complete checkpoints stay (checkpoint.prune)
        self.keep_checkpoints = int(ro.keep_checkpoints) if ro.keep_checkpoints else None
        self.exports: dict[str, dict] = {}  # model -> its final export (RunResult.exports)
        # faults: a dead worker is restarted up to max_restarts times (None: never, and the run
        # goes on while another replica of its task lives); the watchdog ends a run that makes
        # no progress for stall_timeout s; inject: parsed --inject specs (parse_inject)
        self.max_restarts = ro.max_restarts
        self.stall_timeout = float(ro.stall_timeout)
        self.inject = [f if isinstance(f, dict) else parse_inject(f, plan, backend)
                       for f in ro.inject]
        self.options.setdefault("lease_s", ro.lease_s)
        # every call to an actor of the run is bounded by this (ASYNCFLOW_CALL_TIMEOUT_S)
        self.options.setdefault("call_timeout_s", ro.call_timeout_s)
        # samples.jsonl every K train steps, the first and the last (runtime/samples.py; 0: off)
        self.options.setdefault("log_samples", DEFAULT_EVERY)
        self.options.setdefault("heartbeat_s", 0.5 if backend == "local" else 1.0)
        self.options.setdefault("stack_after_s", max(0.5, min(5.0, self.stall_timeout / 3)))
        self.restarts: dict[str, int] = {}
        self.events: list[dict] = []  # kills, deaths, restarts: {"t", "event", "worker", ...}
        self._fired: set[int] = set()

    # -- public --------------------------------------------------------------------------------
    def kill(self, worker_id: str) -> None:
        """Crash ``worker_id`` (no ack of what it holds); safe to call from another thread."""
        self._kill_requests.append(worker_id)

    def run(self) -> RunResult:
        """Run the plan; a train worker that dies with checkpoints on restarts the run from the
        newest checkpoint here, in this call (the other workers are stopped and started again)."""
        while True:
            try:
                return self._run_once()
            except Restart as r:
                n = self.restarts.get(r.worker, 0)
                if self.max_restarts is not None and n >= self.max_restarts:
                    task = r.worker.partition("/")[0]
                    raise fault("AF631", worker=r.worker, task=task, times=n + 1,
                                max_restarts=self.max_restarts, cause=r.cause) from None
                self.restarts[r.worker] = n + 1
                self.resume = True
                self.options.pop("start_step", None)
                self.options.pop("resume_dir", None)
                self.events.append({"t": r.time, "event": "trainer_restart", "worker": r.worker,
                                    "cause": r.cause})


    def _run_once(self) -> RunResult:
        """One start of the run (a train worker's death starts it again: :meth:`run`)."""
        plan = self.plan
        prompts = self._prompts()
        resumed = self._resume()
        start = resumed["version"] if resumed else 0
        write_plan(self.out_dir, plan)
        phase = self._phases()
        self._start_backend(phase, resumed)
        trainers = [t.name for t in plan.tasks if rules_of(t.kind).trains]
        self.t0 = time.time()
        book = StepBook(plan, trainers, start, self._primary(trainers), self.t0, self.exports)
        records = RunRecords(self.out_dir, resumed, loggers=self.loggers,
                             log_samples=bool(self.options["log_samples"]),
                             keep_checkpoints=self.keep_checkpoints)
        feeder = Feeder(plan, prompts, resumed["first_row"] if resumed else 0, start)
        sup = self._supervisor()
        interrupted, restart = False, None
        try:
            self._start_workers(sup, phase, start)
            book.last["t"] = self.ready = time.time()  # step 0's clock starts when rows can flow
            feeder.first(self.store, start)
            self._loop(sup, book, records, feeder)
        except KeyboardInterrupt:
            interrupted = True
            raise
        except Restart as r:
            restart = r
            raise
        finally:
            self._finish(sup, book, records, interrupted, restart)
        return self.result

    # -- the steps of a run --------------------------------------------------------------------
    def _supervisor(self) -> Supervisor:
        sup = Supervisor(self.plan, self.backend, self.store, self.control, options=self.options,
                         events=self.events, restarts=self.restarts,
                         max_restarts=self.max_restarts, stall_timeout=self.stall_timeout,
                         checkpoint_every=self.checkpoint_every, out_dir=self.out_dir,
                         poll_s=self.poll_s)
        sup.started = self.started
        self.supervisor = sup
        return sup

    def _loop(self, sup: Supervisor, book: StepBook, records: RunRecords, feeder: Feeder) -> None:
        """Turns until the run is over; a lost store is AF632."""
        self._last_expire = time.time()
        while True:
            try:
                turn = self._turn(sup, book, records, feeder)
            except StoreLost as e:
                raise lost("sample store", e) from None
            if turn == "done":
                return
            if turn == "next":
                sup.watchdog()
                if not self.wait_s:  # else the next turn's collect waits for news
                    time.sleep(self.poll_s)

    def _prompts(self) -> list[dict]:
        """The training prompts; the first row's text and chat values go to every engine, which
        encodes its prompt once at start-up, so a chat its tokenizer cannot render (AF651) or
        characters it cannot encode (AF655) stop the run before step 0."""
        prompts = load_prompts(self.plan, self.options["search_path"])
        self.options["chat_sample"] = {f: v for f, v in prompts[0].items()
                                       if isinstance(v, (str, list, dict))} if prompts else {}
        return prompts

    def _resume(self) -> dict | None:
        """The checkpoint to go on from (``resume``), and the workers' options that follow from
        it and from the run directory."""
        resumed = resume_point(self.out_dir, self.plan, self.resume)
        if self.events and self.events[-1]["event"] == "trainer_restart":
            self.events[-1]["from_step"] = resumed["version"] if resumed else 0
        if resumed and resumed["version"]:
            self.options.update(start_step=resumed["version"], start_row=resumed["first_row"],
                                resume_dir=os.path.abspath(resumed["dir"]))
        if self.checkpoint_every:
            self.options.update(checkpoint_every=self.checkpoint_every)
        if self.out_dir:  # checkpoints, final exports; absolute: Ray workers need not share our cwd
            self.options.update(run_dir=os.path.abspath(self.out_dir))
        return resumed

    def _start_backend(self, phase, resumed: dict | None) -> None:
        """The backend, the store (every task registered) and the control plane."""
        self.backend = be = make_backend(self.run_options)
        phase("backend")  # Ray up (ray.init), or nothing for local threads
        self.store = store = be.make_store(self.plan)
        if resumed and resumed["version"]:  # rows before the trainer's next window were trained
            store.start_rows_at(resumed["first_row"])
        for t in self.plan.tasks:
            store.register_task(t.name, list(t.inputs))
        self._worker_ctl, self.control = be.make_control()
        phase("store and control")

    def _start_workers(self, sup: Supervisor, phase, start: int) -> None:
        """One worker per WorkerPlan, a pool's colocated workers in its time-sharing order;
        until every one is ready."""
        plan, be = self.plan, self.backend
        share = {t.name: t.time_share for t in plan.tasks}
        order = sorted(plan.workers, key=lambda w: share.get(w.task, 0))  # stable: by plan
        ids = [w.id for w in order]
        be.start(plan.to_dict(), ids, self.store, self._worker_ctl, self.t0,
                 worker_options(self.options, self.inject, [w.id for w in plan.workers],
                                self.resume))
        self.started = sup.started = True
        phase("workers placed")  # placement groups, one actor or thread per worker
        sup.wait_ready(self._kill_requests)
        phase("workers ready")  # every engine built (models, imports) and synced once
        if self.events and self.events[-1]["event"] == "trainer_restart":
            self.events.append({"t": time.time(), "event": "resumed",
                                "worker": self.events[-1]["worker"], "from_step": start})
        sup.write_workers()

    def _turn(self, sup: Supervisor, book: StepBook, records: RunRecords, feeder: Feeder) -> str:
        """One turn of the run loop: "done" (the run is over), "again" (a train worker's death
        is deferred: collect once more at once) or "next" (watchdog, then sleep)."""
        store = self.store
        sup.kill_requested(self._kill_requests)
        sup.inject_kills(self.inject, self._fired, book.version() if book.done else 0, self.t0)
        try:
            c = self.control.collect(wait_s=self.wait_s)
        except Exception as e:
            raise lost("control actor", e) from None
        book.take(c)
        self._take_events(c, records)
        if c["errors"]:
            wid, msg, tb = c["errors"][0]
            raise worker_error(wid, msg, tb)
        if c["reports"]:
            sup.watch["t"] = time.time()
        book.take_reports(c["reports"])
        for s, reps in book.complete_steps():  # a step's metrics once every trainer reported it
            row = book.row(s, reps, c, store, self.t0, feeder.refilled)
            records.step(s, row, reps, book.primary, book.trainers)
            feeder.step_done(book.drops)
            records.checkpoint(s, reps, book.primary, self.plan, feeder.fed, store)
            if self.on_step:
                self.on_step(row)
        feeder.top_up(store, book.version(), book.drops)
        # a death already seen is handled (restart, checkpoint) even on the last step: a run
        # never ends as if a killed worker had not died. A train worker's death restarts the
        # run one turn later, once the reports it sent before dying are in (they close the
        # checkpoints it saved)
        if sup.deferred is not None:
            raise sup.deferred
        sup.supervise(defer=True)
        if sup.deferred is not None:
            return "again"
        if book.finished() and self._eval_finished(sup):
            return "done"
        if not book.trainers and feeder.all_fed() and feeder.all_consumed(store):
            return "done"
        if time.time() - self._last_expire > 0.25:
            store.expire()
            self._last_expire = time.time()
        return "next"

    def _finish(self, sup: Supervisor, book: StepBook, records: RunRecords, interrupted: bool,
                restart: Restart | None) -> None:
        """Stop the workers; the result (:attr:`result`), ``trace.json`` and ``workers.json``;
        the backend shut down (Ray kept up for a restart)."""
        be, ctl, store, plan = self.backend, self.control, self.store, self.plan
        wall = time.time() - self.t0
        try:
            ctl.stop()
        except ControlLost as e:
            log.warning("the workers were not told to stop (%s); they are stopped with the "
                        "backend", e)
        try:  # a worker waiting in a long read hears of the stop now, not at the read's end
            store.stop_waits()
        except Exception as e:  # noqa: BLE001 (a lost store: its readers are gone with it)
            log.info("the store's waiting reads were not woken (%s)", e)
        if self.started:
            be.join(timeout=float(self.options.get("join_s", 10.0)))
        try:
            c = ctl.collect()
            book.take(c)  # its spans, and the drops after the last step (counted as the store did)
            self._take_events(c, records)
        except ControlLost as e:
            log.warning("the workers' last spans and events are lost with the control actor "
                        "(%s)", e)
        workers = sup.workers_info() if self.started else {}
        metrics = records.metrics.rows
        result = RunResult(metrics, self.out_dir, wall, sum(r.get("samples", 0) for r in metrics),
                           interrupted, workers=workers, spans=len(book.spans),
                           dropped=book.drops)
        try:
            result.stats = store.stats()
            result.consumed = {t.name: store.consumed(t.name) for t in plan.tasks}
        except StoreLost as e:
            log.warning("the result has no store stats: the sample store is lost (%s)", e)
        result.evals = list(self.evals)
        records.close()
        result.events = list(self.events)
        result.startup = dict(self.startup)
        result.exports = {m: {k: v for k, v in e.items() if k != "model"}
                          for m, e in self.exports.items()}
        if self.out_dir:
            pools = {w.id: (w.pool or "cpu") for w in plan.workers}
            write_trace(os.path.join(self.out_dir, "trace.json"), book.spans, self.t0, pools,
                        {"startup_s": result.startup} if result.startup else None)
            if workers:  # where every worker ran, and how it ended
                sup.write_workers(workers)
        self.result = result
        be.shutdown(keep_ray=restart is not None)

    # -- internals -----------------------------------------------------------------------------
    def _take_events(self, c: dict, records: RunRecords) -> None:
        """Run events from the workers; an ``eval`` event's row (runtime/evaluate.py) is a line
        of metrics.jsonl of its own and one of :attr:`evals`, not a run event."""
        for ev in c.get("events", ()):
            if ev.get("event") == "eval":
                self.evals.append(ev["row"])
                records.metrics.append_eval(ev["row"])
            else:
                self.events.append(ev)

    def _eval_finished(self, sup: Supervisor) -> bool:
        """eval: the run ends once the final version is evaluated (evaluate.py, rule 3), or
        when the evaluating worker is gone (nothing would evaluate it)."""
        ev = self.plan.eval
        if ev is None or any(r.get("eval/version", -1) >= self.plan.step.steps for r in self.evals):
            return True
        return not sup.alive(ev.worker)

    def _primary(self, trainers: list[str]) -> str | None:
        """The train task whose version the rollouts follow, as the plan says (lower rule 9)."""
        return next((w.primary for w in self.plan.workers if w.task in trainers), None)

    def _phases(self):
        """A recorder of start-up phases into ``self.startup``: ``phase(name)`` charges the time
        since the previous phase to ``name``; with ``process_start`` (the CLI's: when asyncflow
        was first imported) the time before the driver -- imports, compile, the data -- comes
        first. A trainer restart in the same run does not record them again."""
        first = not self.startup
        last = [time.time()]
        if first and self.process_start is not None:
            self.startup["imports and compile"] = round(last[0] - self.process_start, 3)

        def phase(name: str) -> None:
            now = time.time()
            if first:
                self.startup[name] = round(now - last[0], 3)
            last[0] = now
        return phase


def run_plan(plan: Plan, backend: str = "local", **kw) -> RunResult:
    """Execute ``plan`` (see :class:`Driver` for the keyword arguments)."""
    return Driver(plan, backend, **kw).run()
