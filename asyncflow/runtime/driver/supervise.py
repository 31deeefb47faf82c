"""The driver's watch over the workers of one run: start-up (:meth:`Supervisor.wait_ready`),
deaths and restarts (:meth:`Supervisor.supervise`; a train worker's death restarts the run from
its newest checkpoint, :class:`Restart`), the watchdog (AF630), kills asked for by tests and by
``--inject``, and ``RUN_DIR/workers.json`` (where each worker ran; its end).
"""
from __future__ import annotations

import json
import logging
import os
import time

from asyncflow.compiler.kinds import rules_of
from asyncflow.plan import Plan
from asyncflow.runtime.control import ControlLost
from asyncflow.runtime.faults import RunError, by_worker, fault, is_actor, lost, worker_error
from asyncflow.runtime.store import StoreLost

log = logging.getLogger(__name__)


class Restart(Exception):
    """A train worker died and the run has checkpoints: restart it from the newest one."""

    def __init__(self, worker: str, cause: str, t: float):
        super().__init__(worker)
        self.worker, self.cause, self.time = worker, cause, t


class Supervisor:
    """One run's workers on backend ``be`` (``store``, control ``ctl``). ``events`` and
    ``restarts`` are the driver's (they outlive a restart of the run)."""

    def __init__(self, plan: Plan, be, store, ctl, *, options: dict, events: list,
                 restarts: dict, max_restarts: int | None, stall_timeout: float,
                 checkpoint_every: int | None, out_dir: str | None, poll_s: float):
        self.plan, self.be, self.store, self.ctl = plan, be, store, ctl
        self.options, self.events, self.restarts = options, events, restarts
        self.max_restarts, self.stall_timeout = max_restarts, stall_timeout
        self.checkpoint_every, self.out_dir, self.poll_s = checkpoint_every, out_dir, poll_s
        self.started = False
        self.status: dict[str, str] = {w.id: "starting" for w in plan.workers}
        self.beats: dict = {}
        self.deferred: Restart | None = None  # a train worker's death, raised next turn
        self.watch = {"t": time.time(), "key": None, "beat_t": 0.0}

    # -- kills --------------------------------------------------------------------------------
    def kill_requested(self, requests: list[str], record: bool = True) -> None:
        """Crash the workers asked for (``Driver.kill``), taking them off ``requests``."""
        for wid in requests[:]:
            requests.remove(wid)
            if record:
                self.events.append({"t": time.time(), "event": "kill", "worker": wid})
            self.be.kill(wid)

    def inject_kills(self, inject: list[dict], fired: set, step: int, t0: float) -> None:
        """``kill@Ns`` faults that are due and every ``kill`` of an actor: the worker's process
        (Ray: ``ray.kill``; local: the thread stops at its next op boundary, acking nothing) or
        the actor. A ``kill@stepN`` of a worker is the worker's own
        (:func:`~asyncflow.runtime.faults.by_worker`). ``fired``: the faults done (by index)."""
        now = time.time()
        for i, f in enumerate(inject):
            if f["kind"] != "kill" or by_worker(f) or i in fired:
                continue
            due = (step >= f["at_step"]) if f["at_step"] is not None else (now - t0 >= f["at_s"])
            if not due:
                continue
            fired.add(i)
            self.events.append({"t": now, "event": "kill", "worker": f["target"], "spec": f["spec"]})
            if is_actor(f["target"]):
                self.be.kill_actor(f["target"])
            else:
                self.be.kill(f["target"])

    # -- start-up -----------------------------------------------------------------------------
    def wait_ready(self, kill_requests: list[str]) -> None:
        """Until every worker has built its engine and synced once (start-up is not a step)."""
        ctl = self.ctl
        ids = {w.id for w in self.plan.workers}
        limit = time.time() + float(self.options.get("start_timeout_s", 300.0))
        while time.time() < limit:
            self.kill_requested(kill_requests, record=False)
            try:
                seen = set(ctl.collect_seen())
            except Exception as e:
                raise lost("control actor", e) from None
            if ids <= seen:
                self.status = {w: "running" for w in self.status}
                return
            errors = ctl.errors()
            if errors:
                wid, msg, tb = errors[0]
                raise worker_error(wid, msg, tb)
            try:
                self.supervise()
            except StoreLost as e:
                raise lost("sample store", e) from None
            time.sleep(self.poll_s)
        raise RunError("workers did not start within the start-up timeout")

    # -- deaths and restarts ------------------------------------------------------------------
    def supervise(self, defer: bool = False) -> None:
        """A worker that died (its process, its thread, out of memory) is known at once: its
        leases are revoked, and it is restarted (``max_restarts``) with the current weights; a
        train worker restarts the run from the newest checkpoint (:class:`Restart`; ``defer``:
        kept in :attr:`deferred` for the run loop to raise one turn later)."""
        be = self.be
        fin = be.finished()
        if not fin:
            return
        for wid, res in sorted(fin.items()):
            status = res.get("status")
            if status in ("stopped", "failed") or self.status.get(wid) == "dead":
                continue
            now = time.time()
            cause = res.get("error") or status
            self.store.revoke(wid)  # its rows are eligible again now, not when the leases expire
            self.events.append({"t": now, "event": "died", "worker": wid, "cause": cause})
            task = self.plan.task(wid.partition("/")[0])
            if self.max_restarts is None:  # no restarts: the run goes on while a replica lives
                self.status[wid] = "dead"
                self.check_workers()
                self.write_workers()
                continue
            if rules_of(task.kind).trains:
                self.status[wid] = "dead"
                if not self.checkpoint_every:
                    raise fault("AF633", worker=wid, task=task.name, cause=cause)
                if defer:  # the run loop raises it after one more collect (see there)
                    self.deferred = Restart(wid, cause, now)
                    return
                raise Restart(wid, cause, now)
            n = self.restarts.get(wid, 0)
            if n >= self.max_restarts:
                self.status[wid] = "dead"
                raise fault("AF631", worker=wid, task=task.name, times=n + 1,
                            max_restarts=self.max_restarts, cause=cause)
            self.restarts[wid] = n + 1
            try:
                self.ctl.forget(wid)
            except Exception as e:
                raise lost("control actor", e) from None
            opts = {k: v for k, v in self.options.items() if k != "per_worker"}
            be.restart(wid, {**opts, "restarted": True})
            self.status[wid] = "restarted"
            self.events.append({"t": time.time(), "event": "restart", "worker": wid})
            self.write_workers()

    def check_workers(self) -> None:
        """Every task still needs a live replica (a crashed one's leases are re-issued)."""
        fin = self.be.finished()
        if not fin:
            return
        for t in self.plan.tasks:
            ids = [w.id for w in self.plan.workers if w.task == t.name]
            if ids and all(i in fin for i in ids) and any(fin[i].get("status") != "stopped" for i in ids):
                gone = ", ".join(f"{i}: {fin[i].get('status')}" for i in ids)
                raise RunError(f"every replica of task {t.name!r} is gone ({gone})")

    def alive(self, wid: str) -> bool:
        """Whether worker ``wid`` is starting, running or restarted (not dead or gone)."""
        return self.status.get(wid) in ("running", "starting", "restarted")

    # -- watchdog -----------------------------------------------------------------------------
    def watchdog(self) -> None:
        """No step finished and no worker made progress for ``stall_timeout`` s, or a worker's
        heartbeat stopped that long: end the run naming the worker, its task, its op and its
        stack (never a silent freeze)."""
        be, watch, limit = self.be, self.watch, self.stall_timeout
        now = time.time()
        if now - watch["beat_t"] < min(1.0, limit / 4):
            return
        watch["beat_t"] = now
        try:
            beats = self.ctl.beats()
        except Exception as e:
            raise lost("control actor", e) from None
        self.beats = beats
        key = tuple(sorted((w, b.get("progress", 0)) for w, b in beats.items()))
        if key != watch["key"]:
            watch["key"], watch["t"] = key, now
        fin = be.finished()
        live = {w: b for w, b in beats.items() if w not in fin}
        silent = [(now - b["received"], w) for w, b in live.items() if now - b["received"] > limit]
        if not silent and now - watch["t"] <= limit:
            return
        if silent:
            age, wid = max(silent)
            b = live[wid]
            more = f"; its heartbeat stopped {age:.1f} s ago (the process is frozen or gone)"
        else:
            busy = [w for w, b in live.items() if b.get("op") not in ("READ", "WAIT")]
            pool = busy or list(live) or list(beats)
            if not pool:
                raise fault("AF630", seconds=limit, worker="?", task="?", op="?", op_s=0.0, more="")
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
        raise fault("AF630", seconds=limit, worker=wid, task=wid.partition("/")[0],
                    op=b.get("op", "?"), op_s=now - float(b.get("op_since", now)), more=more,
                    details=stack)

    # -- RUN_DIR/workers.json -----------------------------------------------------------------
    def workers_info(self) -> dict:
        """Every worker: task, pool, process (placement rule 6), host, pid, node, cores (from its
        heartbeat or its end), restarts, status."""
        fin = self.be.finished() if self.started else {}
        out = {}
        for w in self.plan.workers:
            beat = self.beats.get(w.id, {})
            info = {"task": w.task, "pool": w.pool, "process": w.process or w.id,
                    **(beat.get("where") or {})}
            res = fin.get(w.id)
            if res:
                info.update(res)
            info["restarts"] = self.restarts.get(w.id, 0)
            info["status"] = res.get("status") if res else self.status.get(w.id, "starting")
            out[w.id] = info
        return out

    def write_workers(self, workers: dict | None = None) -> None:
        """``RUN_DIR/workers.json``, atomically (tmp + rename): live during the run."""
        if not self.out_dir:
            return
        if not self.beats:
            try:
                self.beats = self.ctl.beats()
            except ControlLost as e:
                log.warning("workers.json: the workers' heartbeats are lost with the control "
                            "actor (%s); their hosts and pids are not recorded", e)
        workers = workers if workers is not None else self.workers_info()
        path = os.path.join(self.out_dir, "workers.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(workers, f, indent=1, sort_keys=True, default=str)
        os.replace(tmp, path)
