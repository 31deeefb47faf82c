"""Where workers run: ``local`` (threads in this process, :class:`SampleStore`) or ``ray``
(one actor per process of the plan -- the workers that time-share a device share one -- placed on
the plan's placement-group bundles, :class:`RayStore`).

Both backends hand every worker the same three things: the plan (plain data), a store handle
and a control handle. :class:`Control` is the run's small control plane -- the stop flag, the
weight board, the trace spans, busy time, step reports and drop counts -- reached through one
batched ``sync`` call per worker every few milliseconds. On Ray it is a threaded actor and the
workers talk to it through :class:`ActorProxy` (a method call = one remote call + get).
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from typing import Any

from asyncflow.errors import AsyncflowError
from asyncflow.runtime.weights import WeightBoard


class Control:
    """The run's control plane (thread-safe; a Ray actor on the ray backend)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.board = WeightBoard()
        self._stop = False
        self._spans: list = []
        self._reports: list[tuple[str, dict]] = []
        self._busy: dict[str, float] = {}
        self._exposed: dict[str, float] = {}
        self._stats: dict[str, dict] = {}
        self._rewards: list = []
        self._events: list = []  # run events from workers (an injected kill, when it struck)
        self._drop_log: list[tuple[float, int, str]] = []  # (time, rows, reason)
        self._removed: set[int] = set()  # rows dropped from the store
        self._removals: list[tuple[list[int], str]] = []  # every note_drops, in order
        self._cursor: dict[str, int] = {}  # worker -> how many removals it has been told of
        self._chosen: dict[int, list[int]] = {}  # step -> the rows the primary trainer took
        self._errors: list[tuple[str, str, str]] = []
        self._seen: dict[str, float] = {}
        self._beats: dict[str, dict] = {}  # worker -> its last heartbeat (op, since, progress)
        self._meet: dict[str, dict] = {}  # rendezvous key -> the first offer (rendezvous)

    def beat(self, worker: str, info: dict) -> dict:
        """A worker's liveness heartbeat (from its heartbeat thread, also while it computes);
        ``where`` comes with the first only and is kept."""
        with self._lock:
            where = (self._beats.get(worker) or {}).get("where")
            self._beats[worker] = {**({"where": where} if where else {}), **info,
                                   "received": time.time()}
            return {"stop": self._stop}

    def beats(self) -> dict:
        with self._lock:
            return {w: dict(b) for w, b in self._beats.items()}

    def rendezvous(self, key: str, offer: dict | None = None) -> dict | None:
        """A group's meeting point (a data-parallel trainer's ``MASTER_ADDR``/``MASTER_PORT``):
        the first offer for ``key`` is kept and returned to everyone who asks; None until one
        is made. A restarted group offers under a new key."""
        with self._lock:
            if offer is not None and key not in self._meet:
                self._meet[key] = dict(offer)
            got = self._meet.get(key)
            return dict(got) if got is not None else None

    def forget(self, worker: str) -> None:
        """A worker is restarted: its old heartbeat no longer speaks for it."""
        with self._lock:
            self._beats.pop(worker, None)

    # -- workers -----------------------------------------------------------------------------
    def sync(self, worker: str, spans: list, state: dict, known: dict,
             wait_s: float = 0.0) -> dict:
        """A worker's heartbeat: its spans and state in; the stop flag, the newer weights and
        the rows removed from the store since its last sync (``dropped``: ``(rows, reason)``
        pairs: a rollout cancels them in flight, a trainer's window skips them) out.
        ``wait_s`` > 0: wait up to that long for a newer version when there is none yet (a
        rollout the staleness gate holds back)."""
        with self._lock:
            self._spans.extend(spans)
            self._busy[worker] = float(state.get("busy", 0.0))
            self._exposed[worker] = float(state.get("exposed_s", 0.0))
            self._stats[worker] = state.get("stats", {})
            self._seen[worker] = time.time()
            self._rewards.extend(state.get("rewards", ()))
            self._events.extend(state.get("events", ()))
            for rows, reason in state.get("drops", ()):
                self._drop_log.append((time.time(), len(rows), reason))
            stop = self._stop
            seen = self._cursor.get(worker, 0)
            dropped = self._removals[seen:]
            self._cursor[worker] = len(self._removals)
        newer = self.board.newer(known, 0.0 if stop else wait_s) if known else {}
        return {"stop": stop or self._stop, "newer": newer, "dropped": dropped}

    def publish(self, model: str, version: int, box: list) -> None:
        self.board.publish(model, version, box)

    def report_step(self, task: str, report: dict) -> None:
        with self._lock:
            self._reports.append((task, report))

    def note_drops(self, rows: list[int], reason: str) -> None:
        """Rows removed from the store (a filter, staleness, a redundant group cancelled): every
        worker hears of them at its next sync."""
        rows = [int(r) for r in rows]
        with self._lock:
            self._removed.update(rows)
            self._removals.append((rows, reason))
            self._drop_log.append((time.time(), len(rows), reason))

    def choose(self, step: int, rows: list[int]) -> None:
        """The primary trainer's rows of ``step`` (first_ready, redundancy): the other train
        tasks train exactly these."""
        with self._lock:
            self._chosen[int(step)] = [int(r) for r in rows]

    def chosen(self, step: int) -> list[int] | None:
        with self._lock:
            return self._chosen.get(int(step))

    def dropped_rows(self, lo: int, hi: int) -> int:
        with self._lock:
            return sum(1 for r in self._removed if lo <= r < hi)

    def fail(self, worker: str, message: str, tb: str) -> None:
        with self._lock:
            self._errors.append((worker, message, tb))
            self._stop = True
        self.board.wake()

    # -- driver ------------------------------------------------------------------------------
    def collect_seen(self) -> list[str]:
        with self._lock:
            return list(self._seen)

    def errors(self) -> list:
        with self._lock:
            return list(self._errors)

    def stop(self) -> None:
        with self._lock:
            self._stop = True
        self.board.wake()

    def stopped(self) -> bool:
        return self._stop

    def version(self, model: str) -> int:
        return self.board.version(model)

    def collect(self) -> dict:
        """Everything new since the last collect (spans, reports, rewards, drops), and the
        current busy / exposed-sync integrals of every worker."""
        with self._lock:
            out = {"spans": self._spans, "reports": self._reports, "rewards": self._rewards,
                   "drops": self._drop_log, "errors": list(self._errors),
                   "busy": dict(self._busy), "exposed": dict(self._exposed),
                   "stats": dict(self._stats), "events": self._events, "time": time.time()}
            self._spans, self._reports, self._rewards, self._drop_log = [], [], [], []
            self._events = []
            return out


#: the longest any call to the control actor may take (plus the call's own wait) before the
#: control counts as lost: no call of the runtime waits on an actor without a bound
CALL_TIMEOUT_S = float(os.environ.get("ASYNCFLOW_CALL_TIMEOUT_S", "120"))
KILL_WAIT_S = 30.0  # how long a kill waits for the actor's death to show (it takes ms idle)


class ControlLost(AsyncflowError):
    """The control actor died or did not answer within its bound."""


class ActorProxy:
    """Calls an actor's methods synchronously: ``proxy.m(*a)`` is ``ray.get(h.m.remote(*a))``,
    bounded by ``timeout_s`` (+ a ``wait_s`` argument's wait); a dead or silent actor is
    :class:`ControlLost`."""

    def __init__(self, handle, timeout_s: float | None = None, what: str = "control actor"):
        self._h = handle
        self._timeout = CALL_TIMEOUT_S if timeout_s is None else float(timeout_s)
        self._what = what

    def __getattr__(self, name: str):
        import ray

        method = getattr(self._h, name)

        def call(*a, **k):
            limit = self._timeout + float(k.get("wait_s") or 0)  # a call that waits says so
            try:
                return ray.get(method.remote(*a, **k), timeout=limit)
            except ray.exceptions.GetTimeoutError:
                raise ControlLost(f"the {self._what} did not answer {name}() within {limit:.0f} s") from None
            except ray.exceptions.RayActorError as e:
                raise ControlLost(f"the {self._what} died ({str(e).splitlines()[0][:200]})") from None
        return call

    def __reduce__(self):
        return (ActorProxy, (self._h, self._timeout, self._what))


# ---------------------------------------------------------------------------------------- local
class LocalBackend:
    """Every worker is a thread of this process; the store is an in-process SampleStore."""

    name = "local"
    use_ray = False

    def __init__(self, lease_s: float = 60.0, **_: Any):
        self.lease_s = lease_s
        self.workers: dict[str, Any] = {}
        self.threads: dict[str, threading.Thread] = {}
        self.results: dict[str, dict] = {}

    def make_store(self, plan):
        from asyncflow.runtime.store import SampleStore

        return SampleStore(self.lease_s)

    def make_control(self) -> tuple[Any, Any]:
        c = Control()
        return c, c  # (what workers get, what the driver calls)

    def start(self, plan_dict: dict, worker_ids: list[str], store, control, t0: float,
              options: dict) -> None:
        self._args = (plan_dict, store, control, t0)
        self._check_devices(plan_dict)
        for wid in worker_ids:
            self._make(wid, options.get("per_worker", {}).get(wid, options))
        for wid in worker_ids:
            self.threads[wid].start()

    @staticmethod
    def _check_devices(plan_dict: dict) -> None:
        """On a GPU plan where torch sees CUDA devices, the pools must fit them (AF609, as on
        Ray): a worker placed on ``cuda:N`` past the last device would otherwise fall back to
        the CPU. Where torch sees none, the engines run on the CPU (the CPU twin; devices.py)."""
        if plan_dict.get("device_kind") != "GPU" or not any(
                w.get("devices") for w in plan_dict.get("workers", [])):
            return
        try:
            import torch
        except ImportError:  # no engine here can use a device either
            return
        if not torch.cuda.is_available():
            return
        from asyncflow.plan import Plan

        check_feasible(Plan.from_dict(plan_dict), [{"GPU": float(torch.cuda.device_count())}],
                       where="this machine's")

    def _make(self, wid: str, options: dict) -> None:
        from asyncflow.runtime.worker import Worker

        plan_dict, store, control, t0 = self._args
        w = Worker(plan_dict, wid, store, control, t0, options)
        self.workers[wid] = w

        def body(w=w, wid=wid):
            try:
                res = w.run()
            except BaseException as e:  # the thread dies of anything: the driver sees it
                res = {"worker": wid, "status": "died",
                       "error": f"{e.__class__.__name__}: {e}", "op": w._op}
            if self.workers.get(wid) is w:
                self.results[wid] = res

        self.threads[wid] = threading.Thread(target=body, name=f"asyncflow:{wid}", daemon=True)

    def restart(self, wid: str, options: dict) -> None:
        """A new worker (thread) for ``wid``, which ended (crashed, died)."""
        old = self.workers.get(wid)
        if old is not None:
            old.close_sync()
        self._make(wid, options)
        self.results.pop(wid, None)
        self.threads[wid].start()

    def stack(self, wid: str) -> str:
        w = self.workers.get(wid)
        return w.stack() if w is not None else ""

    def alive(self, wid: str) -> bool:
        th = self.threads.get(wid)
        return bool(th and th.is_alive())

    def finished(self) -> dict[str, dict]:
        return {w: r for w, r in self.results.items()}

    def kill(self, wid: str) -> None:
        self.workers[wid].kill()

    def kill_actor(self, target: str) -> None:
        raise ValueError(f"{target} is not an actor on the local backend")

    def join(self, timeout: float) -> None:
        deadline = time.time() + timeout
        for th in self.threads.values():
            th.join(max(0.0, deadline - time.time()))

    def shutdown(self, keep_ray: bool = False) -> None:
        for w in self.workers.values():
            w.close_sync()


# ---------------------------------------------------------------------------------------- ray
class WorkerProcess:
    """A Ray actor that is one process of the plan (placement rule 6: the workers that
    time-share a device share one): each of its workers
    (:class:`asyncflow.runtime.worker.Worker`) runs ``run()`` on a thread of its own, as the
    local backend runs all of them; a second thread per worker answers ``stack()``."""

    def __init__(self, cores):
        if cores:
            pin(cores)
        self.workers: dict = {}

    def run(self, plan_dict, wid, store, control_handle, t0, options) -> dict:
        from asyncflow.runtime.worker import Worker

        w = None
        try:
            w = Worker(plan_dict, wid, store, ActorProxy(control_handle), t0,
                       {**options, "ray": True})
            self.workers[wid] = w
            return w.run()
        except BaseException as e:  # the loop died of anything but a crash of the process
            return {"worker": wid, "status": "died",
                    "error": f"{e.__class__.__name__}: {e}", "op": w._op if w else "START"}

    def stack(self, wid: str) -> str:
        w = self.workers.get(wid)
        return w.stack() if w is not None else ""


def check_feasible(plan, nodes: list[dict], where: str = "the Ray cluster's") -> None:
    """Fail at once, located at the pool in the pipeline file, when a pool's bundle asks for a
    GPU or a custom resource that no node of the cluster has (AF604), or when the pools ask for
    more of one than the whole cluster has (AF609): Ray would otherwise wait for the placement
    group forever. CPU slots are not checked: they are scaled down to fit (sim)."""
    total: dict[str, float] = {}  # the cluster's resources, summed over its nodes
    for n in nodes:
        for k, v in n.items():
            total[k] = total.get(k, 0.0) + float(v)
    used: dict[str, float] = {}
    for pool in plan.pools:
        for b in pool.bundles:
            for res, need in b.resources.items():
                need = float(need or 0)
                if res == "CPU" or need <= 0:
                    continue
                have = max((float(n.get(res, 0)) for n in nodes), default=0.0)
                if have + 1e-9 < need:
                    hint = ("no GPU is visible: run with --device-kind cpu (the default 'auto' "
                            "picks CPU slots when there is no GPU)" if res == "GPU" else
                            f"start a node with `ray start --resources '{{\"{res}\": {need:g}}}'`"
                            " or remove the pool's resources entry")
                    cluster = ", ".join(f"{k} {v:g}" for k, v in sorted(total.items())
                                        if not k.startswith(("node:", "memory", "object_store_memory")))
                    raise _pool_error(plan, pool, "AF604", hint, need=need, resource=res,
                                      have=have, cluster=cluster)
    for pool in plan.pools:  # every bundle fits a node: do all of them fit the cluster?
        for b in pool.bundles:
            for res, need in b.resources.items():
                if res == "CPU" or float(need or 0) <= 0:
                    continue
                used[res] = used.get(res, 0.0) + float(need)
                if used[res] > total.get(res, 0.0) + 1e-9:
                    need_all = sum(float(x.resources.get(res, 0) or 0)
                                   for p in plan.pools for x in p.bundles)
                    raise _pool_error(plan, pool, "AF609", "give the pools fewer devices, or "
                                      f"add nodes with {res}", need=need_all, resource=res,
                                      have=total.get(res, 0.0), where=where)


def _pool_error(plan, pool, code: str, hint: str, **fields):
    """A runtime error located at ``pool`` in the pipeline file, quoting its line."""
    from asyncflow.diagnostics import error
    from asyncflow.loc import Sources

    loc = source_loc(pool.loc, plan.source_file or "<plan>", len(pool.name))
    sources = Sources()
    sources.add_file(loc.file)
    return error(code, loc, hint, sources=sources, pool=pool.name, **fields)


def source_loc(text: str, fallback: str = "<plan>", width: int = 0):
    """A plan's "file:line:col" (``PoolPlan.loc``, ``TaskPlan.loc``) as a SourceLoc spanning
    ``width`` columns; the start of ``fallback`` when the plan has no location."""
    from asyncflow.loc import SourceLoc

    return SourceLoc.parse(text, width) or SourceLoc(fallback, 1, 1)


def cpu_cores(plan, ncpu: int) -> dict[str, list[int]]:
    """worker id -> the CPU cores its process is pinned to, for a plan on CPU slots.

    Ray reserves CPU slots but does not pin processes, so on a small machine the OS spreads the
    rollout and train processes over all cores and they slow each other down (grpo_digits on 2
    cores: the train step took 0.16 s next to the rollout instead of 0.08 s alone). Here each
    pool bundle gets its own consecutive cores, in pool order, and every worker on a bundle
    (colocated tasks) shares that bundle's cores, as tasks on one GPU share the GPU. Workers with
    no pool (reward, advantage: plain functions) are not pinned. Nothing is pinned when the
    plan's slots do not fit the machine's cores (a sim plan with more slots than cores)."""
    if getattr(plan, "device_kind", "CPU") != "CPU" or ncpu < 1:
        return {}
    slots: dict[tuple[str, int], list[int]] = {}
    nxt = 0
    for pool in plan.pools:
        for b in pool.bundles:
            n = max(1, int(math.ceil(float(b.resources.get("CPU", 0) or 0))))
            slots[(pool.name, b.index)] = list(range(nxt, nxt + n))
            nxt += n
    if nxt > ncpu:
        return {}
    out: dict[str, list[int]] = {}
    for w in plan.workers:
        cores = sorted({c for i in (w.bundles or []) for c in slots.get((w.pool or "", i), [])})
        if cores:
            out[w.id] = cores
    return out


def device_groups(plan, pool) -> list[list[int]]:
    """A pool's devices (bundle indices) grouped by the processes that hold them (placement
    rules 6-7): devices a process holds together are one group, and groups that share a
    process's device merge. Each group is one Ray bundle, since Ray gives an actor resources of
    one bundle only: a replica over two devices needs a bundle of two."""
    parent = list(range(len(pool.bundles)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for w in plan.workers:
        if w.pool == pool.name and w.bundles:
            for b in w.bundles[1:]:
                parent[find(b)] = find(w.bundles[0])
    groups: dict[int, list[int]] = {}
    for i in range(len(pool.bundles)):
        groups.setdefault(find(i), []).append(i)
    return sorted(groups.values())


def process_resources(workers, bundle: dict, scale: float = 1.0) -> dict:
    """What one process of the plan asks Ray for: the sum of its workers' shares (placement
    rule 3: each worker's share of each of its devices) of the Ray bundle it sits in. GPUs:
    a fraction of one device, or whole devices (rule 7; Ray takes no fraction above 1); CPUs
    scaled as the bundles were (:meth:`RayBackend._placement_groups`), never above the bundle."""
    n = len(workers[0].bundles) or 1
    out: dict = {}
    for key, ray_key in (("GPU", "num_gpus"), ("CPU", "num_cpus")):
        share = sum(float(w.resources.get(key, 0) or 0) for w in workers) * n
        if share <= 0 or key not in bundle:
            continue
        if key == "GPU":
            share = float(round(share)) if share > 1 or n > 1 else min(1.0, share)
        else:
            share = share * scale
        out[ray_key] = min(float(bundle[key]), math.floor(share * 10_000) / 10_000)
    return out


def pin(cores: list[int]) -> list[int]:
    """Pin this process (its threads to come: torch's intra-op pool) to ``cores``; the cores
    this machine does not have are ignored. Returns the cores now in effect."""
    if not hasattr(os, "sched_setaffinity"):
        return []
    have = os.sched_getaffinity(0)
    want = {c for c in cores if c in have}
    if want:
        os.sched_setaffinity(0, want)
    return sorted(os.sched_getaffinity(0))


def ensure_ray(address: str | None = None, num_cpus: int | None = None):
    """Connect to Ray; returns ``(ray, started)``: ``started`` when this call started a Ray of
    its own (the caller shuts it down).

    ``address`` (``--address``) joins that cluster; else ``RAY_ADDRESS`` from the environment
    joins that one, announced on stderr; else a new local Ray is started (``address="local"``),
    never a Ray already running on this machine (a leftover ``ray start``, found through its
    address file, is joined only with ``--address``). Ray's own token authentication, when it
    is on, is left as it is. Ray 2.60 cannot bind a local cluster to 127.0.0.1: it rewrites a
    loopback ``_node_ip_address`` to the machine's address (``resolve_ip_for_localhost``) and its
    GCS listens on every interface, so none is asked for here."""
    import ray

    if ray.is_initialized():
        return ray, False
    kw: dict = {"include_dashboard": False, "log_to_driver": True, "configure_logging": False}
    env = os.environ.get("RAY_ADDRESS")
    if not address and env:
        import sys

        print(f"asyncflow: joining the Ray cluster at {env} (RAY_ADDRESS)", file=sys.stderr)
        address = env
    if address:
        probe_address(address)
        try:
            ray.init(address=address, **kw)
        except ConnectionError as e:  # Ray's own, after its retries: most often the token
            raise join_error(address, "Ray's client could not connect: the head refused it or "
                             f"did not answer ({str(e).splitlines()[0][:160]})") from None
        return ray, False
    with _lean_local_ray(ray):
        ray.init(address="local", num_cpus=num_cpus or max(2, os.cpu_count() or 2), **kw)
    return ray, True


JOIN_PROBE_S = 5.0  # how long a join waits for the head's port before AF608


def join_error(address: str, why: str):
    """AF608: ``--address`` (or ``RAY_ADDRESS``) cannot be joined; the hint says what to
    check, token authentication first where it is on by default (Ray 2.60's ``ray start``)."""
    from asyncflow.diagnostics import error

    if os.environ.get("RAY_AUTH_TOKEN"):
        token = ("that RAY_AUTH_TOKEN here is the head's token (`ray get-auth-token` on the head) "
                 "and RAY_AUTH_MODE=token")
    else:
        token = ("a head started with `ray start` uses token authentication (Ray 2.60): set "
                 "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the head's token (`ray "
                 "get-auth-token` on the head) here")
    hint = (f"check that a Ray head runs at {address} (`ray start --head --port PORT` prints its "
            f"address; `ray status --address {address}` tests it from here); {token}; and that "
            "both sides run the same Ray and Python versions")
    return error("AF608", None, hint, address=address, why=why)


def probe_address(address: str, timeout: float = JOIN_PROBE_S) -> None:
    """A TCP connect to the head's GCS port before ``ray.init``: a refused or unreachable
    address is AF608 in seconds, not after Ray's minutes of retries. ``auto`` and addresses
    without a port are left to Ray."""
    import socket

    host, _, port = address.rpartition("://")[2].rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as e:
        why = "nothing answers there" if isinstance(e, ConnectionRefusedError) else \
            f"{e.__class__.__name__}: {e.strerror or e}"
        raise join_error(address, why) from None


@contextlib.contextmanager
def _lean_local_ray(ray):
    """While a local Ray of our own starts: no dashboard head (Ray starts one even with
    ``include_dashboard=False``, for its job and state APIs) and no autoscaler monitor -- two
    Python processes a one-run local cluster never uses. ``ray.init`` takes 1.8 s instead of
    3.7 s here (benchmarks/startup.py). ``ASYNCFLOW_RAY_FULL=1`` starts them as Ray would. Both
    are Ray internals (``Node.start_api_server``, ``RayParams.no_monitor``); where a Ray version
    lacks them, Ray starts as it always does."""
    if os.environ.get("ASYNCFLOW_RAY_FULL") == "1":
        yield
        return
    try:
        from ray._private import node as ray_node, parameter as ray_parameter

        node_cls, params_cls = ray_node.Node, ray_parameter.RayParams
        api, params_init = node_cls.start_api_server, params_cls.__init__
    except (ImportError, AttributeError):
        yield
        return

    def no_api_server(self, *args, **kwargs):
        return None

    def params(self, *args, **kwargs):
        kwargs.setdefault("no_monitor", True)
        params_init(self, *args, **kwargs)

    node_cls.start_api_server, params_cls.__init__ = no_api_server, params
    try:
        yield
    finally:
        node_cls.start_api_server, params_cls.__init__ = api, params_init


class RayBackend:
    """One actor per process of the plan (the workers time-sharing a device share one) on its
    pool's placement group; RayStore; a Control actor."""

    name = "ray"
    use_ray = True

    def __init__(self, lease_s: float = 60.0, address: str | None = None, shards: int = 1,
                 pin: bool | None = None, **_: Any):
        self.ray, self.owns_ray = ensure_ray(address)
        # pin workers to cores on a local single-node cluster only: on a cluster the core ids
        # of one node say nothing of another's
        self.pin = (address is None and len(self.ray.nodes()) == 1) if pin is None else pin
        self.lease_s = lease_s
        self.shards = shards
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
        self._store = RayStore(shards=self.shards, lease_s=self.lease_s, chunk=chunk)
        return self._store

    def make_control(self):
        handle = self.ray.remote(Control).options(num_cpus=0, max_concurrency=32).remote()
        self._control = handle
        return handle, ActorProxy(handle, timeout_s=CALL_TIMEOUT_S)

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
                self.ray.get(pg.ready(), timeout=float(os.environ.get("ASYNCFLOW_PG_TIMEOUT_S", "120")))
            except self.ray.exceptions.GetTimeoutError:
                raise ControlLost(f"pool {pool.name!r}: Ray did not place its bundles {bundles} "
                                  "within the time limit (the cluster lacks the resources)") from None
            self.pgs[pool.name] = pg

    def start(self, plan_dict: dict, worker_ids: list[str], store, control, t0: float,
              options: dict) -> None:
        """One actor per process of the plan (``WorkerPlan.process``), on the bundle of its
        workers' device; then each worker's ``run`` on its process's actor."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from asyncflow.plan import Plan

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
        self.hosts[proc] = cls.options(**opts).remote(cores)

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
            try:
                self.ray.kill(old, no_restart=True)
            except Exception:
                pass
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
                self.results[wid] = self.ray.get(ref, timeout=CALL_TIMEOUT_S)
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
        from ray.util.placement_group import remove_placement_group

        for a in {id(a): a for a in [*self.hosts.values(), *self.actors.values()]}.values():
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:
                pass
        if self._control is not None:
            try:
                self.ray.kill(self._control, no_restart=True)
            except Exception:
                pass
        if self._store is not None:
            try:
                self._store.shutdown()
            except Exception:
                pass
        for pg in self.pgs.values():
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        if self.owns_ray and not keep_ray:  # the Ray this run started goes with it (no process left behind)
            try:
                self.ray.shutdown()
            except Exception:
                pass


BACKENDS = {"local": LocalBackend, "ray": RayBackend}


def make_backend(name: str, **kw):
    try:
        return BACKENDS[name](**kw)
    except KeyError:
        raise ValueError(f"unknown backend {name!r} (known: {', '.join(BACKENDS)})") from None
