"""One worker per task replica (a :class:`~asyncflow.plan.WorkerPlan`): it executes its op list.

The compiled plan is the program. A worker walks its ``WorkerPlan.ops`` -- WAIT, ADOPT, READ,
COMPUTE, WRITE, PUBLISH -- and calls each op's handler from one dispatch table
(:attr:`Worker.ops`); consecutive READs (one per input channel) are one lease, since the store
joins a row's fields from every channel, and consecutive WRITEs are one ack. Everything a READ
needs is on the op (the lower pass computes it): the most rows it takes (``rows``), the fewest it
waits for (``min_rows``), whole units (``unit``, a group), whether it stays inside one step
(``granularity`` ``micro_batch`` / ``step``), a pull's size (``chunk``) and how long a lease is
held (``lease_s``). The loop shape comes from the kinds table (``kinds.KINDS[kind].loop``,
:attr:`Worker.loops`); the COMPUTE runner from ``kinds.KINDS[kind].runner``:

==========  ========================================================================================
loop        body
==========  ========================================================================================
``batches`` the op list, over and over: WAIT (a gated worker whose last READ found nothing waits on
            the weight board), ADOPT (newer weights, between requests), READ what is ready, COMPUTE,
            WRITE; a ``step`` READ takes step r, r + R, ... (replica r of R)
``serve``   a rollout engine with ``serve(pull, emit)`` (continuous batching across steps; an
            engine without it runs ``batches``): ``pull`` runs WAIT, ADOPT and a READ of at most
            ``chunk`` rows, the engine computes, a lease whose rows are all done runs the WRITEs
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

import contextlib
import math
import sys
import threading
import time
import traceback
from typing import Any

from asyncflow import kinds
from asyncflow.engines.base import EngineSpec, load_engine_class
from asyncflow.plan import Op, Plan
from asyncflow.runtime import devices
from asyncflow.runtime.contract import TaskError, check_outputs
from asyncflow.runtime.gate import Gate
from asyncflow.runtime.serve_loop import ServeLoop
from asyncflow.runtime.samples import Sampler
from asyncflow.runtime.signals import Crash, Stop
from asyncflow.runtime.step_reads import StepReads
from asyncflow.runtime.tasks import runner_for
from asyncflow.runtime.trace import Recorder
from asyncflow.runtime.weights import Adopter, Publisher
from asyncflow.runtime.windows import Windows


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
             "lora": dict(getattr(model, "lora", None) or {})} if model else {}
    st = plan.step
    extra = {"samples_per_prompt": st.samples_per_prompt, "prompts_per_step": st.prompts_per_step,
             "samples_per_step": st.samples_per_step, "steps": st.steps,
             # a CPU device is one CPU slot: an engine takes as many threads as it has slots, so
             # colocated engines do not oversubscribe the cores (2 threads each on 2 cores ran
             # the main job 7x slower)
             "threads": max(1, task.devices_per_replica) if plan.device_kind == "CPU" else None,
             "devices": max(1, task.devices_per_replica), "device_kind": plan.device_kind,
             # this worker's share of each of its devices (placement rule 3: 0.5 where two
             # workers time-share one), e.g. the vllm engine's gpu_memory_utilization
             "device_share": next((float(w.resources.get(plan.device_kind, 0) or 0)
                                   for w in plan.workers if w.id == f"{task.name}/{replica}"), None),
             # scorers and trainers see log-probs at the temperature the rollout sampled with
             "temperature": float(plan.worker(f"{task.name}/{replica}").sampling.get(
                 "temperature", 1.0)) if _has_worker(plan, task.name, replica) else 1.0,
             "search_path": list(paths),
             "task_loc": getattr(task, "loc", ""),  # for an engine's located errors (AF65x)
             # the scheduling keys an engine acts on (engines/base.py, "scheduling")
             "schedule": task.schedule, "on_update": task.on_update, "stream": task.stream}
    env = getattr(task, "env", None)
    if env:  # a multi-turn rollout: the environment factory and the task args it accepts
        from asyncflow.refs import accepted, resolve

        extra["env"] = env
        extra["env_args"] = accepted(resolve(env, paths), task.args)
    roles_in = tuple(dict.fromkeys(r for _, r in task.bind_in if r != "keep"))
    return EngineSpec(
        task=task.name, kind=task.kind, model=mdict, args=dict(task.args or {}),
        inputs=roles_in, outputs=tuple(r for _, r in task.bind_out), loss=task.loss,
        seed=plan.seed, replica=replica, replicas=task.replicas, extra=extra)


def _has_worker(plan: Plan, task: str, replica: int) -> bool:
    try:
        plan.worker(f"{task}/{replica}")
    except KeyError:  # an engine built outside the plan's workers (a test, a benchmark)
        return False
    return True


def body(ops: list[Op]) -> list[Op]:
    """The op list as the worker runs it: a run of READs (one per channel) is one READ over
    their fields, a run of WRITEs one WRITE (one lease, one ack)."""
    out: list[Op] = []
    for op in ops:
        if out and op.kind in ("READ", "WRITE") and out[-1].kind == op.kind:
            out[-1] = Op(**{**out[-1].__dict__,
                            "fields": list(dict.fromkeys(out[-1].fields + op.fields))})
        else:
            out.append(op)
    return out


class Worker(ServeLoop, StepReads):
    """The loop of one task replica; ``run()`` returns a summary dict when the run stops."""

    def __init__(self, plan: dict, worker_id: str, store, control, t0: float,
                 options: dict | None = None):
        self.plan = Plan.from_dict(plan) if isinstance(plan, dict) else plan
        self.wp = self.plan.worker(worker_id)
        self.task = self.plan.task(self.wp.task)
        self.id = worker_id
        self.store, self.control, self.t0 = store, control, t0
        self.opt = dict(options or {})
        self.use_ray = bool(self.opt.get("ray", False))
        self.sync_every = float(self.opt.get("sync_s", 0.01))
        self.backoff = float(self.opt.get("backoff_s", 0.005))
        self.timeout = float(self.opt.get("read_timeout_s", 0.02))
        self.rec = Recorder(worker_id, self.task.name, self.wp.pool)
        self.st = self.plan.step
        self.body = body(self.wp.ops)
        self.ops = {"WAIT": self._wait, "ADOPT": self._adopt, "READ": self._read,
                    "COMPUTE": self._compute, "WRITE": self._write, "PUBLISH": self._publish}
        self.loops = {"batches": self._loop_batches, "serve": self._loop_serve,
                      "train": self._loop_train}
        # what it does, as the plan says (lower rule 9): its loop, the gate's alphas, ...
        self.loop = self.wp.loop
        sps, steps, spp = self.st.samples_per_step, self.st.steps, self.st.samples_per_prompt
        # the scheduling keys: groups launched per step (redundancy), drop reasons replaced by
        # new groups (refill, first_ready), and the trainer's step windows over them
        self.launch = int(self.st.launch_groups or self.st.prompts_per_step)
        self.windows = Windows(spp, self.launch, self.st.replace)
        launch_rows = self.launch * spp
        # gate rule 2: alpha is the WAIT ops' max_lag (the smallest of the task's sync edges)
        alpha = self.wp.gate_alpha
        self.gate: Gate | None = Gate(alpha, sps, steps, launch_rows) if alpha is not None else None
        # gate rule 4 for a trainer: the staleness its published versions may carry
        self.accept = Gate(self.wp.accept_alpha, sps, steps, launch_rows)
        self.on_update = self.task.on_update or "finish"
        self.consume = self.task.consume or "in_order"
        # the train task whose choice of rows the others follow (first_ready, redundancy)
        self.primary = self.wp.primary
        self.leads = self.wp.chooses == "leads"  # records its rows per step
        self.follows = self.wp.chooses == "follows"  # trains the rows the primary chose
        self._g0 = int(self.opt.get("start_step", 0)) * self.launch  # the next window's group
        if self.opt.get("start_row") is not None:
            self._g0 = int(self.opt["start_row"]) // spp
        self._cancel_q: list[int] = []  # rows removed while perhaps in flight (serve loop)
        self._in_flight = 0  # samples a serve loop has in its engine
        self._top = int(self.opt.get("start_row") or 0) - 1  # the highest row trained
        self._newest = 0  # the newest policy version published, as far as this worker knows
        # first_ready: a sample in flight that no train step may take any more is cancelled
        # and replaced at once (not generated to the end and dropped)
        self.hopeless = (self.loop == "serve" and self.gate is not None
                         and "staleness" in self.st.replace and self.on_update != "abort")
        self.models_in = sorted({o.model for o in self.body if o.kind == "ADOPT" and o.model})
        self.publish_every = self.wp.publish_every
        self.engine: Any = None
        self.adopter: Adopter | None = None
        self.publisher: Publisher | None = None  # a trainer's (_publisher)
        self.evaluator = None  # eval: this worker evaluates (asyncflow.runtime.evaluate)
        self._crash = False
        self._stopped = False
        self._newer: dict = {}
        self._idle = False  # the last READ found nothing
        self._cursor = int(self.opt.get("start_step", 0)) + self.wp.replica  # step READs
        # a data-parallel trainer's replica: its READs take its share of each step (lower rule 8)
        self.shares = any(o.share for o in self.body if o.kind == "READ")
        self._last_sync = 0.0
        self._rewards: list = []  # (rows, values) to report
        self._drops: list = []  # (rows, reason) to report
        self._events: list = []  # run events to report (an injected kill: when it struck)
        self._stats = {"rows": 0, "leases": 0, "empty_reads": 0, "stale_dropped": 0}
        # liveness: the leases this worker holds (renewed by the heartbeat thread while it
        # computes), the op it is in and since when, and a counter of work done (the watchdog's)
        self._held: dict[int, float | None] = {}
        self._device: dict | None = None  # {"gpus", "device"} once its engine is built
        self._held_lock = threading.Lock()
        self._op, self._op_since, self._progress = "START", time.time(), 0
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
        self.paths = list(self.opt.get("search_path") or ())
        # the plan's bindings: which of the store's fields is which role (never a fixed name)
        self.roles_in = [(f, r) for f, r in self.task.bind_in if r != "keep"]
        self.roles_out = [(f, r) for f, r in self.task.bind_out]
        self.out_types = [(f, kinds.ROLES[r].type if r in kinds.ROLES else "any")
                          for f, r in self.roles_out]
        # a task that writes a response stamps each row with the version it was generated with
        self.stamps = any(r == "response" for _, r in self.roles_out)
        # a trainer's reads carry the reward column (for the step's reward_mean): the field a
        # reward task writes as its reward, else a multi-turn rollout's episode return
        self.reward = self.wp.reward_field
        self.fields = None
        if self.loop == "train":
            if self.reward and self.reward not in self.task.inputs:
                self.fields = list(self.task.inputs) + [self.reward]
        # samples.jsonl: the primary trainer's report of a logged step carries a few of its rows
        # (runtime/samples.py); they may need a field the trainer does not train on (the prompt)
        self.sampler = Sampler.of(self)
        if self.sampler is not None and self.sampler.extra:
            self.fields = list(dict.fromkeys((self.fields or list(self.task.inputs))
                                             + self.sampler.extra))

    # ------------------------------------------------------------------ control plane
    def kill(self) -> None:
        """Tests: crash at the next chance, leaving whatever is leased unacked."""
        self._crash = True

    def _check(self) -> None:
        if self._crash:
            raise Crash()

    def _sync(self, force: bool = False, wait_s: float = 0.0) -> bool:
        """Flush spans/busy/reports, learn the stop flag and of newer weights (the ADOPT op
        takes them up). ``wait_s``: wait up to that long for a newer version if there is none
        (a gated worker's WAIT). Returns True when the run is stopping."""
        self._check()
        now = time.time()
        if not force and not wait_s and now - self._last_sync < self.sync_every:
            return self._stopped
        self._last_sync = now
        known = dict(self.adopter.known) if self.adopter else {}
        for k in ("aborted", "cancelled"):  # the engine's in-flight samples restarted / dropped
            if hasattr(self.engine, k):
                self._stats[k] = int(getattr(self.engine, k))
        if self.adopter is not None and self.adopter.receivers:  # bytes a collective brought
            self._stats["sync_bytes"] = self.adopter.bytes
        state = {"busy": self.rec.busy(), "exposed_s": self.adopter.exposed_s if self.adopter else 0.0,
                 "rewards": self._rewards, "drops": self._drops, "stats": dict(self._stats),
                 "events": self._events}
        self._rewards, self._drops, self._events = [], [], []
        reply = self.control.sync(self.id, self.rec.drain(), state, known, wait_s=wait_s)
        self._stopped = bool(reply.get("stop"))
        if reply.get("newer"):
            self._newer = reply["newer"]
            self._newest = max([self._newest] + [int(v[0]) for v in self._newer.values()])
        for rows, reason in reply.get("dropped") or ():
            self.windows.note(rows, reason)
            if self.loop == "serve":
                self._cancel_q.extend(rows)
        return self._stopped

    # ------------------------------------------------------------------ bindings
    def _to_roles(self, cols: dict) -> dict:
        """Store columns (the user's fields) -> an engine batch keyed by role; a rollout's
        ``context`` (its further inputs, for an environment) is one tuple per row."""
        out = {k: v for k, v in cols.items() if k.startswith("_")}
        ctx = [cols[f] for f, r in self.roles_in if r == "context"]
        for f, r in self.roles_in:
            if r != "context":
                out[r] = cols[f]
        if ctx:
            out["context"] = list(zip(*ctx))
        return out

    def _to_fields(self, out: dict, rows) -> dict:
        """An engine's columns (keyed by role) -> the task's output fields, checked."""
        return self._checked({f: out.get(r) for f, r in self.roles_out}, rows)

    def _checked(self, cols: dict, rows) -> dict:
        """``cols`` (the task's output fields) checked against their roles' types (a missing
        output, a wrong length, NaN: AF611/AF612)."""
        check_outputs(self.task, cols, self.out_types, list(rows))
        return cols

    # ------------------------------------------------------------------ run
    def run(self) -> dict:
        self._ident = threading.get_ident()
        beat = threading.Thread(target=self._heartbeat, name=f"asyncflow-beat:{self.id}",
                                daemon=True)
        beat.start()
        try:
            return self._run()
        finally:
            self._beat_stop.set()
            close = getattr(self.engine, "close", None)  # an engine's files, its device memory
            if close is not None:
                with contextlib.suppress(Exception):
                    close()

    def _run(self) -> dict:
        try:
            self._start()
            self.loops[self.loop]()
            status = "stopped"
        except Crash:
            return self._final("crashed")
        except MemoryError as e:  # out of memory: the worker dies (and may be restarted)
            return self._final("died", error=f"MemoryError: {e}", op=self._op)
        except Stop:
            status = "stopped"
        except TaskError as e:  # the user's function or data: a located AF6xx error
            try:
                self.control.fail(self.id, e.payload(), traceback.format_exc())
            except Exception:
                pass
            return self._final("failed", error=str(e))
        except Exception as e:  # reported to the driver, which stops the run
            tb = traceback.format_exc()
            try:
                self.control.fail(self.id, f"{e.__class__.__name__}: {e}", tb)
            except Exception:
                pass
            return self._final("failed", error=str(e))
        try:
            self.rec.occupancy(0.0)
            self._sync(force=True)
        except (Crash, Exception):
            pass
        return self._final(status)

    # ------------------------------------------------------------------ liveness
    def _enter(self, op: str) -> None:
        cpu = time.thread_time()
        self._cpu[self._op] = self._cpu.get(self._op, 0.0) + cpu - self._op_cpu
        self._op_cpu = cpu
        self._op, self._op_since = op, time.time()

    def _final(self, status: str, **more) -> dict:
        """The worker's result: status, counters, thread CPU seconds per op kind, where it ran."""
        self._enter(self._op)
        cpu = {op: round(s, 4) for op, s in sorted(self._cpu.items()) if s > 0}
        return {"worker": self.id, "status": status, **more, **self._stats, "cpu_s": cpu,
                **self._where()}

    def _hold(self, lease, lease_s) -> None:
        with self._held_lock:
            self._held[lease.id] = lease_s or None
        self._progress += 1

    def _unhold(self, lease_id) -> None:
        with self._held_lock:
            self._held.pop(lease_id, None)

    def _ack(self, lease_id, cols=None) -> bool:
        self._unhold(lease_id)
        self._progress += 1
        return self.store.ack(lease_id, cols) if cols is not None else self.store.ack(lease_id)

    def _release(self, lease_id) -> bool:
        self._unhold(lease_id)
        return self.store.release(lease_id)

    def stack(self) -> str:
        """The Python stack of this worker's loop thread, now."""
        frame = sys._current_frames().get(self._ident) if self._ident else None
        return "".join(traceback.format_stack(frame)) if frame is not None else ""

    def _heartbeat(self) -> None:
        """While the worker runs: renew the leases it holds (one batched call per period, so a
        slow COMPUTE keeps its rows) and tell the control where it is (op, since, progress; its
        stack once an op has lasted ``stack_after_s``). Slow is not dead."""
        last_renew, where_sent = 0.0, False
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
                info = {"op": self._op, "op_since": self._op_since, "progress": self._progress,
                        "time": now}
                if not where_sent:
                    info["where"] = self._where()
                if now - self._op_since >= self.stack_after_s:
                    info["stack"] = self.stack()
                reply = self.control.beat(self.id, info)
                where_sent = True
                if reply and reply.get("stop"):
                    self._stopped = True
            except Exception:  # the control or the store is gone: the driver sees it
                pass
            self._beat_stop.wait(period)

    # ------------------------------------------------------------------ faults (--inject)
    def _step_of_rows(self, rows) -> int:
        return int(rows[0]) // self.st.samples_per_step if rows else 0

    def _due(self, f: dict, step: int) -> bool:
        if f.get("at_s") is not None:
            return time.time() - self.t0 >= float(f["at_s"])
        return step >= int(f.get("at_step", 0))

    def _inject(self, step: int, rows) -> None:
        """Apply this worker's injected faults due at ``step`` (before COMPUTE's call)."""
        for f in self.faults:
            if f["kind"] == "nan" or not self._due(f, step):
                continue
            spec = f.get("spec", f["kind"])
            if f["kind"] == "hang":  # no progress any more, until the run stops
                self._enter("COMPUTE")
                while not self._stopped and not self._crash:
                    time.sleep(0.02)
                self._check()
                raise Stop()
            if f["kind"] == "oom":
                raise MemoryError(f"injected (--inject {spec})")
            if f["kind"] == "kill":  # the process dies here (Ray: SIGKILL), acking nothing
                self._events.append({"t": time.time(), "event": "kill", "worker": self.id,
                                     "spec": spec})
                self._sync(force=True)  # the driver learns when it struck
                if self.use_ray:
                    import os
                    import signal

                    os.kill(os.getpid(), signal.SIGKILL)
                raise Crash()  # local: the thread dies as a killed worker (Worker.kill)
            err = "RuntimeError: injected fault" if f["kind"] == "raise" else "SystemExit: 1"
            raise TaskError("AF610", self.task, fn=self.task.fn or self.task.engine or self.task.kind,
                            error=f"{err} (--inject {spec})", row=rows[0] if rows else 0,
                            tb="".join(traceback.format_stack()))

    def _nan(self, step: int, out: dict) -> dict:
        """``nan@...``: every output value becomes NaN from the injected step on."""
        if any(f["kind"] == "nan" and self._due(f, step) for f in self.faults):
            return {k: ([math.nan] * len(v) if isinstance(v, (list, tuple)) else v)
                    for k, v in out.items()}
        return out

    def _where(self) -> dict:
        """Where this worker ran: host, pid, Ray node id (ray backend), pinned CPU cores."""
        import os
        import socket

        out: dict = {"task": self.task.name, "pool": self.wp.pool, "host": socket.gethostname(),
                     "pid": os.getpid()}
        if self.use_ray:
            try:
                import ray

                out["node"] = ray.get_runtime_context().get_node_id()
            except Exception:
                pass
        if self.opt.get("cpu_affinity") and hasattr(os, "sched_getaffinity"):
            out["cpu_affinity"] = sorted(os.sched_getaffinity(0))
        if self._device is not None:  # placement rule 7 (asyncflow.runtime.devices)
            out.update(self._device)
        elif self.use_ray:
            out["gpus"] = devices.ray_gpu_ids()
        return out

    def _check_prompt(self, spec) -> None:
        """The data's first prompt, encoded once by the engine's tokenizer at start-up: chat
        messages for a tokenizer without a chat template (AF651) or a prompt that is neither
        text nor messages (AF652) stop the run before any step, located (``check`` finds the
        first where the model's tokenizer files can be read; a ``module:factory`` model's only
        here). ``chat_sample``: the driver's first data row, its non-text values."""
        sample = self.opt.get("chat_sample") or {}
        tok = getattr(self.engine, "tokenizer", None)
        if not sample or tok is None:
            return
        from asyncflow import models

        for field, role in self.task.bind_in:
            if role == "prompt" and field in sample:
                models.engine_prompt(spec, tok, sample[field])

    def _start(self) -> None:
        t = time.time()
        runner = kinds.KINDS[self.task.kind].runner
        if kinds.KINDS[self.task.kind].engine or self.task.engine:
            cls = load_engine_class(self.task.engine)
            spec = engine_spec(self.plan, self.task, self.wp.replica, self.paths)
            self._device = devices.resolve(self.plan.device_kind, self.wp.devices, self.use_ray,
                                           getattr(cls, "uses_device", True), self.id)
            if self._device["device"]:
                spec.extra["device"] = self._device["device"]
            spec.extra["run_dir"] = self.opt.get("run_dir")  # where an engine may keep files
            if getattr(cls, "distributed", False) and self.task.replicas > 1:
                if not self.use_ray:  # one process group per process: threads cannot be ranks
                    from asyncflow.errors import TaskError

                    raise TaskError("AF637", self.task, engine=self.task.engine,
                                    replicas=self.task.replicas)
                spec.extra.update(devices.rendezvous(
                    self.control, self.task.name, self.wp.replica,
                    int(self.opt.get("group_generation", 0)), self.use_ray))
            self.engine = cls(spec)
            self._check_prompt(spec)
            if self.loop == "train" and self.opt.get("resume_dir"):  # --resume
                from asyncflow.runtime import checkpoint

                self.engine.load(checkpoint.engine_dir(self.opt["resume_dir"], self.id))
            method = runner.partition(".")[2] if runner.startswith("engine.") else "logprobs"
            self.call = getattr(self.engine, method)
        else:
            self.call = runner_for(self.task, self.paths)
        if self.models_in:  # each model the way its sync edge into this task says
            edges = {s.model: s for s in self.plan.sync if s.dst == self.task.name}
            self.adopter = Adopter(self.engine, self.models_in, self.use_ray,
                                   vias={m: s.via for m, s in edges.items()}, replica=self.id,
                                   delta={m: s.delta for m, s in edges.items()},
                                   call_timeout_s=float(self.opt.get("call_timeout_s", 120.0)))
        self.rec.span("START", 0, t)
        self._sync(force=True)
        if self.opt.get("restarted") and self._newer and self.adopter is not None:
            self._adopt(None, {})  # a restarted worker takes the newest weights before anything
        ev = self.plan.eval
        if ev is not None and ev.worker == self.id and self.engine is not None:
            from asyncflow.runtime.evaluate import Evaluator

            self.evaluator = Evaluator(self.plan, self.paths)
            start = int(self.opt.get("start_step", 0))  # resumed: earlier versions were done
            self.evaluator.pending = [v for v in self.evaluator.pending if v >= start]
            self._evaluate()  # version 0: the initial weights, before the first READ

    def _evaluate(self) -> None:
        """eval: evaluate on this worker's engine, between requests, when it holds a version the
        plan lists; the row goes to the driver as an ``eval`` event (runtime/evaluate.py)."""
        ev = self.evaluator
        version = self._version() or 0
        if ev is None or ev.due(version) is None:
            return
        self._enter("EVAL")
        t = time.time()
        row = ev.run(self.engine, version, self._to_roles, self._to_fields)
        self.rec.span("EVAL", int(row.get("eval/n") or 0), t, version=version)
        self._progress += 1
        self._events.append({"t": time.time(), "event": "eval", "worker": self.id, "row": row})
        self._sync(force=True)

    def _version(self) -> int | None:
        return self.adopter.version if self.adopter else None

    def _max_row(self) -> int | None:
        """Gate rule 2: the rows this worker's version may start."""
        return None if self.gate is None else self.gate.max_row(self._version() or 0, self._extra())

    def _extra(self) -> int:
        """Rows fed to replace removed groups, as far as this worker has heard (gate rule 2)."""
        spp = self.st.samples_per_prompt
        return self.windows.replaced_rows // spp * spp

    def _fresh(self, rows: list[int], version: int | None) -> list[int]:
        """Rows that may not be written with ``version`` (gate rule 3)."""
        if self.gate is None or version is None:
            return []
        extra = self._extra()
        return [r for r in rows if not self.gate.fresh_enough(r, version, extra)]

    # ------------------------------------------------------------------ loops
    def _loop_batches(self) -> None:
        while not self._sync():
            it: dict = {}
            for op in self.body:
                self._enter(op.kind)
                if not self.ops[op.kind](op, it):
                    break

    def _loop_train(self) -> None:
        step = int(self.opt.get("start_step", 0))
        if step:  # resumed: rollouts start from the checkpoint's weights
            for op in self.body:
                if op.kind == "PUBLISH" and op.model:
                    self._publisher().publish(op.model, step, self.control.publish)
        while step < self.st.steps:
            if self._sync():
                return
            it: dict = {"step": step}
            for op in self.body:
                self._enter(op.kind)
                self.ops[op.kind](op, it)
            self._enter("ACK")
            self._end_step(it)
            self._progress += 1
            step += 1
        self._sync(force=True)

    # ------------------------------------------------------------------ op handlers
    # each takes (op, it): ``it`` holds this turn's lease, rows, columns, version, step; a
    # handler returns False when the rest of the body has nothing to do this turn
    def _wait(self, op: Op, it: dict) -> bool:
        """Block on the weight board when the last READ found nothing the gate lets this version
        start: the board wakes the worker the moment the trainer publishes (a serve loop never
        blocks: it keeps emitting finished samples)."""
        if self._idle and "pull" not in it and self.adopter is not None and self.adopter.known:
            self._idle = False
            self._sync(wait_s=self.timeout)
        return True

    def _adopt(self, op: Op, it: dict) -> bool:
        """Take up the newer weights the last heartbeat offered (between requests)."""
        if "pull" in it and self.on_update == "finish" and self._in_flight > 0:
            return True  # on_update: finish -- in-flight samples end with the old weights first
        newer, self._newer = self._newer, {}
        if newer and self.adopter is not None and not self._stopped:
            t = time.time()
            aborted = int(getattr(self.engine, "aborted", 0))
            if self.adopter.adopt(newer):
                self.rec.span("ADOPT", 0, t, version=self.adopter.version)
                gone = int(getattr(self.engine, "aborted", 0)) - aborted
                if gone > 0:  # on_update: abort -- the samples in flight start again
                    now = time.time()
                    self.rec.span("ABORT", gone, now, now, version=self.adopter.version)
                self._evaluate()  # eval: a version the plan lists (between requests)
        return True

    def _read(self, op: Op, it: dict) -> bool:
        if op.granularity in ("micro_batch", "step"):
            return self._read_step(op, it)
        n = it.get("pull", op.rows)
        gated = self.gate is not None and self.adopter is not None and bool(self.adopter.known)
        t = time.time()
        # a gated worker waits on the weight board (its WAIT), not on the store: the rows it may
        # not start yet become readable only with a newer version
        lease = self.store.get(self.task.name, n, min_rows=min(op.min_rows, n),
                               whole_groups=op.granularity == "group" and op.unit > 1,
                               group_size=op.unit, max_row=self._max_row(),
                               timeout=0.0 if gated or "pull" in it else self.timeout,
                               lease_s=op.lease_s or None, owner=self.id)
        if lease is None:
            self._stats["empty_reads"] += 1
            self._idle = True
            if not gated and "pull" not in it:
                time.sleep(self.backoff)
            return False
        self._hold(lease, op.lease_s)
        self._check()
        self._stats["leases"] += 1
        version = self._version()
        self.rec.span("READ", len(lease.rows), t, version=version,
                      step=self.gate.step_of(lease.rows[0]) if self.gate else None)
        it.update(lease=lease, rows=list(lease.rows), cols=lease.columns, version=version)
        return True

    def _compute(self, op: Op, it: dict) -> bool:
        rows = it.get("rows", [])
        step = it["step"] if it.get("step") is not None else self._step_of_rows(rows)
        if self.faults:
            self._inject(step, rows)
        t = self.rec.compute_begin()
        if "stream" in it:  # stream: true -- COMPUTE spans per micro-batch (_micro_batches)
            self.rec.compute_end()
            it["metrics"] = self.engine.train_stream(self._micro_batches(it, op.rows))
            self._enter("COMPUTE")
            self._join(it)
            it["end"] = time.time()
            it["compute_s"] = it["end"] - t
            self._progress += 1
            self._check()
            return True
        if self.loop == "train":  # a trainer's runner returns metrics, not columns
            if rows:
                it["metrics"] = self.call(self._to_roles(dict(it.get("cols") or {})))
            elif self.shares:  # an empty share still joins the replicas' collectives
                it["metrics"] = self.call(self._to_roles({f: [] for f in self.task.inputs}))
            else:
                it["metrics"] = {}
            version = it["step"]
        elif self.engine is not None:
            out = self.call(self._to_roles(it["cols"]))
            it["out"] = self._to_fields(self._nan(step, out) if self.faults else out, rows)
            version = it["version"]
        else:
            out, it["keep"] = self.call(it["cols"])
            if self.faults:
                out = self._nan(step, out)
            it["out"] = self._checked({f: out.get(f) for f in self.task.outputs}, rows)
            version = it["version"]
        it["end"] = end = self.rec.compute_end()
        it["compute_s"] = end - t
        self._progress += 1
        self._check()
        if it.get("step") is None and self.gate is not None:
            it["step"] = self.gate.step_of(rows[0])
        self.rec.span("COMPUTE", len(rows), t, end, version, it.get("step"))
        return True

    def _write(self, op: Op, it: dict) -> bool:
        """Ack the lease with the output columns (gate rule 3 first: a row too stale for the
        rows its version may start is given back and generated again with newer weights, in
        place; a filter's dropped rows go before the ack, so no downstream task sees them).
        ``it["partial"]``: the rows are some of the lease's (a serve loop writes each sample as
        it finishes); the rest stay leased."""
        rows, version, lease = it["rows"], it["version"], it["lease"]
        cols = {o: list(v) for o, v in it["out"].items()}
        partial = bool(it.get("partial"))
        if self.stamps:
            versions = it.get("versions") or [version if version is not None else 0] * len(rows)
            extra = self._extra()
            stale = ([r for r, v in zip(rows, versions)
                      if not self.gate.fresh_enough(r, v, extra)] if self.gate else [])
            if stale:
                self._stats["stale_dropped"] += len(stale)
                self._drops.append((stale, "regenerated"))
                self.store.release_rows(lease.id, stale)
                gone = set(stale)
                keep = [i for i, r in enumerate(rows) if r not in gone]
                if not keep:
                    return False
                rows = [rows[i] for i in keep]
                versions = [versions[i] for i in keep]
                cols = {f: [v[i] for i in keep] for f, v in cols.items()}
                partial = True
            cols["_version"] = versions
        keep = it.get("keep")
        if keep is not None:
            gone = [r for r, k in zip(rows, keep) if not k]
            if gone:
                self.store.drop(gone, self.task.name)
                self.control.note_drops(gone, "filter")
        if partial:
            self.store.ack_rows(lease.id, rows, cols)
            self._progress += 1
        else:
            self._ack(lease.id, cols)
        self._stats["rows"] += len(rows)
        if self.task.kind == "reward" and self.task.outputs:
            self._rewards.append((list(rows), list(cols[self.task.outputs[0]])))
        self.rec.span("WRITE", len(rows), it["end"], version=version, step=it.get("step"))
        return True

    def close_sync(self) -> None:
        """Stop serving weights (the run is over, or this worker was replaced)."""
        if self.publisher is not None:
            self.publisher.close()

    def _publisher(self) -> Publisher:
        """This trainer's sending side, by its sync edges (SyncPlan.via), made at first use."""
        if self.publisher is None:
            self.publisher = Publisher(self.engine, self.use_ray,
                                       [s for s in self.plan.sync if s.src == self.task.name])
        return self.publisher

    def _publish(self, op: Op, it: dict) -> bool:
        """Publish version n + 1 after train step n (every ``publish_every`` steps and the
        last), before anything else: the gated rollout waits for exactly this version."""
        step = it["step"]
        if (step + 1) % self.publish_every == 0 or step + 1 == self.st.steps:
            tp = time.time()
            it["publish_s"] = it.get("publish_s", 0.0) + self._publisher().publish(
                op.model, step + 1, self.control.publish)
            self.rec.span("PUBLISH", 0, tp, version=step + 1, step=step)
        return True

    def _end_step(self, it: dict) -> None:
        """A train step is done: ack its rows, checkpoint, report (after the last step and at each
        checkpoint, the trained model is first written to ``RUN_DIR/final/<model>``:
        runtime/export.py)."""
        step, rows = it["step"], it.get("rows", [])
        ids = [lease.id for lease in it.get("leases", [])]
        for lid in ids:
            self._unhold(lid)
        if ids:  # the step's micro-batch leases in one store call
            self._progress += len(ids)
            self.store.ack_many(ids)
        self._stats["rows"] += len(rows)
        cols = it.get("cols") or {}
        versions = cols.get("_version") or [None] * len(rows)
        ckpt = None
        run_dir, every = self.opt.get("run_dir"), self.opt.get("checkpoint_every")
        if run_dir and every:
            from asyncflow.runtime import checkpoint

            if checkpoint.wanted(every, step + 1, self.st.steps):  # before step + 1 starts
                ckpt = checkpoint.save_engine(self.engine, run_dir, step + 1, self.id)
        exported = None
        if run_dir and self.wp.replica == 0 and (ckpt or step + 1 == self.st.steps):
            # the last step, and each checkpoint: RUN_DIR/final holds the newest trained model
            # even of a run that is killed later
            from asyncflow.runtime import export

            exported = export.write_final(self.engine, run_dir, self.plan, self.task.name, step + 1)
        self.control.report_step(self.task.name, {
            "replica": self.wp.replica, "checkpoint": ckpt, "export": exported, "step": step, "version": step + 1, "end": time.time(),
            "rows": rows, "staleness": [self.accept.staleness(step, v) for v in versions],
            "rewards": list(cols.get(self.reward) or []) if self.reward else [],
            "metrics": _plain_metrics(it.get("metrics")), "publish_s": it.get("publish_s", 0.0),
            "next_row": self._next_row(step, rows),
            "compute_s": it.get("compute_s", 0.0),
            "samples": self.sampler.take(step, cols) if self.sampler is not None else []})


def _plain_metrics(m: Any) -> dict:
    out = {}
    for k, v in (m or {}).items():
        if hasattr(v, "item"):
            try:
                v = v.item()
            except Exception:
                continue
        if isinstance(v, (int, float, str, bool)) or v is None:
            out[str(k)] = v
    return out
