"""One worker per task replica (a :class:`~asyncflow.plan.WorkerPlan`): pull, compute, push.

A worker runs its own loop and *pulls* rows from the sample store (the pull is the load
balancing between replicas); nothing is pushed to it. Its op list is the plan's
READ / COMPUTE / WRITE (+ WAIT / ADOPT / PUBLISH) body; how it runs depends on the task:

==========================  ===================================================================
loop                        used by
==========================  ===================================================================
:meth:`Worker._serve`       rollouts whose engine has ``serve(pull, emit)`` (continuous
                            batching across steps: a freed slot takes the next row at once)
:meth:`Worker._batches`     every other rollout, scorer, reward, advantage, filter, custom
:meth:`Worker._train`       train tasks: one whole step per train step, then PUBLISH
==========================  ===================================================================

Every store call moves a batch (a lease of many rows, an ack with its output columns); the
control plane (stop flag, newest weights, trace spans, busy time) is one batched ``sync`` call
every few milliseconds, never one call per sample. A gated worker (fed weights through a sync
edge) adopts the newest published version *between* requests and leases only rows its version
may start (:mod:`asyncflow.runtime.gate`). A READ that finds nothing backs off briefly.

This module imports neither Ray nor torch: the store and the control are handles whose methods
are plain calls (the Ray backend hands in proxies).
"""
from __future__ import annotations

import time
import traceback
from typing import Any

from asyncflow import kinds
from asyncflow.engines.base import EngineSpec, load_engine_class
from asyncflow.plan import Plan
from asyncflow.runtime.contract import TaskError, check_outputs
from asyncflow.runtime.gate import Gate, gates_for
from asyncflow.runtime.tasks import _accepted, runner_for
from asyncflow.runtime.trace import Recorder
from asyncflow.runtime.weights import Adopter, publish

RANK = {"sample": 0, "micro_batch": 1, "group": 2, "step": 3}


class Crash(BaseException):
    """Raised inside a worker told to crash (tests): it stops at once, acking nothing."""


class Stop(BaseException):
    """Raised inside a serve loop when the run is over: in-flight samples are abandoned."""


def engine_spec(plan: Plan, task, replica: int, paths=()) -> EngineSpec:
    """What an engine is built from. Its ``inputs``/``outputs`` are *roles* (the kinds table's
    names: prompt, response, logprobs, ...): the worker renames the store's columns to roles
    before a call and the engine's columns back to the user's fields after it."""
    model = next((m for m in plan.models if m.name == task.model), None)
    mdict = {"name": model.name, "init": model.init, "args": dict(model.args),
             "frozen": model.frozen} if model else {}
    st = plan.step
    extra = {"samples_per_prompt": st.samples_per_prompt, "prompts_per_step": st.prompts_per_step,
             "samples_per_step": st.samples_per_step, "steps": st.steps,
             # a CPU device is one CPU slot: an engine takes as many threads as it has slots, so
             # colocated engines do not oversubscribe the cores (2 threads each on 2 cores ran
             # the main job 7x slower)
             "threads": max(1, task.devices_per_replica) if plan.device_kind == "CPU" else None,
             # scorers and trainers see log-probs at the temperature the rollout sampled with
             "temperature": _rollout_temperature(plan), "search_path": list(paths)}
    env = getattr(task, "env", None)
    if env:  # a multi-turn rollout: the environment factory and the task args it accepts
        from asyncflow.refs import resolve

        extra["env"] = env
        extra["env_args"] = _accepted(resolve(env, paths), dict(task.args or {}))
    roles_in = tuple(dict.fromkeys(r for _, r in task.bind_in if r != "keep"))
    return EngineSpec(
        task=task.name, kind=task.kind, model=mdict, args=dict(task.args or {}),
        inputs=roles_in, outputs=tuple(r for _, r in task.bind_out), loss=task.loss,
        seed=plan.seed, replica=replica, replicas=task.replicas, extra=extra)


def _rollout_temperature(plan: Plan) -> float:
    for t in plan.tasks:
        if t.kind == "rollout" and "temperature" in (t.args or {}):
            return float(t.args["temperature"])
    return 1.0


def read_shape(plan: Plan, task) -> tuple[str, int]:
    """(granularity, rows per READ) of ``task``'s input channels (the coarsest one)."""
    grans = [c.granularity for c in plan.channels if c.dst == task.name] or ["sample"]
    gran = max(grans, key=lambda g: RANK.get(g, 0))
    rows = int(getattr(task, "read_rows", 0) or 0)
    if not rows:
        reads = [op.rows for w in plan.workers if w.task == task.name for op in w.ops
                 if op.kind == "READ" and op.rows]
        rows = max(reads, default=0)
    return gran, rows


class Worker:
    """The loop of one task replica; ``run()`` returns a summary dict when the run stops."""

    def __init__(self, plan: dict, worker_id: str, store, control, t0: float,
                 options: dict | None = None):
        self.plan = Plan.from_dict(plan) if isinstance(plan, dict) else plan
        self.wp = next(w for w in self.plan.workers if w.id == worker_id)
        self.task = self.plan.task(self.wp.task)
        self.id = worker_id
        self.store, self.control, self.t0 = store, control, t0
        self.opt = dict(options or {})
        self.use_ray = bool(self.opt.get("ray", False))
        self.sync_every = float(self.opt.get("sync_s", 0.01))
        self.backoff = float(self.opt.get("backoff_s", 0.005))
        self.rec = Recorder(worker_id, self.task.name, self.wp.pool)
        self.st = self.plan.step
        self.gate: Gate | None = gates_for(self.plan).get(self.task.name)
        self.models_in = sorted({s.model for s in self.plan.sync if s.dst == self.task.name})
        self.engine: Any = None
        self.adopter: Adopter | None = None
        self._crash = False
        self._stopped = False
        self._last_sync = 0.0
        self._rewards: list = []  # (rows, values) to report
        self._drops: list = []  # (rows, reason) to report
        self._stats = {"rows": 0, "leases": 0, "empty_reads": 0, "stale_dropped": 0}
        self.paths = list(self.opt.get("search_path") or ())
        # the plan's bindings: which of the store's fields is which role (never a fixed name)
        self.roles_in = [(f, r) for f, r in self.task.bind_in if r != "keep"]
        self.roles_out = [(f, r) for f, r in self.task.bind_out]
        self.out_types = [(f, kinds.ROLES[r].type if r in kinds.ROLES else "any")
                          for f, r in self.roles_out]

    # ------------------------------------------------------------------ control plane
    def kill(self) -> None:
        """Tests: crash at the next chance, leaving whatever is leased unacked."""
        self._crash = True

    def _check(self) -> None:
        if self._crash:
            raise Crash()

    def _sync(self, force: bool = False, wait_s: float = 0.0) -> bool:
        """Flush spans/busy/reports, learn the stop flag and adopt newer weights (between
        requests only). ``wait_s``: wait up to that long for a newer version if there is none
        (a gated rollout). Returns True when the run is stopping."""
        self._check()
        now = time.time()
        if not force and not wait_s and now - self._last_sync < self.sync_every:
            return self._stopped
        self._last_sync = now
        known = dict(self.adopter.known) if self.adopter else {}
        state = {"busy": self.rec.busy(), "exposed_s": self.adopter.exposed_s if self.adopter else 0.0,
                 "rewards": self._rewards, "drops": self._drops, "stats": dict(self._stats)}
        self._rewards, self._drops = [], []
        reply = self.control.sync(self.id, self.rec.drain(), state, known, wait_s)
        self._stopped = bool(reply.get("stop"))
        newer = reply.get("newer") or {}
        if newer and self.adopter is not None and not self._stopped:
            t = time.time()
            if self.adopter.adopt(newer):
                self.rec.span("ADOPT", 0, t, version=self.adopter.version)
        return self._stopped

    def _report_outputs(self, rows: list[int], cols: dict) -> None:
        if self.task.kind == "reward" and self.task.outputs:
            self._rewards.append((list(rows), list(cols[self.task.outputs[0]])))

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
        """An engine's columns (keyed by role) -> the task's output fields, checked against
        their types (a missing output, a wrong length, NaN: AF611/AF612)."""
        cols = {f: out.get(r) for f, r in self.roles_out}
        check_outputs(self.task, cols, self.out_types, list(rows))
        return cols

    # ------------------------------------------------------------------ run
    def run(self) -> dict:
        try:
            self._start()
            if self.task.kind == "train":
                self._train()
            elif self.task.kind == "rollout" and hasattr(self.engine, "serve"):
                self._serve()
            else:
                self._batches()
            status = "stopped"
        except Crash:
            return {"worker": self.id, "status": "crashed", **self._stats, **self._where()}
        except Stop:
            status = "stopped"
        except TaskError as e:  # the user's function or data: a located AF6xx error
            try:
                self.control.fail(self.id, e.payload(), traceback.format_exc())
            except Exception:
                pass
            return {"worker": self.id, "status": "failed", "error": str(e), **self._stats,
                    **self._where()}
        except Exception as e:  # reported to the driver, which stops the run
            tb = traceback.format_exc()
            try:
                self.control.fail(self.id, f"{e.__class__.__name__}: {e}", tb)
            except Exception:
                pass
            return {"worker": self.id, "status": "failed", "error": str(e), **self._stats,
                    **self._where()}
        try:
            self.rec.occupancy(0.0)
            self._sync(force=True)
        except (Crash, Exception):
            pass
        return {"worker": self.id, "status": status, **self._stats, **self._where()}

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
        return out

    def _start(self) -> None:
        t = time.time()
        if kinds.KINDS[self.task.kind].engine or self.task.engine:
            cls = load_engine_class(self.task.engine)
            self.engine = cls(engine_spec(self.plan, self.task, self.wp.replica, self.paths))
            self.compute = None
            if self.task.kind == "train" and self.opt.get("resume_dir"):  # --resume
                from asyncflow.runtime import checkpoint

                self.engine.load(checkpoint.engine_dir(self.opt["resume_dir"], self.id))
        else:
            self.compute = runner_for(self.task, self.paths)
        if self.models_in:
            self.adopter = Adopter(self.engine, self.models_in, self.use_ray)
        self.rec.span("START", 0, t)
        self._sync(force=True)

    # ------------------------------------------------------------------ gated reads
    def _max_row(self) -> int | None:
        if self.gate is None:
            return None
        return self.gate.max_row(self.adopter.version if self.adopter else 0)

    def _version(self) -> int | None:
        return self.adopter.version if self.adopter else None

    def _fresh(self, rows: list[int], version: int | None) -> list[int]:
        """Rows that may not be written with ``version`` (gate rule 3)."""
        if self.gate is None or version is None:
            return []
        return [r for r in rows if not self.gate.fresh_enough(r, version)]

    # ------------------------------------------------------------------ continuous batching
    def _serve(self) -> None:
        """A rollout engine with ``serve``: rows stream in as slots free up and out as each
        sample finishes; a lease is acked (outputs written) once all of its rows are done."""
        eng = self.engine
        slots = max(1, int(getattr(eng, "slots", 64)))
        chunk = max(int(self.opt.get("serve_chunk", 16)), self.st.samples_per_prompt)
        leases: dict[int, dict] = {}  # lease id -> {"rows", "done": {row: outputs}, ...}
        row_lease: dict[int, int] = {}
        in_flight = [0]
        last_empty = [0.0]
        lanes: list[int] = []  # lane -> 1 busy / 0 free (trace lanes of concurrent leases)
        def flush_done() -> None:
            for lid in [l for l, v in leases.items() if len(v["done"]) == len(v["rows"])]:
                v = leases.pop(lid)
                rows = v["rows"]
                cols = self._to_fields({r: [v["done"][x].get(r) for x in rows]
                                        for _, r in self.roles_out}, rows)
                versions = [v["done"][r].get("_version", v["version"]) for r in rows]
                stale = self._fresh(rows, min(versions))
                t = time.time()
                self.rec.span("COMPUTE", len(rows), v["start"], t, min(versions),
                              self.gate.step_of(rows[0]) if self.gate else None, lane=v["lane"])
                lanes[v["lane"]] = 0
                self._check()
                if stale:  # rule 3: generate again with newer weights, in place
                    self._stats["stale_dropped"] += len(stale)
                    self._drops.append((stale, "regenerated"))
                    self.store.release(lid)
                    continue
                cols["_version"] = versions
                self.store.ack(lid, cols)
                self._stats["rows"] += len(rows)
                self.rec.span("WRITE", len(rows), t, version=min(versions))

        def pull(k: int):
            if self._sync():
                raise Stop()
            flush_done()
            now = time.time()
            if now - last_empty[0] < self.backoff:
                return {}
            t = now
            lease = self.store.get(self.task.name, min(k, chunk), max_row=self._max_row())
            if lease is None:
                last_empty[0] = time.time()
                self._stats["empty_reads"] += 1
                return {}
            self._check()
            lane = lanes.index(0) if 0 in lanes else len(lanes)
            if lane == len(lanes):
                lanes.append(1)
            lanes[lane] = 1
            leases[lease.id] = {"rows": list(lease.rows), "done": {}, "start": time.time(),
                                "version": self._version(), "lane": lane}
            for r in lease.rows:
                row_lease[r] = lease.id
            in_flight[0] += len(lease.rows)
            self.rec.occupancy(min(1.0, in_flight[0] / slots))
            self._stats["leases"] += 1
            self.rec.span("READ", len(lease.rows), t, version=self._version(),
                          step=self.gate.step_of(lease.rows[0]) if self.gate else None)
            return self._to_roles(lease.columns)

        def emit(row: dict) -> None:
            self._check()
            r = int(row["_row"])
            lid = row_lease.pop(r)
            leases[lid]["done"][r] = row
            in_flight[0] -= 1
            self.rec.occupancy(min(1.0, in_flight[0] / slots))
            if len(leases[lid]["done"]) == len(leases[lid]["rows"]):
                flush_done()

        try:
            eng.serve(pull, emit)
        except Stop:
            pass

    # ------------------------------------------------------------------ batch loop
    def _read_args(self) -> dict:
        gran, rows = read_shape(self.plan, self.task)
        spp = self.st.samples_per_prompt
        # rows per call: the task's ``batch_size`` (a rollout's ``slots``), else a whole step.
        # A READ takes what is ready, up to that many rows, so the stream still flows row by
        # row; but an engine called on 64 rows costs nearly what it costs on 256 (measured:
        # hf rollout 15 ms for 64 rows, 42 ms for 256), so small fixed batches multiplied the
        # engine time of a step by up to 4 (grpo_digits: 0.205 -> 0.115 s per step)
        args = self.task.args or {}
        batch = int(args.get("batch_size", 0) or 0) or int(
            self.opt.get("batch_rows", 0) or 0) or self.st.samples_per_step
        if self.task.kind == "rollout":
            batch = int(args.get("slots", 0) or 0) or batch
        if gran == "group" and spp > 1:
            n = max(rows, spp)
            n = max(spp, (max(n, batch) // spp) * spp)
            return {"n": n, "whole_groups": True, "group_size": spp, "min_rows": spp}
        if gran in ("micro_batch",) and rows:
            return {"n": max(rows, batch), "min_rows": 1}
        return {"n": max(rows, batch) if rows else batch, "min_rows": 1}

    def _batches(self) -> None:
        gran, _ = read_shape(self.plan, self.task)
        if gran == "step":
            return self._steps()
        kw = self._read_args()
        timeout = float(self.opt.get("read_timeout_s", 0.02))
        # a gated replica (fed weights through a sync edge) waits on the weight board, not on
        # the store: the rows it may not start yet become readable only with a newer version,
        # and the board wakes it the moment the trainer publishes one (it used to sit out the
        # store's read timeout, then a backoff, then the next heartbeat: ~60 ms per step)
        gated = self.gate is not None and self.adopter is not None and bool(self.adopter.known)
        while not self._sync():
            t = time.time()
            lease = self.store.get(self.task.name, kw["n"], min_rows=kw["min_rows"],
                                   whole_groups=kw.get("whole_groups", False),
                                   group_size=kw.get("group_size", 1), max_row=self._max_row(),
                                   timeout=0.0 if gated else timeout)
            if lease is None:
                self._stats["empty_reads"] += 1
                if gated:
                    self._sync(wait_s=timeout)
                else:
                    time.sleep(self.backoff)
                continue
            self.rec.span("READ", len(lease.rows), t, version=self._version())
            self._process(lease)

    def _steps(self) -> None:
        """Step granularity (e.g. a batch-scope advantage): replica r takes steps r, r+R, ..."""
        sps = self.st.samples_per_step
        step = int(self.opt.get("start_step", 0)) + self.wp.replica  # resumed: from the cursor
        while step < self.st.steps and not self._sync():
            lo, hi = step * sps, (step + 1) * sps
            alive = sps - self.control.dropped_rows(lo, hi)
            if alive <= 0:
                step += self.task.replicas
                continue
            t = time.time()
            lease = self.store.get(self.task.name, sps, min_rows=alive, max_row=hi,
                                   filter_fn=_AtLeast(lo) if lo and self.task.replicas > 1 else None,
                                   timeout=float(self.opt.get("read_timeout_s", 0.05)))
            if lease is None:
                continue
            self.rec.span("READ", len(lease.rows), t, version=self._version(), step=step)
            self._process(lease, step)
            step += self.task.replicas

    def _process(self, lease, step: int | None = None) -> None:
        cols_in = lease.columns
        version = self._version()
        t = self.rec.compute_begin()
        keep = None
        rows = list(lease.rows)
        if self.compute is not None:
            out, keep = self.compute(cols_in)
            cols = {f: out.get(f) for f in self.task.outputs}
            check_outputs(self.task, cols, self.out_types, rows)
        else:
            call = self.engine.generate if self.task.kind == "rollout" else self.engine.logprobs
            cols = self._to_fields(call(self._to_roles(cols_in)), rows)
        end = self.rec.compute_end()
        self._check()
        if step is None and self.gate is not None:
            step = self.gate.step_of(rows[0])
        self.rec.span("COMPUTE", len(rows), t, end, version, step)
        cols = {o: list(v) for o, v in cols.items()}
        if self.task.kind == "rollout":
            stale = self._fresh(rows, version)
            if stale:  # gate rule 3: regenerate in place with newer weights
                self._stats["stale_dropped"] += len(stale)
                self._drops.append((stale, "regenerated"))
                self.store.release(lease.id)
                return
            cols["_version"] = [version if version is not None else 0] * len(rows)
        if keep is not None:
            gone = [r for r, k in zip(rows, keep) if not k]
            if gone:  # drop before the ack: no downstream task may see them
                self.store.drop(gone, self.task.name)
                self.control.note_drops(gone, "filter")
        self.store.ack(lease.id, cols)
        self._stats["rows"] += len(rows)
        self._stats["leases"] += 1
        self._report_outputs(rows, cols)
        self.rec.span("WRITE", len(rows), end, version=version, step=step)

    # ------------------------------------------------------------------ train
    def _train(self) -> None:
        """Train step n consumes exactly the rows of step n (whole, by row index), checks
        their staleness (gate rule 4), trains, acks, publishes version n + 1."""
        sps, steps = self.st.samples_per_step, self.st.steps
        alpha = max((s.max_staleness for s in self.plan.sync if s.src == self.task.name), default=0)
        gate = Gate(int(alpha), sps, steps)
        model = next((m.name for m in self.plan.models if m.updated_by == self.task.name),
                     self.task.model)
        publishes = any(s.src == self.task.name for s in self.plan.sync)
        # the reward column rides along (for the step's reward_mean): the field a reward task
        # writes as its reward, else a multi-turn rollout's episode return (bind pass roles)
        reward = next((f for t in sorted(self.plan.tasks, key=lambda t: t.kind != "reward")
                       for f, r in t.bind_out if r == "reward"), None)
        extra = [reward] if reward and reward not in self.task.inputs else []
        fields = list(self.task.inputs) + extra if extra else None
        step = int(self.opt.get("start_step", 0))
        timeout = float(self.opt.get("train_read_timeout_s", 0.05))
        if step and publishes and model:  # resumed: rollouts start from the checkpoint's weights
            publish(self.engine, model, step, self.use_ray, self.control.publish)
        ckpt_every, run_dir = self.opt.get("checkpoint_every"), self.opt.get("run_dir")
        while step < steps:
            if self._sync():
                return
            lo, hi = gate.rows_of(step).start, gate.rows_of(step).stop
            alive = sps - self.control.dropped_rows(lo, hi)
            t = time.time()
            lease = None
            if alive > 0:
                lease = self.store.get(self.task.name, sps, min_rows=alive, max_row=hi,
                                       timeout=timeout, lease_s=3600.0, fields=fields)
                if lease is None:
                    continue
                self._check()
                versions = lease.columns.get("_version") or [None] * len(lease.rows)
                bad = [r for r, v in zip(lease.rows, versions) if not gate.accepts(step, v)]
                if bad:  # rule 4: drop, count, read the step again without them
                    self.store.drop(bad, "staleness")
                    self.control.note_drops(bad, "staleness")
                    self.store.release(lease.id)
                    continue
                self.rec.span("READ", len(lease.rows), t, version=step, step=step)
            rows = list(lease.rows) if lease else []
            versions = (lease.columns.get("_version") or [None] * len(rows)) if lease else []
            staleness = [gate.staleness(step, v) for v in versions]
            batch = dict(lease.columns) if lease else {}
            rewards = list(batch.get(reward) or []) if reward else []
            batch = self._to_roles(batch)
            t = self.rec.compute_begin()
            metrics = self.engine.train_step(batch) if rows else {}
            end = self.rec.compute_end()
            self._check()
            self.rec.span("COMPUTE", len(rows), t, end, step, step)
            # publish before anything else: the gated rollout waits for exactly this version
            exposed = 0.0
            every = max((int(getattr(s, "publish_every", 1) or 1) for s in self.plan.sync
                         if s.src == self.task.name), default=1)
            if publishes and model and ((step + 1) % every == 0 or step + 1 == steps):
                tp = time.time()
                exposed = publish(self.engine, model, step + 1, self.use_ray, self.control.publish)
                self.rec.span("PUBLISH", 0, tp, version=step + 1, step=step)
            if lease:
                self.store.ack(lease.id)
            self._stats["rows"] += len(rows)
            ckpt = None
            if run_dir and ckpt_every:
                from asyncflow.runtime import checkpoint

                if checkpoint.wanted(ckpt_every, step + 1, steps):  # before step + 1 starts
                    ckpt = checkpoint.save_engine(self.engine, run_dir, step + 1, self.id)
            self.control.report_step(self.task.name, {"checkpoint": ckpt,
                "step": step, "version": step + 1, "end": time.time(), "rows": rows,
                "staleness": staleness, "rewards": rewards, "metrics": _plain_metrics(metrics),
                "publish_s": exposed, "compute_s": end - t})
            step += 1
        self._sync(force=True)


class _AtLeast:
    """A picklable row filter: rows with index >= lo."""

    def __init__(self, lo: int):
        self.lo = lo

    def __call__(self, r: dict) -> bool:
        return r["_row"] >= self.lo


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
