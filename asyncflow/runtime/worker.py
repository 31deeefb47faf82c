"""One worker per task replica (a :class:`~asyncflow.plan.WorkerPlan`): it executes its op list.

:class:`Worker` is the real-time host of the loops of :mod:`asyncflow.runtime.loops` (written
once, for it and for the simulator): a thread of the local backend or of a Ray actor. It adds
what only a real run has: the engine's start, the control plane's ``sync``, the heartbeat that
renews leases and reports liveness, injected faults, and where it ran (a thread or a Ray
actor's, :mod:`asyncflow.runtime.hosts`; on Ray a trainer's publish notice, step ack and report
go out on a courier thread, :mod:`asyncflow.runtime.courier`).

The compiled plan is the program. A worker walks its ``WorkerPlan.ops`` -- WAIT, ADOPT, READ,
COMPUTE, WRITE, PUBLISH -- and calls each op's handler from one dispatch table
(``Loop.ops``); consecutive READs (one per input channel) are one lease, since the store
joins a row's fields from every channel, and consecutive WRITEs are one ack. Everything a READ
needs is on the op (the lower pass computes it): the most rows it takes (``rows``), the fewest it
waits for (``min_rows``), whole units (``unit``, a group), whether it stays inside one step
(``granularity`` ``micro_batch`` / ``step``), a pull's size (``chunk``) and how long a lease is
held (``lease_s``). The loop shape comes from the kinds table (``kinds.KINDS[kind].loop``,
``Loop.loops``); the COMPUTE runner from ``kinds.KINDS[kind].runner``:

==========  ========================================================================================
loop        body
==========  ========================================================================================
``batches`` the op list, over and over: WAIT (a gated worker whose last READ found nothing waits on
            the weight board), ADOPT (newer weights, between requests), READ what is ready, COMPUTE,
            WRITE; a ``step`` READ takes step r, r + R, ... (replica r of R)
``serve``   a rollout engine with ``serve(pull, emit)`` (continuous batching across steps; an
            engine without it runs ``batches``): ``pull`` runs WAIT, ADOPT and a READ of at most
            ``chunk`` rows, the engine computes, finished rows are written (WRITE) by a pull
            every ``flush_s`` (:mod:`asyncflow.runtime.loops.serve`, the simulator's too)
``train``   once per step n: READ micro-batches of step n's rows until all of them (but the
            dropped) are leased, staleness-checked (gate rule 4); COMPUTE one ``train_step`` on
            the whole step in row order; PUBLISH version n + 1; then ack, checkpoint, report
==========  ========================================================================================

Every store call moves a batch (a lease of many rows, an ack with its output columns); the
control plane (stop flag, newest weights, trace spans, busy time) is one batched ``sync`` call
every few milliseconds, never one call per sample. A gated worker leases only rows its version
may start (:mod:`asyncflow.runtime.gate`, rule 2, with the WAIT op's ``max_lag`` as alpha). A
READ that finds nothing backs off briefly.

This module imports neither Ray nor torch: the store and the control are handles whose methods
are plain calls (the Ray backend hands in proxies).
"""
from __future__ import annotations

import collections
import math
import os
import socket
import sys
import threading
import time
import traceback

from asyncflow import kinds, models, prompts
from asyncflow.engines.base import EngineSpec, class_capabilities, load_engine_class
from asyncflow.plan import Plan
from asyncflow.refs import accepted, resolve
from asyncflow.runtime import checkpoint, devices
from asyncflow.runtime.contract import TaskError
from asyncflow.runtime.evaluate import Evaluator
from asyncflow.runtime.heartbeat import PROCESS, Heartbeats
from asyncflow.runtime.hosts import RayHost, ThreadHost
from asyncflow.runtime.loops import Loop
from asyncflow.runtime.signals import Crash, Stop
from asyncflow.runtime.tasks import runner_for
from asyncflow.runtime.weights import Adopter, Publisher

__all__ = ["WORKER_FAULTS", "Crash", "Stop", "Worker", "engine_spec"]


def _log(msg: str) -> None:
    print(f"asyncflow: {msg}", file=sys.stderr)


#: the fault kinds a worker applies itself (``asyncflow run --inject``): all but a ``kill`` timed
#: in seconds or aimed at an actor, which the driver does
WORKER_FAULTS = ("hang", "nan", "oom", "raise", "exit", "kill")


def engine_spec(plan: Plan, task, replica: int, paths=()) -> EngineSpec:
    """What an engine is built from. Its ``inputs``/``outputs`` are *roles* (the kinds table's
    names: prompt, response, logprobs, ...): the worker renames the store's columns to roles
    before a call and the engine's columns back to the user's fields after it."""
    model = next((m for m in plan.models if m.name == task.model), None)
    mdict = {"name": model.name, "init": model.init, "args": dict(model.args),
             "frozen": model.frozen,
             # where it comes from, as the compiler resolved it (asyncflow.modelsrc), its dtype
             "source_kind": getattr(model, "source_kind", ""), "source": getattr(model, "source", ""),
             "path": getattr(model, "path", ""), "dtype": getattr(model, "dtype", "float32"),
             "loc": getattr(model, "loc", ""),
             "trust_remote_code": bool(getattr(model, "trust_remote_code", False)),
             "lora": dict(getattr(model, "lora", None) or {})} if model else {}
    st = plan.step
    # its worker (None: an engine built outside the plan's workers -- a test, a benchmark)
    wp = next((w for w in plan.workers if w.id == f"{task.name}/{replica}"), None)
    extra = {"samples_per_prompt": st.samples_per_prompt, "prompts_per_step": st.prompts_per_step,
             "samples_per_step": st.samples_per_step, "steps": st.steps,
             # a CPU device is one CPU slot: an engine takes as many threads as it has slots, so
             # colocated engines do not oversubscribe the cores (2 threads each on 2 cores ran
             # the main job 7x slower)
             "threads": max(1, task.devices_per_replica) if plan.device_kind == "CPU" else None,
             "devices": max(1, task.devices_per_replica), "device_kind": plan.device_kind,
             # this worker's share of each of its devices (placement rule 3: 0.5 where two
             # workers time-share one), e.g. the vllm engine's gpu_memory_utilization
             "device_share": (float(wp.resources.get(plan.device_kind, 0) or 0)
                              if wp is not None else None),
             # scorers and trainers see log-probs at the temperature the rollout sampled with
             "temperature": float((wp.sampling if wp is not None else {}).get("temperature", 1.0)),
             "search_path": list(paths),
             "task_loc": getattr(task, "loc", ""),  # for an engine's located errors (AF65x)
             # the scheduling keys an engine acts on (engines/base.py, "scheduling")
             "schedule": task.schedule, "on_update": task.on_update, "stream": task.stream}
    env = getattr(task, "env", None)
    if env:  # a multi-turn rollout: the environment factory and the task args it accepts
        extra["env"] = env
        extra["env_args"] = accepted(resolve(env, paths), task.args)
    roles_in = tuple(dict.fromkeys(r for _, r in task.bind_in if r != "keep"))
    return EngineSpec(
        task=task.name, kind=task.kind, model=mdict, args=dict(task.args or {}),
        inputs=roles_in, outputs=tuple(r for _, r in task.bind_out), loss=task.loss,
        seed=plan.seed, replica=replica, replicas=task.replicas, extra=extra)


def cpu_report(cpu: dict[str, float]) -> dict[str, float]:
    """workers.json ``cpu_s``: thread CPU seconds per op kind, to the microsecond, of the ops
    that used some (an op of a few µs, rounded to 4 places, read 0.0)."""
    return {op: v for op, v in ((op, round(s, 6)) for op, s in sorted(cpu.items())) if v > 0}


class Worker(Heartbeats, Loop):
    """The loop of one task replica, in real time; ``run()`` returns a summary dict when the
    run stops."""

    def __init__(self, plan: dict, worker_id: str, store, control, t0: float,
                 options: dict | None = None):
        super().__init__(plan, worker_id, store, control, options)
        self.t0 = t0
        self.host = RayHost() if self.opt.get("ray") else ThreadHost()
        self.sync_every = float(self.opt.get("sync_s", 0.01))
        self.publisher: Publisher | None = None  # a trainer's (_publisher)
        self.evaluator = None  # eval: this worker evaluates (asyncflow.runtime.evaluate)
        self._crash = False
        self._last_sync = 0.0
        # answers to heartbeats sent on another thread (its courier's, a neighbour's sync)
        self._heard: collections.deque = collections.deque()
        self._synced = False  # it has made a sync of its own (then others may carry its beat)
        # liveness: the leases this worker holds (renewed by the heartbeat thread while it
        # computes), the op it is in and since when (and ``progress``, the watchdog's counter)
        self._held: dict[int, float | None] = {}
        self._device: dict | None = None  # {"gpus", "device"} once its engine is built
        self._held_lock = threading.Lock()
        self._op, self._op_since = "START", time.time()
        # thread CPU seconds of this worker's loop per op kind (workers.json ``cpu_s``,
        # benchmarks/runtime.py): what the runtime costs, apart from the time it waits
        self._cpu: dict[str, float] = {}
        self._op_cpu = time.thread_time()
        self._ident: int | None = None
        self._beat_stop = threading.Event()
        self.lease_s = float(self.opt.get("lease_s", 60.0))
        self.heartbeat_s = float(self.opt.get("heartbeat_s", 1.0))
        self.stack_after_s = float(self.opt.get("stack_after_s", 5.0))
        self.faults = [f for f in self.opt.get("inject") or () if f.get("kind") in WORKER_FAULTS]
        # on Ray a trainer's publish notice, step ack and report (Loop.send) go out in order on
        # a thread of their own (asyncflow.runtime.courier): the next step does not wait for them
        self.courier = self.host.courier(worker_id) if self.loop == "train" else None
        if self.courier is not None:
            self.send = self.courier.send
        # and its read of the next step's rows (in_order read-ahead) on a thread of its own
        self.reader = self.host.reader(worker_id) if self.loop == "train" else None

    def fetch(self, fn, *args, **kwargs):
        if self.reader is None:
            return super().fetch(fn, *args, **kwargs)
        return self.reader.submit(fn, *args, **kwargs)

    def fetches(self) -> bool:
        return self.reader is not None

    # ------------------------------------------------------------------ control plane
    def kill(self) -> None:
        """Tests: crash at the next chance, leaving whatever is leased unacked."""
        self._crash = True

    def check(self) -> None:
        if self._crash:
            raise Crash()

    # ------------------------------------------------------------------ run
    def run(self) -> dict:
        self._ident = threading.get_ident()
        if self.host.ray:  # the workers of this process (whose heartbeats may go together)
            PROCESS.append(self)
        beat = threading.Thread(target=self._heartbeat, name=f"asyncflow-beat:{self.id}",
                                daemon=True)
        beat.start()
        try:
            return self._run()
        finally:
            if self in PROCESS:
                PROCESS.remove(self)
            self._beat_stop.set()
            if self.reader is not None:  # a read ahead of a step that never came is not waited for
                self.reader.shutdown(wait=False)
            close = getattr(self.engine, "close", None)  # an engine's files, its device memory
            if close is not None:
                try:
                    close()
                except Exception as e:  # the run's result stands; what was not freed is said
                    _log(f"worker {self.id}: closing its engine failed "
                         f"({e.__class__.__name__}: {e})")

    def _fail(self, error: str, tb: str) -> None:
        """Report a failure to the driver; a report that cannot be made is logged (the driver
        then sees the worker end ``failed`` without its error)."""
        try:
            self.control.fail(self.id, error, tb)
        except Exception as e:
            _log(f"worker {self.id} failed and could not report it "
                 f"({e.__class__.__name__}: {e}); the failure was:\n{tb}")

    def _run(self) -> dict:
        try:
            self._start()
            self.run_loop()
            if self.courier is not None:  # the last step's calls are out (a failure: below)
                self.courier.drain()
            status = "stopped"
        except Crash:
            return self._final("crashed")
        except MemoryError as e:  # out of memory: the worker dies (and may be restarted)
            return self._final("died", error=f"MemoryError: {e}", op=self._op)
        except Stop:
            status = "stopped"
        except TaskError as e:  # the user's function or data: a located AF6xx error
            self._fail(e.payload(), traceback.format_exc())
            return self._final("failed", error=str(e))
        except Exception as e:  # reported to the driver, which stops the run
            self._fail(f"{e.__class__.__name__}: {e}", traceback.format_exc())
            return self._final("failed", error=str(e))
        try:
            self.flush_acks()  # the last lease's ack, carried for a READ that never came
            if self.courier is not None:
                self.courier.drain()
            self.rec.occupancy(0.0)
            self.sync(force=True)
        except Crash:
            pass  # killed after its loop ended: nothing was left to report
        except Exception as e:  # the last spans and counters are lost, said once
            _log(f"worker {self.id}: its last report failed ({e.__class__.__name__}: {e})")
        return self._final(status)

    # ------------------------------------------------------------------ liveness
    @property
    def op(self) -> str:
        """The op it is in now ("START" before its loop): what a death report names."""
        return self._op

    def enter(self, op: str) -> None:
        cpu = time.thread_time()
        self._cpu[self._op] = self._cpu.get(self._op, 0.0) + cpu - self._op_cpu
        self._op_cpu = cpu
        self._op, self._op_since = op, time.time()

    def _final(self, status: str, **more) -> dict:
        """The worker's result: status, counters, thread CPU seconds per op kind, where it ran."""
        self.enter(self._op)
        return {"worker": self.id, "status": status, **more, **self.stats,
                "cpu_s": cpu_report(self._cpu),
                **self._where()}

    def hold(self, lease, lease_s) -> None:
        with self._held_lock:
            self._held[lease.id] = lease_s or None
        self.progress += 1

    def unhold(self, lease_id) -> None:
        with self._held_lock:
            self._held.pop(lease_id, None)

    def stack(self) -> str:
        """The Python stack of this worker's loop thread, now."""
        frame = sys._current_frames().get(self._ident) if self._ident else None
        return "".join(traceback.format_stack(frame)) if frame is not None else ""

    def _heartbeat(self) -> None:
        """While the worker runs: renew the leases it holds (one batched call per period, so a
        slow COMPUTE keeps its rows) and tell the control where it is (op, since, progress; its
        stack once an op has lasted ``stack_after_s``). Slow is not dead."""
        last_renew, where_sent, lost = 0.0, False, False
        while not self._beat_stop.is_set():
            with self._held_lock:
                held = dict(self._held)
            shortest = min([v or self.lease_s for v in held.values()] + [self.lease_s])
            period = max(0.01, min(self.heartbeat_s, shortest / 3.0))
            now = time.time()
            try:
                if held and now - last_renew >= max(period, shortest / 4.0):
                    by_s: dict = {}
                    for lid, ls in held.items():
                        by_s.setdefault(ls, []).append(lid)
                    for ls, ids in by_s.items():
                        self.store.renew_many(ids, ls)
                    last_renew = now
                info = {"op": self._op, "op_since": self._op_since, "progress": self.progress,
                        "time": now}
                if not where_sent:
                    info["where"] = self._where()
                if now - self._op_since >= self.stack_after_s:
                    info["stack"] = self.stack()
                reply = self.control.beat(self.id, info)
                where_sent = True
                if reply and reply.get("stop"):
                    self.stopped = True
            except Exception as e:  # the control or the store is gone: the driver sees it
                if not lost:
                    lost = True
                    _log(f"worker {self.id}: a heartbeat failed ({e.__class__.__name__}: {e}); "
                         "leases may lapse (later failures are not shown)")
            self._beat_stop.wait(period)

    # ------------------------------------------------------------------ faults (--inject)
    def _due(self, f: dict, step: int) -> bool:
        if f.get("at_s") is not None:
            return time.time() - self.t0 >= float(f["at_s"])
        return step >= int(f.get("at_step", 0))

    def inject(self, step: int, rows) -> None:
        """Apply this worker's injected faults due at ``step`` (before COMPUTE's call)."""
        if self.faults:
            self._inject(step, rows)

    def _inject(self, step: int, rows) -> None:
        for f in self.faults:
            if f["kind"] == "nan" or not self._due(f, step):
                continue
            spec = f.get("spec", f["kind"])
            if f["kind"] == "hang":  # no progress any more, until the run stops
                self.enter("COMPUTE")
                while not self.stopped and not self._crash:
                    time.sleep(0.02)
                self.check()
                raise Stop()
            if f["kind"] == "oom":
                raise MemoryError(f"injected (--inject {spec})")
            if f["kind"] == "kill":  # the process dies here (Ray: SIGKILL), acking nothing
                self.pending_events.append({"t": time.time(), "event": "kill", "worker": self.id,
                                            "spec": spec})
                self.sync(force=True)  # the driver learns when it struck
                self.host.die()  # Ray: the process; local: the thread, as a killed worker
            err = "RuntimeError: injected fault" if f["kind"] == "raise" else "SystemExit: 1"
            raise TaskError("AF610", self.task, fn=self.task.fn or self.task.engine or self.task.kind,
                            error=f"{err} (--inject {spec})", row=rows[0] if rows else 0,
                            tb="".join(traceback.format_stack()))

    def nan(self, step: int, out: dict) -> dict:
        """``nan@...``: every output value becomes NaN from the injected step on."""
        if self.faults and any(f["kind"] == "nan" and self._due(f, step) for f in self.faults):
            return {k: ([math.nan] * len(v) if isinstance(v, (list, tuple)) else v)
                    for k, v in out.items()}
        return out

    def _where(self) -> dict:
        """Where this worker ran: host, pid, Ray node id (ray backend), its process's niceness
        (a Ray worker's: asyncflow.runtime.ray_connect.NICENESS), pinned CPU cores."""
        try:
            node = self.host.node()
        except Exception as e:  # workers.json goes without the node id, said once here
            _log(f"the Ray node id is unknown ({e.__class__.__name__}: {e})")
            node = {}
        out: dict = {"task": self.task.name, "pool": self.wp.pool, "host": socket.gethostname(),
                     "pid": os.getpid(), **node}
        if hasattr(os, "nice"):
            out["nice"] = os.nice(0)
        if self.opt.get("cpu_affinity") and hasattr(os, "sched_getaffinity"):
            out["cpu_affinity"] = sorted(os.sched_getaffinity(0))
        if self._device is not None:  # placement rule 7 (asyncflow.runtime.devices)
            out.update(self._device)
        elif self.host.ray:
            out["gpus"] = devices.ray_gpu_ids()
        return out

    def _check_prompt(self, spec) -> None:
        """The data's first prompt, encoded once by the engine's tokenizer at start-up: chat
        messages for a tokenizer without a chat template (AF651) or a prompt that is neither
        text nor messages (AF652) or characters the tokenizer cannot encode (AF655: its ids do
        not spell the prompt back) or more tokens than the model takes (AF657) stop the run
        before any step, located (``check`` finds AF651's and AF655's twins, AF346 and AF348,
        where the model's tokenizer files can be read; a ``module:factory`` model's only here).
        ``chat_sample``: the driver's first data row, its text and chat values."""
        sample = self.opt.get("chat_sample") or {}
        tok = getattr(self.engine, "tokenizer", None)
        if not sample or tok is None:
            return
        for field, role in self.task.bind_in:
            if role == "prompt" and field in sample:
                prompts.fit_prompt(self.engine, *models.engine_prompt(spec, tok, sample[field],
                                                                     round_trip=True))

    def _start(self) -> None:
        t = time.time()
        runner = kinds.KINDS[self.task.kind].runner
        if kinds.KINDS[self.task.kind].engine or self.task.engine:
            cls = load_engine_class(self.task.engine)
            spec = engine_spec(self.plan, self.task, self.wp.replica, self.paths)
            self._device = devices.resolve(self.plan.device_kind, self.wp.devices, self.host.ray,
                                           class_capabilities(cls).uses_device, self.id)
            if self._device["device"]:
                spec.extra["device"] = self._device["device"]
            spec.extra["run_dir"] = self.opt.get("run_dir")  # where an engine may keep files
            if class_capabilities(cls).distributed and self.task.replicas > 1:
                if not self.host.ray:  # one process group per process: threads cannot be ranks
                    raise TaskError("AF637", self.task, engine=self.task.engine,
                                    replicas=self.task.replicas)
                spec.extra.update(devices.rendezvous(
                    self.control, self.task.name, self.wp.replica,
                    int(self.opt.get("group_generation", 0)), self.host.ray))
            self.engine = cls(spec)
            self._check_prompt(spec)
            if self.loop == "train" and self.opt.get("resume_dir"):  # --resume
                self.engine.load(checkpoint.engine_dir(self.opt["resume_dir"], self.id))
            method = runner.partition(".")[2] if runner.startswith("engine.") else "logprobs"
            self.call = getattr(self.engine, method)
        else:
            self.call = runner_for(self.task, self.paths)
        if self.models_in:  # each model the way its sync edge into this task says
            edges = {s.model: s for s in self.plan.sync if s.dst == self.task.name}
            self.adopter = Adopter(self.engine, self.models_in, self.host.ray,
                                   vias={m: s.via for m, s in edges.items()}, replica=self.id,
                                   delta={m: s.delta for m, s in edges.items()},
                                   call_timeout_s=float(self.opt.get("call_timeout_s", 120.0)))
        self.rec.span("START", 0, t)
        self.sync(force=True)
        if self.opt.get("restarted") and self.newer and self.adopter is not None:
            self.op_adopt(None, {})  # a restarted worker takes the newest weights before anything
        ev = self.plan.eval
        if ev is not None and ev.worker == self.id and self.engine is not None:
            self.evaluator = Evaluator(self.plan, self.paths)
            start = int(self.opt.get("start_step", 0))  # resumed: earlier versions were done
            self.evaluator.pending = [v for v in self.evaluator.pending if v >= start]
            self.evaluate()  # version 0: the initial weights, before the first READ

    def evaluate(self) -> None:
        """eval: evaluate on this worker's engine, between requests, when it holds a version the
        plan lists; the row goes to the driver as an ``eval`` event (runtime/evaluate.py)."""
        ev = self.evaluator
        version = self.current_version() or 0
        if ev is None or ev.due(version) is None:
            return
        self.enter("EVAL")
        t = time.time()
        row = ev.run(self.engine, version, self.to_roles, self.to_fields)
        self.rec.span("EVAL", int(row.get("eval/n") or 0), t, version=version)
        self.progress += 1
        self.pending_events.append({"t": time.time(), "event": "eval", "worker": self.id,
                                    "row": row})
        self.sync(force=True)

    def close_sync(self) -> None:
        """Stop serving weights (the run is over, or this worker was replaced)."""
        if self.publisher is not None:
            self.publisher.close()

    def _publisher(self) -> Publisher:
        """This trainer's sending side, by its sync edges (SyncPlan.via), made at first use."""
        if self.publisher is None:
            self.publisher = Publisher(self.engine, self.host.ray,
                                       [s for s in self.plan.sync if s.src == self.task.name])
        return self.publisher

    def publish_version(self, model: str, version: int) -> float:
        return self._publisher().publish(
            model, version, lambda *a: self.send(self.control.publish, *a))
