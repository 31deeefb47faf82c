"""The driver: executes an :class:`~asyncflow.plan.Plan` on a backend and records the run.

What it does, top to bottom (:meth:`Driver.run`):

1. load the prompts of the plan's data source;
2. make the store (one row per sample) and the control plane, register every task's inputs;
3. start one worker per :class:`~asyncflow.plan.WorkerPlan` (threads or Ray actors), a pool's
   colocated workers in its time-sharing order (``TaskPlan.time_share``: the first builds its
   engine on the shared devices first);
4. feed prompts: prompt ``k`` is replicated ``samples_per_prompt`` times (one ``_group``) and
   belongs to step ``k // prompts_per_step``, so step ``s`` owns rows
   ``[s * samples_per_step, (s + 1) * samples_per_step)``. The driver is the data sources'
   producer: it keeps each source channel as full as the plan's ``capacity`` says (rows of steps
   below ``trained + capacity / samples_per_step``; staleness rule 5: the step being trained,
   the steps the gate lets producers run ahead -- the plan's ``run_ahead`` -- and one in flight);
5. every few milliseconds collect the workers' reports; per finished train step write one line
   of ``metrics.jsonl`` and call ``on_step``;
6. when every train task has done its last step (or, without one, every row is consumed), stop
   the workers, write ``trace.json`` and return a :class:`RunResult`.

With ``checkpoint_every`` K, every K train steps go to ``RUN_DIR/checkpoints/step_N``;
``resume=True`` continues ``RUN_DIR`` from its newest complete one
(:mod:`asyncflow.runtime.checkpoint`; rows of later steps are regenerated); with
``keep_checkpoints`` K only the newest K complete ones stay. Every train step's rows go to
``RUN_DIR/train_rows.jsonl``. After its last step, and at each checkpoint, each trainer writes
its model to ``RUN_DIR/final/<model>`` (:mod:`asyncflow.runtime.export`) and reports it
(:attr:`RunResult.exports`).

A KeyboardInterrupt stops the workers the same way, writes the partial trace and metrics, and
propagates. ``RUN_DIR`` (``out_dir``) receives ``plan.json``, ``metrics.jsonl``, ``trace.json`` and
``workers.json`` (where each worker ran: task, pool, host, pid, Ray node, pinned cores; its end).
"""
from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from asyncflow import refs
from asyncflow.errors import AsyncflowError
from asyncflow.plan import Plan
from asyncflow.runtime.backends import make_backend
from asyncflow.runtime.store import StoreLost
from asyncflow.runtime.samples import DEFAULT_EVERY, SamplesLog
from asyncflow.runtime.trace import MetricsLog, mean_std, write_trace


# worker loop settings (seconds): control-plane sync period, back-off after an empty READ, how
# long a batch READ waits in the store. Ray calls cost more, so Ray polls less often.
# The heartbeat only carries spans, counters and the stop flag (a gated rollout waits on the
# weight board itself), so on Ray it is slow: at 0.02 s the five workers' heartbeats and the
# driver's 0.01 s loop kept the control actor and the driver busy enough to slow the tiny main
# job's steps by ~10% on 2 cores.
LOCAL_DEFAULTS = {"sync_s": 0.005, "backoff_s": 0.002, "read_timeout_s": 0.02}
RAY_DEFAULTS = {"sync_s": 0.1, "backoff_s": 0.01, "read_timeout_s": 0.1}
DRIVER_POLL_S = {"local": 0.01, "ray": 0.05}


class RunError(AsyncflowError):
    """A worker failed (its traceback is in ``details``) or the run could not start."""

    def __init__(self, message: str, details: str = "", code: str | None = None):
        super().__init__(message)
        self.details = details
        self.code = code


def fault(code: str, details: str = "", **fields) -> RunError:
    """A run-time fault (AF63x, :mod:`asyncflow.diagnostics.runtime`) as a :class:`RunError`
    whose message starts with its code."""
    from asyncflow.diagnostics import table

    return RunError(f"{code}: {table()[code].message.format(**fields)}", details, code)


#: AF635: a refilling filter may replace at most this many steps' launched groups in a row (a
#: random policy on pipelines/dapo.yaml needed more than 10 before its first step)
REFILL_ROUNDS = 100


class _Restart(Exception):
    """A train worker died and the run has checkpoints: restart it from the newest one."""

    def __init__(self, worker: str, cause: str, t: float):
        super().__init__(worker)
        self.worker, self.cause, self.time = worker, cause, t


#: the faults ``--inject`` knows: the driver does ``kill``; the worker the rest
INJECT_KINDS = ("kill", "hang", "nan", "oom", "raise", "exit")


def parse_inject(spec: str, plan: Plan, backend: str = "ray") -> dict:
    """``KIND@WHEN:TARGET`` -> ``{"kind", "at_step" | "at_s", "target", "spec"}``; a bad spec is
    AF634 naming the part. WHEN: ``stepN`` (when train step N starts; for a task's own faults:
    from the rows of step N on) or ``Ns`` (N seconds into the run). TARGET: a task (every
    replica; ``kill``: replica 0) or ``task/R``; ``kill`` also takes ``control`` and
    ``store[/N]`` (a shard; Ray only)."""
    import re

    from asyncflow.diagnostics import error

    def bad(part: str, why: str):
        return error("AF634", None, spec=spec, part=part, why=why)

    kind, at, rest = spec.partition("@")
    if not at:
        raise bad(repr(spec), "is not KIND@WHEN:TARGET (e.g. kill@step5:generate/0)")
    if kind not in INJECT_KINDS:
        raise bad(f"kind {kind!r}", f"is not one of {', '.join(INJECT_KINDS)}")
    when, colon, target = rest.partition(":")
    if not colon or not target:
        raise bad(repr(rest), "needs WHEN:TARGET (e.g. step5:generate/0 or 20s:score)")
    out: dict = {"kind": kind, "spec": spec, "at_step": None, "at_s": None}
    m_step, m_s = re.fullmatch(r"step(\d+)", when), re.fullmatch(r"(\d+(?:\.\d+)?)s", when)
    if m_step:
        out["at_step"] = int(m_step.group(1))
        if out["at_step"] >= plan.step.steps:
            raise bad(f"when {when!r}", f"is past the run's last step ({plan.step.steps - 1})")
    elif m_s:
        out["at_s"] = float(m_s.group(1))
    else:
        raise bad(f"when {when!r}", "is not stepN (a train step) or Ns (seconds into the run)")
    name, slash, rep = target.partition("/")
    if name in ("control", "store"):
        if kind != "kill":
            raise bad(f"target {target!r}", f"is an actor: only kill applies to it, not {kind}")
        if backend != "ray":
            raise bad(f"target {target!r}", "is a Ray actor: it exists on --backend ray only")
        if name == "control" and slash:
            raise bad(f"target {target!r}", "has no replicas")
        if name == "store" and slash and not rep.isdigit():
            raise bad(f"target {target!r}", "names a shard by its number (store/0)")
        out["target"] = target
        return out
    task = next((t for t in plan.tasks if t.name == name), None)
    if task is None:
        names = ", ".join([t.name for t in plan.tasks] + ["control", "store"])
        raise bad(f"target {target!r}", f"is not a task of the plan ({names})")
    if slash and (not rep.isdigit() or int(rep) >= task.replicas):
        raise bad(f"target {target!r}", f"task {name!r} has replicas 0..{task.replicas - 1}")
    if kind == "nan" and task.kind == "train":
        raise bad(f"target {target!r}", "is a train task: nan applies to a task's output columns")
    out["target"] = target if (slash or kind != "kill") else f"{name}/0"
    return out


def _by_worker(fault: dict) -> bool:
    """Whether the targeted worker applies ``fault`` itself, at the step it names: every kind
    but a ``kill`` timed in seconds or aimed at an actor. A worker kills itself when it starts
    on step N's rows, so the kill always strikes while the worker still has work (a driver's
    kill, sent when it has seen step N end, could arrive after a fast worker had finished)."""
    if fault["kind"] != "kill":
        return True
    return fault.get("at_step") is not None and not _is_actor(fault["target"])


def _is_actor(target: str) -> bool:
    """``control`` or ``store[/N]``: a Ray actor of the run, not a worker."""
    return target.partition("/")[0] in ("control", "store")


def _hits(fault: dict, wid: str) -> bool:
    t = fault["target"]
    return wid == t or ("/" not in t and wid.partition("/")[0] == t)


def worker_error(wid: str, msg, tb: str) -> AsyncflowError:
    """What the driver raises when a worker fails: a located AF6xx error when the worker found a
    user error (``msg`` is :meth:`~asyncflow.runtime.contract.TaskError.payload`), else
    :class:`RunError` with the worker's traceback."""
    if not isinstance(msg, dict):
        if str(msg).startswith(("StoreLost", "ControlLost")):  # an actor of the run is gone
            what = "sample store" if str(msg).startswith("StoreLost") else "control actor"
            return fault("AF632", tb, what=what, cause=f"{msg} (seen by worker {wid})")
        return RunError(f"worker {wid} failed: {msg}", tb)
    from asyncflow.diagnostics import error
    from asyncflow.loc import SourceLoc, Sources

    loc, sources = SourceLoc.parse(msg.get("loc")), Sources()
    if loc is not None:
        sources.add_file(loc.file)
    fields = {k: v for k, v in msg["fields"].items() if k != "tb"}
    e = error(msg["code"], loc, f"in worker {wid}", sources=sources, **fields)
    e.details = msg["fields"].get("tb") or tb
    return e


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


from asyncflow.runtime.data import load_prompts  # noqa: E402  (data reading lives there)


def feed_ahead(plan: Plan) -> int:
    """Steps fed beyond the last trained one: the most a data source's channel holds (its
    ``capacity``, staleness rule 5), in whole steps."""
    sources = {d.name for d in plan.data}
    sps = plan.step.samples_per_step
    caps = [c.capacity for c in plan.channels if c.src in sources]
    return max(1, -(-max(caps, default=sps) // sps))


def replaced_groups(st, drops: dict) -> int:
    """Groups dropped for a reason the plan replaces (``StepPlan.replace``: refill,
    first_ready's staleness), each replaced by a new prompt."""
    return sum(drops.get(r, 0) for r in st.replace) // st.samples_per_prompt


def feed_target(st, version: int, ahead: int, drops: dict, offset: int = 0) -> int:
    """The groups fed once every trainer has trained ``version`` steps: the launches of the
    steps the channels may hold, plus one new group per replaced group (``asyncflow simulate``
    feeds by this same rule)."""
    launch = st.launch_groups or st.prompts_per_step
    return min(st.steps, version + ahead) * launch + replaced_groups(st, drops) + offset


class Driver:
    """Runs one plan (module docstring). ``kill(worker_id)`` crashes a worker (tests)."""

    def __init__(self, plan: Plan, backend: str = "local", out_dir: str | None = None,
                 steps: int | None = None, address: str | None = None, lease_s: float = 60.0,
                 options: dict | None = None, on_step: Callable[[dict], Any] | None = None,
                 poll_s: float | None = None, shards: int = 1,
                 checkpoint_every: int | None = None,
                 resume: bool = False, max_restarts: int | None = None,
                 stall_timeout: float = 300.0, inject: list | None = None,
                 keep_checkpoints: int | None = None):
        plan = copy.deepcopy(plan)
        if steps is not None:  # --steps: one plan transformation (eval versions follow)
            plan = plan.with_steps(steps)
        self.plan = plan
        self.evals: list[dict] = []  # eval: rows (runtime/evaluate.py), in arrival order
        self.backend_name = backend
        self.backend_kw = {"lease_s": lease_s, "address": address, "shards": shards}
        self.out_dir = out_dir
        defaults = RAY_DEFAULTS if backend == "ray" else LOCAL_DEFAULTS
        self.options = {**defaults, **(options or {})}
        # where `module:name` references are imported from, by the driver and every worker
        # (absolute: Ray workers need not share our cwd), as `check` looks them up
        self.options.setdefault("search_path", refs.search_path(plan.source_file or None))
        self.on_step = on_step
        self.poll_s = DRIVER_POLL_S.get(backend, 0.01) if poll_s is None else poll_s
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
        self.checkpoint_every = int(checkpoint_every or 0) or None
        self.resume = bool(resume)
        if (self.checkpoint_every or self.resume) and not out_dir:
            raise RunError("checkpoints and --resume need a run directory (out_dir)")
        # --keep-checkpoints K: only the newest K complete checkpoints stay (checkpoint.prune)
        self.keep_checkpoints = int(keep_checkpoints) if keep_checkpoints else None
        self.exports: dict[str, dict] = {}  # model -> its final export (RunResult.exports)
        # faults: a dead worker is restarted up to max_restarts times (None: never, and the run
        # goes on while another replica of its task lives); the watchdog ends a run that makes
        # no progress for stall_timeout s; inject: parsed --inject specs (parse_inject)
        self.max_restarts = max_restarts
        self.stall_timeout = float(stall_timeout)
        self.inject = [f if isinstance(f, dict) else parse_inject(f, plan, backend)
                       for f in (inject or [])]
        self.options.setdefault("lease_s", lease_s)
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
            except _Restart as r:
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
        self._deferred: _Restart | None = None  # a train worker's death, raised next turn
        plan = self.plan
        st = plan.step
        prompts = load_prompts(plan, self.options["search_path"])
        # the first row's non-text values (chat messages): each engine encodes its prompt once
        # at start-up, so a chat its tokenizer cannot render stops the run before step 0 (AF651)
        self.options["chat_sample"] = {f: v for f, v in prompts[0].items()
                                       if isinstance(v, (list, dict))} if prompts else {}
        from asyncflow.runtime import checkpoint as ckpt

        resumed = ckpt.prepare_resume(self.out_dir, st.samples_per_step) if self.resume else None
        if self.events and self.events[-1]["event"] == "trainer_restart":
            self.events[-1]["from_step"] = resumed["version"] if resumed else 0
        start = resumed["version"] if resumed else 0
        first_row = resumed["first_row"] if resumed else 0
        if start:
            self.options.update(start_step=start, start_row=first_row,
                                resume_dir=os.path.abspath(resumed["dir"]))
        if self.checkpoint_every:
            self.options.update(checkpoint_every=self.checkpoint_every)
        if self.out_dir:  # checkpoints, final exports; absolute: Ray workers need not share our cwd
            self.options.update(run_dir=os.path.abspath(self.out_dir))
            os.makedirs(self.out_dir, exist_ok=True)
            with open(os.path.join(self.out_dir, "plan.json"), "w") as f:
                f.write(plan.to_json())
        phase = self._phases()
        self.backend = be = make_backend(self.backend_name, **self.backend_kw)
        phase("backend")  # Ray up (ray.init), or nothing for local threads
        store = be.make_store(plan)
        self.store = store
        if start:  # rows before the trainer's next window were trained before the checkpoint
            store.start_rows_at(first_row)
        for t in plan.tasks:
            store.register_task(t.name, list(t.inputs))
        worker_ctl, ctl = be.make_control()
        self.control = ctl
        phase("store and control")
        trainers = [t.name for t in plan.tasks if t.kind == "train"]
        primary = self._primary(trainers)
        ahead = self._ahead()
        t0 = time.time()
        self.t0 = t0
        metrics = MetricsLog(os.path.join(self.out_dir, "metrics.jsonl") if self.out_dir else None,
                             loggers=self.loggers)
        for row in (resumed["metrics"] if resumed else []):
            metrics.append(row)
        train_rows = ckpt.TrainRowsLog(self.out_dir, resumed["train_rows"] if resumed else None)
        # RUN_DIR/samples.jsonl: the rows the primary trainer's reports carry (runtime/samples.py)
        samples_log = SamplesLog(self.out_dir if self.options["log_samples"] else None,
                                 start if resumed else None)
        pools = {w.id: (w.pool or "cpu") for w in plan.workers}
        spans: list = []
        rewards: dict[int, float] = {}
        drops: dict[str, int] = {}
        done: dict[str, int] = {t: start for t in trainers}
        pending_reports: dict[int, dict] = {}  # step -> {task: report}
        # a data-parallel trainer's replicas each report their share of a step (lower rule 8):
        # (step, task) -> {replica: report}, merged into the task's report once all are in
        n_replicas = {t.name: t.replicas for t in plan.tasks if t.kind == "train"}
        shares: dict[tuple, dict] = {}
        launch = st.launch_groups or st.prompts_per_step  # groups launched per step
        spp = st.samples_per_prompt
        fed = first_row // spp  # groups fed so far
        filtered_at_step = 0  # rows filtered out when the last step's metrics came in
        # groups replaced before the checkpoint (a resumed run's windows start after them)
        offset = max(0, fed - start * launch)
        interrupted = False
        last = {"t": t0, "busy": {}, "exposed": {}, "drops": 0}
        self._beats: dict = {}
        self._status: dict[str, str] = {w.id: "starting" for w in plan.workers}
        restart = None
        try:
            share = {t.name: t.time_share for t in plan.tasks}
            order = sorted(plan.workers, key=lambda w: share.get(w.task, 0))  # stable: by plan
            be.start(plan.to_dict(), [w.id for w in order], store, worker_ctl, t0,
                     self._start_options())
            self.started = True
            phase("workers placed")  # placement groups, one actor or thread per worker
            self._wait_ready(ctl, be)
            phase("workers ready")  # every engine built (models, imports) and synced once
            if self.events and self.events[-1]["event"] == "trainer_restart":
                self.events.append({"t": time.time(), "event": "resumed",
                                    "worker": self.events[-1]["worker"], "from_step": start})
            self._status = {w: "running" for w in self._status}
            self._write_workers(be)
            last["t"] = self.ready = time.time()  # step 0's clock starts when rows can flow
            fed = self._feed(store, prompts, fed,
                             min(st.steps, start + ahead) * launch + offset)
            last_expire = time.time()
            watch = {"t": time.time(), "key": None, "beat_t": 0.0}
            while True:
                for wid in self._kill_requests[:]:
                    self._kill_requests.remove(wid)
                    self.events.append({"t": time.time(), "event": "kill", "worker": wid})
                    be.kill(wid)
                self._inject_kills(be, min(done.values()) if done else 0)
                try:
                    c = ctl.collect()
                except Exception as e:
                    raise self._lost("control actor", e) from None
                spans.extend(c["spans"])
                self._take_events(c, metrics)
                for rows, values in c["rewards"]:
                    rewards.update(zip(rows, values))
                for _, n, reason in c["drops"]:
                    drops[reason] = drops.get(reason, 0) + n
                if c["errors"]:
                    wid, msg, tb = c["errors"][0]
                    raise worker_error(wid, msg, tb)
                if c["reports"]:
                    watch["t"] = time.time()
                for task, rep in c["reports"]:
                    if n_replicas.get(task, 1) > 1:  # a data-parallel trainer: one per replica
                        got = shares.setdefault((rep["step"], task), {})
                        got[int(rep.get("replica", 0))] = rep
                        if len(got) < n_replicas[task]:
                            continue
                        rep = merged_shares(shares.pop((rep["step"], task)))
                    pending_reports.setdefault(rep["step"], {})[task] = rep
                    if rep.get("export"):  # the newest trained model, in RUN_DIR/final
                        self.exports[rep["export"]["model"]] = rep["export"]
                    done[task] = max(done.get(task, 0), rep["step"] + 1)
                # a step's metrics line once every trainer has reported it
                for s in sorted(pending_reports):
                    reps = pending_reports[s]
                    if not all(t in reps for t in trainers):
                        break
                    del pending_reports[s]
                    row = self._metrics(s, reps, primary, c, last, rewards, drops, store, pools, t0)
                    metrics.append(row)
                    metrics.text(s, samples_log.append(s, (reps.get(primary) or {}).get("samples")))
                    filtered_at_step = drops.get("filter", 0)
                    for task in trainers:
                        train_rows.append(s, task, reps[task]["rows"])
                    if any(r.get("checkpoint") for r in reps.values()):
                        ckpt.close(self.out_dir, s + 1, steps=st.steps, fed=-(-fed // launch),
                                   prompts_per_step=st.prompts_per_step,
                                   samples_per_step=st.samples_per_step, metrics=metrics.rows,
                                   train_rows=train_rows.rows, store=store,
                                   first_row=(reps.get(primary) or {}).get("next_row"))
                        if self.keep_checkpoints:
                            ckpt.prune(self.out_dir, self.keep_checkpoints)
                    if self.on_step:
                        self.on_step(row)
                version = min(done.values()) if done else st.steps
                try:
                    # groups launched up to the steps the channels may hold, plus one new group
                    # for every group dropped for a replaced reason (refill, first_ready)
                    self._refilled = replaced_groups(st, drops)
                    self._check_refill(drops.get("filter", 0) - filtered_at_step, launch)
                    fed = self._feed(store, prompts, fed,
                                     feed_target(st, version, ahead, drops, offset))
                    # a death already seen is handled (restart, checkpoint) even on the last
                    # step: a run never ends as if a killed worker had not died. A train
                    # worker's death restarts the run one turn later, once the reports it sent
                    # before dying are in (they close the checkpoints it saved)
                    if self._deferred is not None:
                        raise self._deferred
                    self._supervise(be, store, ctl, defer=True)
                    if self._deferred is not None:
                        continue
                    if trainers and all(done[t] >= st.steps for t in trainers) \
                            and self._eval_finished(st.steps):
                        break
                    if not trainers and fed >= st.steps * launch and self._all_consumed(store, fed):
                        break
                    if time.time() - last_expire > 0.25:
                        store.expire()
                        last_expire = time.time()
                except StoreLost as e:
                    raise self._lost("sample store", e) from None
                self._watchdog(be, ctl, watch)
                time.sleep(self.poll_s)
        except KeyboardInterrupt:
            interrupted = True
            raise
        except _Restart as r:
            restart = r
            raise
        finally:
            wall = time.time() - t0
            try:
                ctl.stop()
            except Exception:
                pass
            if self.started:
                be.join(timeout=float(self.options.get("join_s", 10.0)))
            try:
                c = ctl.collect()
                spans.extend(c["spans"])
                self._take_events(c, metrics)
            except Exception:
                pass
            workers = self._workers_info(be) if self.started else {}
            result = RunResult(metrics.rows, self.out_dir, wall,
                               sum(r.get("samples", 0) for r in metrics.rows), interrupted,
                               workers=workers, spans=len(spans), dropped=drops)
            try:
                result.stats = store.stats()
                result.consumed = {t.name: store.consumed(t.name) for t in plan.tasks}
            except Exception:
                pass
            result.evals = list(self.evals)
            metrics.close()
            train_rows.close()
            samples_log.close()
            result.events = list(self.events)
            result.startup = dict(self.startup)
            result.exports = {m: {k: v for k, v in e.items() if k != "model"}
                              for m, e in self.exports.items()}
            if self.out_dir:
                write_trace(os.path.join(self.out_dir, "trace.json"), spans, t0, pools,
                            {"startup_s": result.startup} if result.startup else None)
                if workers:  # where every worker ran, and how it ended
                    self._write_workers(be, workers)
            self.result = result
            be.shutdown(keep_ray=restart is not None)
        return result

    # -- internals -----------------------------------------------------------------------------
    def _take_events(self, c: dict, metrics: MetricsLog) -> None:
        """Run events from the workers; an ``eval`` event's row (runtime/evaluate.py) is a line
        of metrics.jsonl of its own and one of :attr:`evals`, not a run event."""
        for ev in c.get("events", ()):
            if ev.get("event") == "eval":
                self.evals.append(ev["row"])
                metrics.append_eval(ev["row"])
            else:
                self.events.append(ev)

    def _eval_finished(self, steps: int) -> bool:
        """eval: the run ends once the final version is evaluated (evaluate.py, rule 3), or
        when the evaluating worker is gone (nothing would evaluate it)."""
        ev = self.plan.eval
        if ev is None or any(r.get("eval/version", -1) >= steps for r in self.evals):
            return True
        return self._status.get(ev.worker) not in ("running", "starting", "restarted")

    def _primary(self, trainers: list[str]) -> str | None:
        """The train task whose version the rollouts follow, as the plan says (lower rule 9)."""
        return next((w.primary for w in self.plan.workers if w.task in trainers), None)

    def _ahead(self) -> int:
        return feed_ahead(self.plan)

    def _feed(self, store, prompts: list[dict], fed: int, upto: int) -> int:
        """Add groups ``fed .. upto - 1`` (group ``k`` is prompt ``k``, replicated
        ``samples_per_prompt`` times); returns ``upto``."""
        st = self.plan.step
        if upto <= fed:
            return fed
        spp = st.samples_per_prompt
        fields = list(prompts[0])
        cols: dict[str, list] = {f: [] for f in fields}
        groups: list[int] = []
        for k in range(fed, upto):
            p = prompts[k % len(prompts)]
            for f in fields:
                cols[f].extend([p[f]] * spp)
            groups.extend([k] * spp)
        rows = store.add_rows(cols, groups)
        want = list(range(fed * spp, upto * spp))
        if list(rows) != want:
            raise RunError(f"store numbered rows {rows[:3]}..., expected {want[:3]}... "
                           "(a step must own a contiguous row range)")
        return upto

    def _check_refill(self, filtered_rows: int, launch: int) -> None:
        """AF635: a refilling filter dropped every group of ``REFILL_ROUNDS`` steps' worth of
        launches since the last train step: new prompts would be fed for ever."""
        st = self.plan.step
        if "filter" not in st.replace:
            return
        groups = filtered_rows // st.samples_per_prompt
        if groups > REFILL_ROUNDS * launch:
            tasks = [t for t in self.plan.tasks if t.kind == "filter" and t.refill]
            raise fault("AF635", groups=groups, rounds=REFILL_ROUNDS, tasks=", ".join(
                f"{t.name!r} ({t.loc})" if t.loc else repr(t.name) for t in tasks))

    # -- faults ----------------------------------------------------------------------------------
    def _start_options(self) -> dict:
        """The workers' options; a worker targeted by ``--inject`` gets its faults."""
        base = {k: v for k, v in self.options.items() if k != "per_worker"}
        worker_faults = [f for f in self.inject if _by_worker(f)]
        if not worker_faults or self.resume:  # a restarted run does not inject again
            return base
        per = {}
        for w in self.plan.workers:
            mine = [f for f in worker_faults if _hits(f, w.id)]
            if mine:
                per[w.id] = {**base, "inject": mine}
        return {**base, "per_worker": per}

    def _inject_kills(self, be, step: int) -> None:
        """``kill@Ns`` faults that are due and every ``kill`` of an actor: the worker's process
        (Ray: ``ray.kill``; local: the thread stops at its next op boundary, acking nothing) or
        the actor. A ``kill@stepN`` of a worker is the worker's own (:func:`_by_worker`)."""
        now = time.time()
        for i, f in enumerate(self.inject):
            if f["kind"] != "kill" or _by_worker(f) or i in self._fired:
                continue
            due = (step >= f["at_step"]) if f["at_step"] is not None else \
                (now - self.t0 >= f["at_s"])
            if not due:
                continue
            self._fired.add(i)
            self.events.append({"t": now, "event": "kill", "worker": f["target"], "spec": f["spec"]})
            if _is_actor(f["target"]):
                be.kill_actor(f["target"])
            else:
                be.kill(f["target"])

    def _lost(self, what: str, e: Exception) -> RunError:
        return fault("AF632", what=what, cause=f"{e.__class__.__name__}: {e}")

    def _supervise(self, be, store, ctl, defer: bool = False) -> None:
        """A worker that died (its process, its thread, out of memory) is known at once: its
        leases are revoked, and it is restarted (``max_restarts``) with the current weights; a
        train worker restarts the run from the newest checkpoint (:class:`_Restart`)."""
        fin = be.finished()
        if not fin:
            return
        for wid, res in sorted(fin.items()):
            status = res.get("status")
            if status in ("stopped", "failed") or self._status.get(wid) == "dead":
                continue
            now = time.time()
            cause = res.get("error") or status
            store.revoke(wid)  # its rows are eligible again now, not when the leases expire
            self.events.append({"t": now, "event": "died", "worker": wid, "cause": cause})
            task = self.plan.task(wid.partition("/")[0])
            if self.max_restarts is None:  # no restarts: the run goes on while a replica lives
                self._status[wid] = "dead"
                self._check_workers(be)
                self._write_workers(be)
                continue
            if task.kind == "train":
                self._status[wid] = "dead"
                if not self.checkpoint_every:
                    raise fault("AF633", worker=wid, task=task.name, cause=cause)
                if defer:  # the run loop raises it after one more collect (see there)
                    self._deferred = _Restart(wid, cause, now)
                    return
                raise _Restart(wid, cause, now)
            n = self.restarts.get(wid, 0)
            if n >= self.max_restarts:
                self._status[wid] = "dead"
                raise fault("AF631", worker=wid, task=task.name, times=n + 1,
                            max_restarts=self.max_restarts, cause=cause)
            self.restarts[wid] = n + 1
            try:
                ctl.forget(wid)
            except Exception as e:
                raise self._lost("control actor", e) from None
            opts = {k: v for k, v in self.options.items() if k != "per_worker"}
            be.restart(wid, {**opts, "restarted": True})
            self._status[wid] = "restarted"
            self.events.append({"t": time.time(), "event": "restart", "worker": wid})
            self._write_workers(be)

    def _watchdog(self, be, ctl, watch: dict) -> None:
        """No step finished and no worker made progress for ``stall_timeout`` s, or a worker's
        heartbeat stopped that long: end the run naming the worker, its task, its op and its
        stack (never a silent freeze)."""
        now = time.time()
        if now - watch["beat_t"] < min(1.0, self.stall_timeout / 4):
            return
        watch["beat_t"] = now
        try:
            beats = ctl.beats()
        except Exception as e:
            raise self._lost("control actor", e) from None
        self._beats = beats
        key = tuple(sorted((w, b.get("progress", 0)) for w, b in beats.items()))
        if key != watch["key"]:
            watch["key"], watch["t"] = key, now
        fin = be.finished()
        live = {w: b for w, b in beats.items() if w not in fin}
        silent = [(now - b["received"], w) for w, b in live.items()
                  if now - b["received"] > self.stall_timeout]
        if not silent and now - watch["t"] <= self.stall_timeout:
            return
        if silent:
            age, wid = max(silent)
            b = live[wid]
            more = f"; its heartbeat stopped {age:.1f} s ago (the process is frozen or gone)"
        else:
            busy = [w for w, b in live.items() if b.get("op") not in ("READ", "WAIT")]
            pool = busy or list(live) or list(beats)
            if not pool:
                raise fault("AF630", seconds=self.stall_timeout, worker="?", task="?", op="?",
                            op_s=0.0, more="")
            wid = min(pool, key=lambda w: beats[w].get("op_since", now))
            b = beats[wid]
            more = ""
        stack = be.stack(wid) if hasattr(be, "stack") and not silent else ""
        stack = stack or b.get("stack") or ""
        others = ", ".join(f"{w} in {x.get('op')}" for w, x in sorted(live.items()) if w != wid)
        if others:
            more += f"; the others: {others}"
        if stack:
            more += f". Its stack:\n{stack.rstrip()}"
        raise fault("AF630", seconds=self.stall_timeout, worker=wid, task=wid.partition("/")[0],
                    op=b.get("op", "?"), op_s=now - float(b.get("op_since", now)), more=more,
                    details=stack)

    def _workers_info(self, be) -> dict:
        """Every worker: task, pool, process (placement rule 6), host, pid, node, cores (from its
        heartbeat or its end), restarts, status."""
        fin = be.finished() if self.started else {}
        out = {}
        for w in self.plan.workers:
            beat = self._beats.get(w.id, {}) if hasattr(self, "_beats") else {}
            info = {"task": w.task, "pool": w.pool, "process": w.process or w.id,
                    **(beat.get("where") or {})}
            res = fin.get(w.id)
            if res:
                info.update(res)
            info["restarts"] = self.restarts.get(w.id, 0)
            st = self._status.get(w.id, "starting") if hasattr(self, "_status") else "starting"
            info["status"] = res.get("status") if res else st
            out[w.id] = info
        return out

    def _write_workers(self, be, workers: dict | None = None) -> None:
        """``RUN_DIR/workers.json``, atomically (tmp + rename): live during the run."""
        if not self.out_dir:
            return
        if not self._beats:
            try:
                self._beats = self.control.beats()
            except Exception:
                pass
        workers = workers if workers is not None else self._workers_info(be)
        path = os.path.join(self.out_dir, "workers.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(workers, f, indent=1, sort_keys=True, default=str)
        os.replace(tmp, path)

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

    def _wait_ready(self, ctl, be) -> None:
        """Until every worker has built its engine and synced once (start-up is not a step)."""
        ids = {w.id for w in self.plan.workers}
        limit = time.time() + float(self.options.get("start_timeout_s", 300.0))
        while time.time() < limit:
            for wid in self._kill_requests[:]:
                self._kill_requests.remove(wid)
                be.kill(wid)
            try:
                seen = set(ctl.collect_seen())
            except Exception as e:
                raise self._lost("control actor", e) from None
            if ids <= seen:
                return
            errors = ctl.errors()
            if errors:
                wid, msg, tb = errors[0]
                raise worker_error(wid, msg, tb)
            try:
                self._supervise(be, self.store, ctl)
            except StoreLost as e:
                raise self._lost("sample store", e) from None
            time.sleep(self.poll_s)
        raise RunError("workers did not start within the start-up timeout")

    def _all_consumed(self, store, fed: int) -> bool:
        s = store.stats()
        total = fed * self.plan.step.samples_per_prompt - sum(s.get("drops", {}).values())
        return all(t["consumed"] >= total for t in s["tasks"].values())

    def _check_workers(self, be) -> None:
        """Every task still needs a live replica (a crashed one's leases are re-issued)."""
        fin = be.finished()
        if not fin:
            return
        for t in self.plan.tasks:
            ids = [w.id for w in self.plan.workers if w.task == t.name]
            if ids and all(i in fin for i in ids) and any(fin[i].get("status") != "stopped" for i in ids):
                gone = ", ".join(f"{i}: {fin[i].get('status')}" for i in ids)
                raise RunError(f"every replica of task {t.name!r} is gone ({gone})")

    def _metrics(self, s: int, reps: dict, primary, c: dict, last: dict, rewards: dict,
                 drops: dict, store, pools: dict, t0: float) -> dict:
        rep = reps.get(primary) or next(iter(reps.values()))
        now = max(r["end"] for r in reps.values())
        window = max(now - last["t"], 1e-9)
        rows = rep["rows"]
        rvals = rep.get("rewards") or [rewards.pop(r) for r in rows if r in rewards]
        rvals = [float(x) for x in rvals if isinstance(x, (int, float))]
        r_mean, r_std = mean_std(rvals)
        stl = rep["staleness"]
        # utilization: busy-seconds of each pool's workers over the window
        busy, exposed = c["busy"], c["exposed"]
        used: dict[str, float] = {}
        cap: dict[str, float] = {}
        dev = {p.name: p.devices for p in self.plan.pools}
        dpr = {t.name: t.devices_per_replica for t in self.plan.tasks}
        for w in self.plan.workers:
            pool = w.pool or "cpu"
            db = busy.get(w.id, 0.0) - last["busy"].get(w.id, 0.0)
            used[pool] = used.get(pool, 0.0) + max(db, 0.0) * (dpr.get(w.task, 1) if w.pool else 1)
            cap[pool] = dev.get(pool, 0) or (cap.get(pool, 0.0) + 1)
        util = {p: min(1.0, used[p] / (window * cap[p])) for p in used if cap.get(p)}
        dev_pools = [p for p in util if p in dev and dev[p]]
        total_dev = sum(dev[p] for p in dev_pools)
        bubble = 1.0 - sum(util[p] * dev[p] for p in dev_pools) / total_dev if total_dev else None
        ex_roll = sum(max(exposed.get(w, 0.0) - last["exposed"].get(w, 0.0), 0.0) for w in exposed)
        exposed_s = sum(r.get("publish_s", 0.0) for r in reps.values()) + ex_roll
        try:
            queue = {t.name: store.pending(t.name) for t in self.plan.tasks}
        except Exception:
            queue = {}
        n_drop = sum(v for k, v in drops.items() if k not in ("filter", "redundant"))
        stats = c.get("stats") or {}
        sync_bytes = sum(int(v.get("sync_bytes", 0)) for v in stats.values())
        row = {
            "step": s, "version": rep["version"], "time": round(now - t0, 6),
            "step_time": round(window, 6), "samples": len(rows),
            "samples_per_s": round(len(rows) / window, 3),
            "reward_mean": r_mean, "reward_std": r_std,
            "staleness_mean": (sum(stl) / len(stl)) if stl else None,
            "staleness_max": max(stl) if stl else None,
            "dropped": n_drop - last["drops"],
            "filtered": drops.get("filter", 0),
            "refilled": getattr(self, "_refilled", 0),
            "cancelled": drops.get("redundant", 0),
            "aborted": sum(int(v.get("aborted", 0)) for v in stats.values()),
            "utilization": {p: round(u, 4) for p, u in sorted(util.items())},
            "bubble_fraction": round(bubble, 4) if bubble is not None else None,
            "queue_depth": queue, "exposed_sync_s": round(exposed_s, 6),
        }
        if sync_bytes:  # bytes the collective edges delivered since the last step
            row["sync_bytes"] = sync_bytes - last.get("sync_bytes", 0)
            last["sync_bytes"] = sync_bytes
        for task, r in sorted(reps.items()):
            for k, v in r["metrics"].items():
                key = k if task == primary else f"{task}/{k}"
                if key not in row:
                    row[key] = v
        last["t"], last["busy"], last["exposed"], last["drops"] = now, dict(busy), dict(exposed), n_drop
        return row


def run_plan(plan: Plan, backend: str = "local", **kw) -> RunResult:
    """Execute ``plan`` (see :class:`Driver` for the keyword arguments)."""
    return Driver(plan, backend, **kw).run()


def merged_shares(reps: dict[int, dict]) -> dict:
    """One train step's report of a data-parallel trainer from its replicas' (``{replica:
    report}``, each of its share of the step's rows): the rows, their rewards and staleness
    together in row order; the metrics, samples, checkpoint and export replica 0's (the metrics
    are the global step's on every replica; only replica 0 exports); the slowest compute."""
    first = reps[min(reps)]
    triples = sorted((r, rw, st) for rep in reps.values()
                     for r, rw, st in zip(rep["rows"], _padded(rep.get("rewards"), rep["rows"]),
                                          _padded(rep.get("staleness"), rep["rows"])))
    rewarded = all(len(rep.get("rewards") or []) == len(rep["rows"]) for rep in reps.values())
    return {**first, "rows": [t[0] for t in triples],
            "rewards": [t[1] for t in triples] if rewarded else [],
            "staleness": [t[2] for t in triples],
            "checkpoint": first.get("checkpoint") or next(
                (r["checkpoint"] for r in reps.values() if r.get("checkpoint")), None),
            "next_row": max(r.get("next_row") or 0 for r in reps.values()),
            "compute_s": max(r.get("compute_s", 0.0) for r in reps.values())}


def _padded(values, rows) -> list:
    values = list(values or [])
    return values + [None] * (len(rows) - len(values))

