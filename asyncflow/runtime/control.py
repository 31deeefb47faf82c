"""The run's control plane: :class:`Control` -- the stop flag, the weight board, the trace
spans, busy time, step reports and drop counts -- reached through one batched ``sync`` call per
worker every few milliseconds. On the local backend it is an object every thread shares; on Ray
it is a threaded actor and the workers and the driver talk to it through :class:`ActorProxy` (a
method call = one remote call + a bounded get; a dead or silent actor is :class:`ControlLost`).
"""
from __future__ import annotations

import threading
import time

from asyncflow.errors import AsyncflowError
from asyncflow.runtime.options import DEFAULT_CALL_TIMEOUT_S
from asyncflow.runtime.weights import WeightBoard


class Control:
    """The run's control plane (thread-safe; a Ray actor on the ray backend)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # news the driver acts on at once (a step report, a drop, an error, a run event): a
        # waiting collect() returns when one comes
        self._news = threading.Condition(self._lock)
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
             wait_s: float = 0.0, others: list | tuple = ()) -> dict:
        """A worker's heartbeat: its spans and state in; the stop flag, the newer weights and
        the rows removed from the store since its last sync (``dropped``: ``(rows, reason)``
        pairs: a rollout cancels them in flight, a trainer's window skips them) out.
        ``wait_s`` > 0: wait up to that long for a newer version when there is none yet (a
        rollout the staleness gate holds back). ``others``: the heartbeats of workers of the
        same process that take no weights, ``(worker, spans, state)`` each, taken as theirs;
        their answers (the stop flag, their removed rows) under ``others``, by worker."""
        with self._lock:
            self._take_beat(worker, spans, state)
            for w, sp, st in others:
                self._take_beat(w, sp, st)
            stop = self._stop
            dropped = self._told(worker)
            told = {w: {"stop": stop, "dropped": self._told(w)} for w, _, _ in others}
        newer = self.board.newer(known, 0.0 if stop else wait_s) if known else {}
        out = {"stop": stop or self._stop, "newer": newer, "dropped": dropped}
        if told:
            out["others"] = told
        return out

    def _take_beat(self, worker: str, spans: list, state: dict) -> None:
        """(under the lock) One heartbeat's spans and state; what it does not carry (a carried
        heartbeat has only busy time and spans) stays as the worker's last said."""
        self._spans.extend(spans)
        self._busy[worker] = float(state.get("busy", 0.0))
        if "exposed_s" in state:
            self._exposed[worker] = float(state["exposed_s"])
        if "stats" in state:
            self._stats[worker] = state["stats"]
        self._seen[worker] = time.time()
        self._rewards.extend(state.get("rewards", ()))
        self._events.extend(state.get("events", ()))
        for rows, reason in state.get("drops", ()):
            self._drop_log.append((time.time(), len(rows), reason))
        if state.get("drops") or state.get("events"):
            self._news.notify_all()

    def _told(self, worker: str) -> list:
        """(under the lock) The removals ``worker`` has not been told of yet, now told."""
        seen = self._cursor.get(worker, 0)
        self._cursor[worker] = len(self._removals)
        return self._removals[seen:]

    def publish(self, model: str, version: int, box: list) -> None:
        self.board.publish(model, version, box)

    def report_step(self, task: str, report: dict, beat: tuple | None = None) -> dict | None:
        """A train step's report. ``beat``: the reporting worker's heartbeat, the arguments of
        :meth:`sync` (worker, spans, state, known), taken first -- the driver, woken by the
        report, reads that worker's busy time as of the step's end -- and its answer returned
        (a trainer's heartbeat rides on its report: one call a step, not two)."""
        reply = self.sync(*beat) if beat is not None else None
        with self._lock:
            self._reports.append((task, report))
            self._news.notify_all()
        return reply

    def note_drops(self, rows: list[int], reason: str) -> None:
        """Rows removed from the store (a filter, staleness, a redundant group cancelled): every
        worker hears of them at its next sync."""
        rows = [int(r) for r in rows]
        with self._lock:
            self._removals.append((rows, reason))
            self._drop_log.append((time.time(), len(rows), reason))
            self._news.notify_all()

    def choose(self, step: int, rows: list[int]) -> None:
        """The primary trainer's rows of ``step`` (first_ready, redundancy): the other train
        tasks train exactly these."""
        with self._lock:
            self._chosen[int(step)] = [int(r) for r in rows]

    def chosen(self, step: int) -> list[int] | None:
        with self._lock:
            return self._chosen.get(int(step))

    def fail(self, worker: str, message: str, tb: str) -> None:
        with self._lock:
            self._errors.append((worker, message, tb))
            self._stop = True
            self._news.notify_all()
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

    def collect(self, wait_s: float = 0.0) -> dict:
        """Everything new since the last collect (spans, reports, rewards, drops), and the
        current busy / exposed-sync integrals of every worker. ``wait_s`` > 0: first wait up to
        that long for news (a step report, a drop, an error, a run event), so a driver that
        would otherwise poll makes one call a step, answered the moment the step ends."""
        with self._lock:
            if wait_s > 0:
                self._news.wait_for(lambda: self._reports or self._drop_log or self._errors
                                    or self._events, timeout=wait_s)
            out = {"spans": self._spans, "reports": self._reports, "rewards": self._rewards,
                   "drops": self._drop_log, "errors": list(self._errors),
                   "busy": dict(self._busy), "exposed": dict(self._exposed),
                   "stats": dict(self._stats), "events": self._events, "time": time.time()}
            self._spans, self._reports, self._rewards, self._drop_log = [], [], [], []
            self._events = []
            return out


class ControlLost(AsyncflowError):
    """The control actor died or did not answer within its bound."""


class ActorProxy:
    """Calls an actor's methods synchronously: ``proxy.m(*a)`` is ``ray.get(h.m.remote(*a))``,
    bounded by ``timeout_s`` (+ a ``wait_s`` argument's wait); a dead or silent actor is
    :class:`ControlLost`."""

    def __init__(self, handle, timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
                 what: str = "control actor"):
        self._h = handle
        self._timeout = float(timeout_s)
        self._what = what

    def __getattr__(self, name: str):
        import ray  # only an actor's proxy needs Ray: the local control never calls this

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
