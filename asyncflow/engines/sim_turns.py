"""Multi-turn rollouts on the ``sim`` engine (a rollout task with ``env:``): the engine's agent
turns take a modelled device time, the environment's steps whatever the environment takes
(:func:`asyncflow.envs.sim_env` sleeps a modelled tool latency).

:class:`~asyncflow.engines.sim.SimEngine` hands over to this module when its spec carries an
environment (``spec.extra["env"]``, ``spec.extra["env_args"]``):

- ``generate(batch)`` -> :func:`generate`, lock-step (``schedule: batch``): per turn, every
  active episode's agent turn in one batch that sleeps the *slot makespan* of their latencies
  (:func:`asyncflow.engines.sim_draws.slot_schedule`, ``slots`` slots, in batch order), then
  all their environment steps at once on a thread pool; the turn ends when the slowest step
  returns.
- ``serve(pull, emit)`` -> :func:`serve`, env-level asynchrony (``schedule: queue``):
  :func:`asyncflow.engines.multiturn.serve_episodes` over a :class:`SimTurnServer`, so each
  episode's next turn is queued the moment its observation arrives and a slow step holds up only
  its own episode.

Both give an episode the same turns (:func:`turn_tokens`) and the same environment (keyed by its
``_row``), so the two schedules produce the same rows and differ only in time.

The engine's args that matter here (besides ``slots``, ``latency``, ``response_tokens`` and
``time_scale`` of the sim engine, which apply per agent turn):

===============  ==============================================================  ==============
arg              meaning                                                         default
===============  ==============================================================  ==============
``max_turns``    agent turns at most per episode                                 16
``env_threads``  ``serve``: threads for resets and steps, and so the episodes    ``2 * slots``
                 in flight
===============  ==============================================================  ==============

**Determinism.** Agent turn ``t`` of the episode of row ``r`` takes ``latency`` drawn from
(the distribution's ``seed``, ``r``, ``t``) device seconds and yields ``response_tokens`` digits
drawn from (the spec's ``seed``, ``r``, ``t``) followed by ``eos``, with log-probs from the same
key: never from call order, batch composition or schedule. An environment factory that accepts
``time_scale`` gets the engine's when the task's args give it none, so one ``time_scale`` scales
agent turns and environment steps alike.

**Versions.** A turn is generated under ``engine.version`` as it starts (in ``serve``: when it
takes a slot); an episode's ``_version`` is the oldest among its turns. A weight update while
episodes are in flight lets them go on with the new weights (``on_update: continue``); this
module does not restart episodes (``abort``).
"""
from __future__ import annotations

import functools
import heapq
import math
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from asyncflow.engines import multiturn
from asyncflow.engines.base import Columns
from asyncflow.engines.sim_draws import DIGIT0, rng, slot_schedule


@functools.lru_cache(maxsize=1)
def tokenizer():
    """The tokenizer sim episodes and prompts are written in (the character tokenizer of the tiny
    models)."""
    from asyncflow.models import CharTokenizer

    return CharTokenizer()


def _row_turn(key: Any) -> tuple[Any, int]:
    """``(row, turn)`` of a request key (``serve_episodes`` submits ``(row, turn)``; any other
    key is one turn 0 of its own)."""
    if isinstance(key, tuple) and len(key) == 2:
        return key[0], int(key[1])
    return key, 0


def turn_latency(engine, row: Any, turn: int) -> float:
    """Modelled device seconds of agent turn ``turn`` of row ``row`` (before ``time_scale``)."""
    return max(0.0, engine.latency.sample(rng("latency", engine.latency.seed, row, turn)))


def turn_tokens(engine, row: Any, turn: int) -> tuple[list[int], list[float]]:
    """Ids and log-probs of agent turn ``turn`` of row ``row``: ``response_tokens`` digits, then
    ``eos`` (the turn ends there)."""
    n = max(1, int(round(engine.response_tokens.sample(rng("len", engine.seed, row, turn)))))
    digits = rng("tokens", engine.seed, row, turn)
    ids = [DIGIT0 + digits.randrange(10) for _ in range(n)] + [tokenizer().eos_id]
    lps = rng("logprobs", engine.seed, row, turn)
    return ids, [round(-lps.expovariate(2.0) - 1e-3, 6) for _ in ids]


def max_turns(engine) -> int:
    """The most agent turns of an episode (``max_turns``, else multiturn's default)."""
    return int(engine.spec.args.get("max_turns") or multiturn.DEFAULT_MAX_TURNS)


def environment(engine) -> tuple[Callable, dict]:
    """The environment factory and the keywords it is called with (``env_args``, plus the
    engine's ``time_scale`` when the factory takes one and ``env_args`` has none)."""
    extra = engine.spec.extra
    factory = multiturn.resolve_factory(extra["env"], extra.get("search_path", ()))
    kwargs = multiturn.accepted_kwargs(factory, extra.get("env_args"))
    if "time_scale" not in kwargs:
        kwargs.update(multiturn.accepted_kwargs(factory, {"time_scale": engine.time_scale}))
    return factory, kwargs


def _outputs(engine) -> tuple[str, ...]:
    return tuple(engine.spec.outputs or ("response", "logprobs"))


# -- lock-step ---------------------------------------------------------------------------------

def generate(engine, batch: Columns) -> Columns:
    """All episodes of ``batch`` in lock-step (the module docstring); returns the columns of
    :func:`asyncflow.engines.multiturn.rollout_columns`."""
    rows = engine.rows_of(batch)
    factory, kwargs = environment(engine)

    def sample(prefixes, keys):
        done = slot_schedule([turn_latency(engine, r, t) for r, t in keys], engine.slots)
        engine.sleep(done[-1][0] if done else 0.0)
        turns = [turn_tokens(engine, r, t) for r, t in keys]
        return [ids for ids, _ in turns], [lps for _, lps in turns]

    with ThreadPoolExecutor(max(1, len(rows)), thread_name_prefix="env") as pool:
        return multiturn.rollout_columns(batch, sample, tokenizer(), factory, kwargs,
                                         max_turns(engine), _outputs(engine), keys=rows,
                                         pool=pool)


# -- env-level asynchrony ----------------------------------------------------------------------

class SimTurnServer:
    """A :class:`~asyncflow.engines.base.TurnServer` in modelled time: ``engine.slots`` slots;
    a request waits in submission order for a slot, runs for :func:`turn_latency` of its
    ``(row, turn)`` key (times ``time_scale``) and yields :func:`turn_tokens` with the
    ``engine.version`` it started under.

    Times are exact, not polled: a request that finds a slot free starts when it was submitted,
    one that waited starts when the slot it takes was freed (a cancel frees a slot at the time of
    the cancel), so the schedule does not depend on how often ``poll`` is called. Not
    thread-safe: one driver calls it (``serve_episodes``)."""

    def __init__(self, engine):
        self.engine = engine
        self.slots = int(engine.slots)
        self._queue: OrderedDict = OrderedDict()  # key -> submit time
        self._running: dict = {}  # key -> (finish time, version)
        self._finishes: list = []  # heap of (finish time, seq, key); stale entries skipped
        self._idle: list[float] = [-math.inf] * self.slots  # heap: when each idle slot was freed
        self._seq = 0
        self.started = 0  # requests that took a slot
        self.cancelled = 0  # requests dropped by cancel

    def submit(self, key: Any, prefix_ids: list[int]) -> None:
        if key in self._queue or key in self._running:
            raise ValueError(f"request {key!r} is already queued or running")
        self._queue[key] = time.monotonic()
        self._admit()

    def in_flight(self) -> int:
        return len(self._queue) + len(self._running)

    def cancel(self, keys: list) -> int:
        now, n = time.monotonic(), 0
        for key in keys:
            if self._queue.pop(key, None) is not None:
                n += 1
            elif self._running.pop(key, None) is not None:
                heapq.heappush(self._idle, now)
                n += 1
        self.cancelled += n
        self._admit()
        return n

    def _admit(self) -> None:
        """Start queued requests in free slots, each at max(its submission, the slot's free
        time)."""
        while self._queue and self._idle:
            key, submitted = self._queue.popitem(last=False)
            freed = heapq.heappop(self._idle)
            row, turn = _row_turn(key)
            finish = (max(submitted, freed)
                      + turn_latency(self.engine, row, turn) * self.engine.time_scale)
            self._running[key] = (finish, self.engine.version)
            heapq.heappush(self._finishes, (finish, self._seq, key))
            self._seq += 1
            self.started += 1

    def _advance(self, now: float) -> list[tuple[Any, list[int], list[float], int]]:
        """Everything that finished by ``now``, in finishing order (a slot freed at ``t`` takes
        the next queued request at ``t``)."""
        out = []
        self._admit()
        while self._finishes and self._finishes[0][0] <= now:
            finish, _, key = heapq.heappop(self._finishes)
            ran = self._running.get(key)
            if ran is None or ran[0] != finish:  # cancelled
                continue
            del self._running[key]
            heapq.heappush(self._idle, finish)
            row, turn = _row_turn(key)
            ids, lps = turn_tokens(self.engine, row, turn)
            out.append((key, ids, lps, ran[1]))
            self._admit()
        return out

    def poll(self, timeout_s: float) -> list[tuple[Any, list[int], list[float], int]]:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            now = time.monotonic()
            out = self._advance(now)
            if out or now >= deadline:
                return out
            wake = min(deadline, self._finishes[0][0]) if self._finishes else deadline
            if wake > now:
                time.sleep(wake - now)


def serve(engine, pull: Callable[[int], Columns | None], emit: Callable[[dict], Any]) -> int:
    """Env-level asynchrony (the module docstring): :func:`multiturn.serve_episodes` over a
    :class:`SimTurnServer`; returns how many episodes were emitted. Cancelled episodes are
    counted in ``engine.cancelled``."""
    factory, kwargs = environment(engine)
    server = SimTurnServer(engine)
    engine.turn_server = server  # the live server, for inspection

    def cancelled(rows: list) -> None:
        engine.cancelled = getattr(engine, "cancelled", 0) + len(rows)

    threads = engine.spec.args.get("env_threads")
    return multiturn.serve_episodes(
        pull, emit, server, tokenizer(), factory, kwargs, max_turns(engine), _outputs(engine),
        env_threads=int(threads) if threads else None, on_cancel=cancelled)
