"""Connecting to Ray (:func:`ensure_ray`): joining a cluster (``--address``, or Ray's own
``RAY_ADDRESS``), with a fast probe and a hint when it cannot be joined (AF608), or starting a
local Ray of this run's own (tried twice, then AF613 with the machine's load in its hint).

A run's Ray workers run at the driver's CPU priority (:data:`NICENESS`), not Ray's.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys

from asyncflow.diagnostics import error
from asyncflow.runtime.ray_patch import lean_local_ray


def ensure_ray(address: str | None = None, num_cpus: int | None = None,
               full: bool = False):
    """Connect to Ray; returns ``(ray, started)``: ``started`` when this call started a Ray of
    its own (the caller shuts it down).

    ``address`` (``--address``) joins that cluster; else ``RAY_ADDRESS`` from the environment
    joins that one, announced on stderr; else a new local Ray is started (``address="local"``),
    never a Ray already running on this machine (a leftover ``ray start``, found through its
    address file, is joined only with ``--address``). Ray's own token authentication, when it
    is on, is left as it is. Ray 2.60 cannot bind a local cluster to 127.0.0.1: it rewrites a
    loopback ``_node_ip_address`` to the machine's address (``resolve_ip_for_localhost``) and its
    GCS listens on every interface, so none is asked for here. ``full``: a local Ray starts
    every process it would (:func:`asyncflow.runtime.ray_patch.lean_local_ray`)."""
    import ray

    if ray.is_initialized():
        return ray, False
    kw: dict = {"include_dashboard": False, "log_to_driver": True, "configure_logging": False}
    env = os.environ.get("RAY_ADDRESS")
    if not address and env:
        print(f"asyncflow: joining the Ray cluster at {env} (RAY_ADDRESS)", file=sys.stderr)
        address = env
    if address:
        probe_address(address)
        # the head's raylet starts the workers: the niceness travels with the job's runtime_env
        # (Ray merges it into a submitted job's own, which must not name the same variable)
        env = {} if _job_sets_niceness() else {"runtime_env": {"env_vars": worker_priority()}}
        try:
            ray.init(address=address, **env, **kw)
        except ConnectionError as e:  # Ray's own, after its retries: most often the token
            raise join_error(address, "Ray's client could not connect: the head refused it or "
                             f"did not answer ({str(e).splitlines()[0][:160]})") from None
        return ray, False
    why = ""
    for attempt in range(START_ATTEMPTS):
        try:
            with lean_local_ray(ray, full), local_worker_priority():
                ray.init(address="local", num_cpus=num_cpus or max(2, os.cpu_count() or 2), **kw)
            return ray, True
        except Exception as e:  # noqa: BLE001 -- Ray raises a bare Exception here; reported below
            why = f"{e.__class__.__name__}: {str(e).splitlines()[0][:200]}" if str(e) else repr(e)
            try:
                ray.shutdown()  # the processes this attempt started
            except Exception as e2:  # noqa: BLE001 -- reported with the start's own error
                why += f"; stopping what it started also failed: {e2.__class__.__name__}: {e2}"
            if attempt + 1 < START_ATTEMPTS:
                print(f"asyncflow: a local Ray did not start ({why}); trying once more",
                      file=sys.stderr)
    raise start_error(why)


# Ray runs every worker process at nice 15 (its ``worker_niceness``), below every process at
# the default 0, so that its raylet stays responsive. A run's workers are the job itself: beside
# one busy process per core they got ~3% of a core each (nice 15 weighs 36 against 1,024), their
# heartbeats and leases lapsed, and a run on Ray took 20-25x as long as on a quiet machine (the
# test suite beside two CPU hogs: 82 minutes). They run at nice 0 instead, the driver's; a
# ``RAY_worker_niceness`` set where asyncflow runs is kept (e.g. 15: Ray's own).
NICENESS = "0"


def worker_priority() -> dict[str, str]:
    """The environment that sets a run's Ray workers' niceness (:data:`NICENESS`, or the
    ``RAY_worker_niceness`` already set): read by each worker's Ray core at its start."""
    return {"RAY_worker_niceness": os.environ.get("RAY_worker_niceness", NICENESS)}


def _job_sets_niceness() -> bool:
    """Whether this driver runs as a submitted Ray Job whose own runtime_env already sets
    ``RAY_worker_niceness`` (Ray refuses to merge two values of one variable)."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    try:
        env_vars = ((json.loads(raw) if raw else {}).get("runtime_env") or {}).get("env_vars")
    except (ValueError, AttributeError):
        return False
    return isinstance(env_vars, dict) and "RAY_worker_niceness" in env_vars


@contextlib.contextmanager
def local_worker_priority():
    """While a local Ray starts (``ray.init()`` inside): :func:`worker_priority` in this
    process's environment, which its raylet, and the workers the raylet starts, inherit; the
    environment as it was after."""
    env = worker_priority()
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


START_ATTEMPTS = 2  # a local Ray's start, tried again once (Ray waits a fixed 30 s for its node)


def start_error(why: str):
    """AF613: a local Ray did not start, twice. Ray gives its node a fixed 30 s to register,
    which a busy machine can miss; the hint says how busy this one is."""
    try:
        load = os.getloadavg()[0]
        busy = f"this machine's load average is {load:.1f} on {os.cpu_count()} cores; "
    except OSError:
        busy = ""
    hint = (f"{busy}Ray gives a new node a fixed 30 s to start, which a busy machine can miss: "
            "run again when it is less busy, join a running Ray with --address, or run without "
            "Ray with --backend local (same plan, threads in this process)")
    return error("AF613", None, hint, why=why, attempts=START_ATTEMPTS)


JOIN_PROBE_S = 5.0  # how long a join waits for the head's port before AF608


def join_error(address: str, why: str):
    """AF608: ``--address`` (or ``RAY_ADDRESS``) cannot be joined; the hint says what to
    check, token authentication first where it is on by default (Ray 2.60's ``ray start``)."""
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
