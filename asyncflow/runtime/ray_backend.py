"""The ``ray`` backend: one actor per process of the plan (:class:`WorkerProcess`; the workers
that time-share a device share one) placed on the plan's placement-group bundles
(:mod:`asyncflow.runtime.placement`), a :class:`~asyncflow.runtime.store.ray.RayStore` and a
:class:`~asyncflow.runtime.control.Control` actor. Ray is imported when a backend is made
(:func:`~asyncflow.runtime.ray_connect.ensure_ray`), never by importing this module.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any

from asyncflow.plan import Plan
from asyncflow.runtime.control import ActorProxy, Control, ControlLost
from asyncflow.runtime.options import DEFAULT_CALL_TIMEOUT_S, RunOptions
from asyncflow.runtime.placement import (check_feasible, cpu_cores, device_groups, pin,
                                         process_resources)
from asyncflow.runtime.ray_connect import ensure_ray
from asyncflow.runtime.worker import Worker

log = logging.getLogger(__name__)

KILL_WAIT_S = 30.0  # how long a kill waits for the actor's death to show (it takes ms idle)


class WorkerProcess:
    """A Ray actor that is one process of the plan (placement rule 6: the workers that
    time-share a device share one): each of its workers
    (:class:`asyncflow.runtime.worker.Worker`) runs ``run()`` on a thread of its own, as the
    local backend runs all of them; a second thread per worker answers ``stack()``."""

    def __init__(self, cores, call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S):
        if cores:
            pin(cores)
        self.workers: dict = {}
        self.call_timeout_s = call_timeout_s

    def run(self, plan_dict, wid, store, control_handle, t0, options) -> dict:
        w = None
        try:
            w = Worker(plan_dict, wid, store, ActorProxy(control_handle, self.call_timeout_s), t0,
                       {**options, "ray": True})
            self.workers[wid] = w
            return w.run()
        except BaseException as e:  # the loop died of anything but a crash of the process
            return {"worker": wid, "status": "died",
                    "error": f"{e.__class__.__name__}: {e}", "op": w.op if w else "START"}

    def stack(self, wid: str) -> str:
        w = self.workers.get(wid)
        return w.stack() if w is not None else ""


class RayBackend:
    """One actor per process of the plan (the workers time-sharing a device share one) on its
    pool's placement group; RayStore; a Control actor."""

    name = "ray"
    use_ray = True

    def __init__(self, options: RunOptions | None = None):
        self.options = o = options or RunOptions(backend="ray")
        self.ray, self.owns_ray = ensure_ray(o.address, full=o.ray_full)
        # pin workers to cores on a local single-node cluster only: on a cluster the core ids
        # of one node say nothing of another's
        self.pin = o.address is None and len(self.ray.nodes()) == 1
        self.lease_s = o.lease_s
        self.shards = o.shards
        self.actors: dict[str, Any] = {}
        self.refs: dict[str, Any] = {}
        self.results: dict[str, dict] = {}
        self.pgs: dict[str, Any] = {}
        # (pool, device) -> (its Ray bundle's index, that bundle's resources): device_groups
        self._ray_bundle: dict[tuple[str, int], tuple[int, dict]] = {}
        self._scale = 1.0  # CPU slots scaled to fit the cluster (_placement_groups)
        self._store = None
        self._control = None
        self._make_args: dict[str, tuple] = {}
        self.hosts: dict[str, Any] = {}  # process -> its actor (placement rule 6)
        self._host_args: dict[str, tuple] = {}
        self._proc_of: dict[str, str] = {}  # worker -> process

    def make_store(self, plan):
        from asyncflow.runtime.store.ray import RayStore

        sps, spp = plan.step.samples_per_step, plan.step.samples_per_prompt
        chunk = sps * max(1, 512 // sps) if sps % spp == 0 else spp * max(1, 512 // spp)
        self._store = RayStore(shards=self.shards, lease_s=self.lease_s, chunk=chunk,
                               call_timeout_s=self.options.call_timeout_s)
        return self._store

    def make_control(self):
        handle = self.ray.remote(Control).options(num_cpus=0, max_concurrency=32).remote()
        self._control = handle
        return handle, ActorProxy(handle, timeout_s=self.options.call_timeout_s)

    def _placement_groups(self, plan) -> None:
        """One placement group per pool, with the pool's bundles; CPU-slot bundles are scaled
        down to fit the cluster when the plan asks for more CPU slots than it has (sim)."""
        from ray.util.placement_group import placement_group

        check_feasible(plan, [n.get("Resources", {}) for n in self.ray.nodes() if n.get("Alive")])
        total = self.ray.cluster_resources().get("CPU", 1.0)
        demand = sum(float(b.resources.get("CPU", 0)) for p in plan.pools for b in p.bundles)
        scale = min(1.0, 0.9 * total / demand) if demand else 1.0
        self._scale = scale
        for pool in plan.pools:
            bundles = []
            groups = device_groups(plan, pool)
            for g, members in enumerate(groups):
                res: dict = {}
                for i in members:  # a Ray bundle per group of devices a process holds whole
                    for k, v in pool.bundles[i].resources.items():
                        if float(v) > 0:
                            res[k] = res.get(k, 0.0) + float(v)
                if "CPU" in res:
                    res["CPU"] = max(0.01, math.floor(res["CPU"] * scale * 100) / 100)
                bundles.append(res or {"CPU": 0.01})
                for i in members:
                    self._ray_bundle[(pool.name, i)] = (g, res)
            if not bundles:
                continue
            pg = placement_group(bundles, strategy="PACK", name="")
            try:
                self.ray.get(pg.ready(), timeout=self.options.pg_timeout_s)
            except self.ray.exceptions.GetTimeoutError:
                raise ControlLost(f"pool {pool.name!r}: Ray did not place its bundles {bundles} "
                                  "within the time limit (the cluster lacks the resources)") from None
            self.pgs[pool.name] = pg

    def start(self, plan_dict: dict, worker_ids: list[str], store, control, t0: float,
              options: dict) -> None:
        """One actor per process of the plan (``WorkerPlan.process``), on the bundle of its
        workers' device; then each worker's ``run`` on its process's actor."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        plan = Plan.from_dict(plan_dict)
        self._placement_groups(plan)
        cls = self.ray.remote(WorkerProcess)
        plan_ref = self.ray.put(plan_dict)
        cores = cpu_cores(plan, int(self.ray.cluster_resources().get("CPU", 0)) if self.pin
                          else 0)
        per = options.get("per_worker", {})
        procs: dict[str, list] = {}
        for wid in worker_ids:
            wp = plan.worker(wid)
            procs.setdefault(wp.process or wid, []).append(wp)
        for proc, wps in procs.items():
            # per worker two threads: run() and a bounded stack() call (the watchdog's), and
            # room for a restarted worker's run() beside the others
            opts: dict = {"num_cpus": 0, "max_concurrency": 2 * len(wps) + 2}
            pg = self.pgs.get(wps[0].pool or "")
            if pg is not None:
                idx, bundle = self._ray_bundle.get((wps[0].pool, wps[0].bundles[0]), (-1, {})) \
                    if wps[0].bundles else (-1, {})
                opts.update(process_resources(wps, bundle, self._scale))
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=idx)
            self._host_args[proc] = (cls, opts, cores.get(wps[0].id))
            self._new_host(proc)
            for wp in wps:
                self._proc_of[wp.id] = proc
                self._make_args[wp.id] = (plan_ref, store, control, t0, cores.get(wp.id))
                self._launch(wp.id, per.get(wp.id, options))

    def _new_host(self, proc: str) -> None:
        cls, opts, cores = self._host_args[proc]
        self.hosts[proc] = cls.options(**opts).remote(cores, self.options.call_timeout_s)

    def _launch(self, wid: str, options: dict) -> None:
        plan_ref, store, control, t0, cores = self._make_args[wid]
        wopts = {**options, "cpu_affinity": cores} if cores else options
        host = self.hosts[self._proc_of[wid]]
        self.actors[wid] = host
        self.refs[wid] = host.run.remote(plan_ref, wid, store, control, t0, wopts)

    def restart(self, wid: str, options: dict) -> None:
        """A new worker for ``wid``, which ended. When the process is gone (killed, crashed:
        every worker in it ends), the first of its workers to restart starts a new one on the
        same bundle and the others join it; a worker alone in its process gets a new one too
        (fresh process-wide state, e.g. vLLM's). Only a worker whose thread died beside live
        ones restarts in the process it was in."""
        proc = self._proc_of[wid]
        old = self.actors.get(wid)
        alone = sum(1 for p in self._proc_of.values() if p == proc) == 1
        gone = self.results.get(wid, {}).get("status") != "died"
        if (gone or alone) and self.hosts.get(proc) is old:
            self._quietly(f"killing {wid}'s old process", self.ray.kill, old, no_restart=True)
            self._new_host(proc)
        self._launch(wid, options)
        self.results.pop(wid, None)

    def stack(self, wid: str, timeout: float = 5.0) -> str:
        """The worker's Python stack, asked of its process's actor with a bounded call."""
        try:
            return self.ray.get(self.actors[wid].stack.remote(wid), timeout=timeout)
        except Exception as e:
            return f"(its stack could not be read: {e.__class__.__name__})"

    def kill_actor(self, target: str) -> None:
        """``control`` or ``store[/N]`` (a shard): killed (fault injection)."""
        if target == "control":
            self.ray.kill(self._control, no_restart=True)
            return
        idx = int(target.partition("/")[2] or 0)
        self.ray.kill(self._store.shard_handle(idx), no_restart=True)

    def _poll(self) -> None:
        pending = {ref: wid for wid, ref in self.refs.items() if wid not in self.results}
        if not pending:
            return
        done, _ = self.ray.wait(list(pending), num_returns=len(pending), timeout=0)
        for ref in done:
            wid = pending[ref]
            try:
                self.results[wid] = self.ray.get(ref, timeout=self.options.call_timeout_s)
            except Exception as e:  # the actor died (killed, crashed process)
                self.results[wid] = {"worker": wid, "status": "crashed",
                                     "error": f"{e.__class__.__name__}: {str(e).splitlines()[0][:200]}"}

    def alive(self, wid: str) -> bool:
        self._poll()
        return wid in self.refs and wid not in self.results

    def finished(self) -> dict[str, dict]:
        self._poll()
        return dict(self.results)

    def kill(self, wid: str, wait_s: float = KILL_WAIT_S) -> None:
        """Kill ``wid``'s process (every worker in it dies: a device's colocated workers go
        together) and wait (bounded) until its death is seen: ``ray.kill`` only
        asks the raylet, and on a loaded machine the process can outlive the rest of a short
        run, so the death would never reach the supervisor (a kill that did nothing)."""
        self.ray.kill(self.actors[wid], no_restart=True)
        ref = self.refs.get(wid)
        if ref is not None and wid not in self.results:
            self.ray.wait([ref], timeout=wait_s)
            self._poll()

    def join(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            self._poll()
            if len(self.results) == len(self.refs):
                return
            time.sleep(0.02)

    def shutdown(self, keep_ray: bool = False) -> None:
        """Kill every actor of the run, remove its placement groups; stop the Ray this run
        started (unless ``keep_ray``: a restart of the run follows). Teardown goes on past a
        failed step, which is logged with what it may leave behind."""
        from ray.util.placement_group import remove_placement_group

        for a in {id(a): a for a in [*self.hosts.values(), *self.actors.values()]}.values():
            self._quietly("killing a worker process", self.ray.kill, a, no_restart=True)
        if self._control is not None:
            self._quietly("killing the control actor", self.ray.kill, self._control,
                          no_restart=True)
        if self._store is not None:
            self._quietly("killing the store shards", self._store.shutdown)
        for name, pg in self.pgs.items():
            self._quietly(f"removing pool {name!r}'s placement group", remove_placement_group, pg)
        if self.owns_ray and not keep_ray:  # the Ray this run started goes with it (no process left behind)
            self._quietly("stopping the local Ray", self.ray.shutdown)

    @staticmethod
    def _quietly(what: str, fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - teardown goes on; what is left is logged
            log.warning("shutdown: %s failed (%s: %s); it may outlive the run", what,
                        e.__class__.__name__, e)
