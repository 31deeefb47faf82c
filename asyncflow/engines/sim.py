"""The ``sim`` engine: computes nothing, sleeps for a modelled device time (docs/language.md, "The sim
engine"), and still returns well-formed outputs so every downstream task runs for real.

One class, :class:`SimEngine`, implements all three protocols of :mod:`asyncflow.engines.base`.
Its ``args`` (the task's ``args:``; every sleep is multiplied by ``time_scale``) are declared,
with their types, defaults and the kinds they apply to, in :data:`asyncflow.argtable.SIM_ARGS`
(``asyncflow check`` checks them; listed in docs/language.md, "Args"): ``slots``,
``latency``, ``response_tokens``, ``seconds_per_sample``, ``sync_seconds``, ``time_scale``
(and ``seconds_per_call``, a cost hint).

Distributions (all take ``seed``; ``max`` clamps a heavy tail):

=============  ===========================  =========================================
``dist``       parameters                   a draw
=============  ===========================  =========================================
``constant``   ``value``                    ``value``
``uniform``    ``min``, ``max``             ``U(min, max)``
``lognormal``  ``median``, ``sigma``, max   ``min(median * exp(sigma * N(0, 1)), max)``
``pareto``     ``scale``, ``alpha``, max    ``min(scale * U^(-1/alpha), max)``
=============  ===========================  =========================================

The distributions are :class:`asyncflow.costmodel.Distribution` (the compiler's cost pass reads
the same specs).

**Determinism.** The latency of a row depends only on (the distribution's ``seed``, the row's
``_row`` index), its outputs only on (the spec's ``seed``, ``_row``): never on call order, batch
composition or replica, so the same row costs the same time and yields the same tokens wherever
it runs. A batch without ``_row`` uses the rows' positions in the batch.

**Three ways to generate**, all with the same per-sample latencies:

- ``generate(batch)``: returns when every row is done; the call lasts the *slot makespan*
  (rows taken in batch order by ``slots`` concurrent slots, computed exactly and slept once).
- ``generate_iter(batch)`` yields ``(i, outputs)`` as each sample finishes (``i`` = position in
  the batch, ``outputs`` = ``{field: value}``), in completion order, sleeping between
  completions; ``generate_stream(batch, emit)`` calls ``emit(i, outputs)`` the same way and then
  returns the full columns. Both end at the same makespan as ``generate``.
- ``serve(pull, emit)``: continuous batching *across* calls. It keeps up to ``slots`` samples in
  flight, calls ``pull(k)`` for up to ``k`` new rows whenever slots are free (so an asynchronous
  plan fills freed slots with the next step's prompts), and emits each finished sample as a
  one-row dict carrying ``_row``/``_group`` and ``_version`` (the version it started under).

``generate`` keeps no per-call state, so a runtime may also call it from several threads.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import os
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np

from asyncflow.engines import sim_turns
from asyncflow.engines.base import BUILTIN_CAPABILITIES, Columns, EngineSpec
from asyncflow.engines.sim_draws import DIGIT0, rng, row_latency, slot_schedule, uniforms
from asyncflow.tokens import Text

STATE_FILE = "sim_engine.json"


def _distribution(spec: Any):
    """A :class:`asyncflow.costmodel.Distribution` (the one shared spec; raises its SpecError,
    a ValueError, on a bad spec)."""
    from asyncflow.costmodel import Distribution

    return Distribution.from_spec(spec)


def _n_rows(batch: Columns) -> int:
    return max((len(v) for v in batch.values()), default=0)


# -- the engine --------------------------------------------------------------------------------

class SimEngine:
    """Rollout, Scorer and Trainer that sleep for a modelled device time (module docstring)."""

    capabilities = BUILTIN_CAPABILITIES["sim"]

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        args = dict(spec.args or {})
        self.slots = int(args.get("slots", 64))
        if self.slots < 1:
            raise ValueError(f"args.slots of task {spec.task!r} must be >= 1, not {self.slots}")
        self.latency = _distribution(args.get("latency", 0.01))
        self.response_tokens = _distribution(args.get("response_tokens", 8))
        default_sps = 0.005 if spec.kind == "train" else 0.002
        # a scorer's or trainer's replica on d devices splits each call's rows over them
        self.devices = max(1, int((spec.extra or {}).get("devices", 1) or 1))
        self.seconds_per_sample = float(args.get("seconds_per_sample", default_sps))
        self.sync_seconds = float(args.get("sync_seconds", 0.0))
        self.time_scale = float(args.get("time_scale", 1.0))
        self.seed = spec.seed
        self.version = 0  # the policy version this instance holds (trained or adopted)
        self.adopted: list[int] = []  # versions received through update_weights, in order
        self.weights: Any = None
        self.steps = 0
        self._lock = threading.Lock()
        self.aborted = 0  # in-flight samples restarted by new weights (on_update: abort)
        self.cancelled = 0  # in-flight samples dropped elsewhere (serve's ``_cancel``)
        self._flight: dict = {}
        self._restart = False
        self.flight_at_update: list[int] = []  # samples in flight at each update_weights

    # -- time --------------------------------------------------------------------------------
    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` of modelled time (times ``time_scale``)."""
        if seconds * self.time_scale > 0:
            time.sleep(seconds * self.time_scale)

    def _sleep_until(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left > 0:
            time.sleep(left)

    # -- per-row draws -----------------------------------------------------------------------
    def rows_of(self, batch: Columns) -> list[int]:
        """The store rows of ``batch`` (``_row``; without it, the positions in the batch)."""
        rows = batch.get("_row")
        return [int(r) for r in rows] if rows is not None else list(range(_n_rows(batch)))

    def latency_of(self, row: int) -> float:
        """Modelled device seconds of the sample in store row ``row`` (before ``time_scale``)."""
        return row_latency(self.latency, row)

    def _lengths(self, rows: list[int]) -> list[int]:
        d = self.response_tokens
        if d.dist == "constant":
            return [max(1, int(round(d.params["value"])))] * len(rows)
        return [max(1, int(round(d.sample(rng("len", self.seed, r))))) for r in rows]

    def _responses(self, rows: list[int], prompts) -> list[Text]:
        """Each row's response: its ``response_tokens`` random digits (draws keyed by the row)."""
        lengths = self._lengths(rows)
        if not rows:
            return []
        digits = (uniforms(("tokens", self.seed), rows, max(lengths)) * 10).astype(np.int64)
        out = []
        seen: dict[str, tuple] = {}  # a plain-text prompt's (ids, text): a group's rows share it
        for i, (n, p) in enumerate(zip(lengths, prompts)):
            ds = digits[i, :n].tolist()
            if type(p) is str:
                got = seen.get(p)
                if got is None:
                    got = seen[p] = (_prompt_ids(p), _prompt_text(p))
                ids, text = got
            else:
                ids, text = _prompt_ids(p), _prompt_text(p)
            out.append(Text("".join(map(str, ds)), [DIGIT0 + d for d in ds], ids,
                            prompt_text=text))
        return out

    def _per_tokens(self, rows: list[int], name: str, lengths: list[int]) -> list[list[float]]:
        """Per-token floats of each row: log-probs (< 0) or, for a ``*values`` name, values in
        [-1, 1]; drawn by row, so a row gets the same numbers in any batch."""
        if not rows:
            return []
        u = uniforms((name, self.seed), rows, max(lengths))
        if "value" in name:
            x = np.round(u * 2.0 - 1.0, 6)
        else:  # minus an exponential(2) draw, less 1e-3: always < 0
            x = np.round(np.log1p(-u) / 2.0 - 1e-3, 6)
        return [x[i, :n].tolist() for i, n in enumerate(lengths)]

    def _outputs(self, batch: Columns, names) -> Columns:
        """Deterministic outputs ``names`` for every row of ``batch``."""
        rows = self.rows_of(batch)
        prompts = batch.get("prompt", [None] * len(rows))
        responses = self._responses(rows, prompts)
        makes_text = any(n == "response" or n.endswith("response") for n in names)
        lengths = [len(t.ids) for t in
                   (responses if makes_text else _token_source(batch, len(rows)) or responses)]
        cols: Columns = {}
        for name in names:
            if name == "response" or name.endswith("response"):
                cols[name] = responses
            elif name.endswith("logprobs") or name.endswith("values"):
                cols[name] = self._per_tokens(rows, name, lengths)
            else:
                cols[name] = np.round(uniforms((name, self.seed), rows, 1)[:, 0], 6).tolist()
        return cols

    # -- Rollout -----------------------------------------------------------------------------
    def schedule(self, batch: Columns) -> list[tuple[float, int]]:
        """``(finish_seconds, i)`` per row in completion order (unscaled); last = makespan."""
        return slot_schedule([self.latency_of(r) for r in self.rows_of(batch)], self.slots)

    def generate(self, batch: Columns) -> Columns:
        """All rows through ``slots`` slots; sleeps the slot makespan once, returns the outputs."""
        if self.spec.extra.get("env"):  # multi-turn, lock-step (asyncflow/engines/sim_turns.py)
            return sim_turns.generate(self, batch)
        done = self.schedule(batch)
        self.sleep(done[-1][0] if done else 0.0)
        return self._outputs(batch, self.spec.outputs or ("response", "logprobs"))

    def generate_iter(self, batch: Columns) -> Iterator[tuple[int, dict]]:
        """Yield ``(i, {field: value})`` as each sample finishes, in completion order."""
        names = self.spec.outputs or ("response", "logprobs")
        cols = self._outputs(batch, names)
        start = time.monotonic()
        for finish, i in self.schedule(batch):
            self._sleep_until(start + finish * self.time_scale)
            yield i, {name: cols[name][i] for name in names}

    def generate_stream(self, batch: Columns, emit: Callable[[int, dict], Any]) -> Columns:
        """Call ``emit(i, outputs)`` as each sample finishes; then return all the columns."""
        names = self.spec.outputs or ("response", "logprobs")
        cols: Columns = {name: [None] * _n_rows(batch) for name in names}
        for i, out in self.generate_iter(batch):
            emit(i, out)
            for name in names:
                cols[name][i] = out[name]
        return cols

    def serve(self, pull: Callable[[int], Columns | None], emit: Callable[[dict], Any],
              poll: float = 0.002) -> int:
        """Continuous batching across steps: keep up to ``slots`` samples in flight.

        ``pull(k)`` returns a column batch of at most ``k`` rows (empty when none is ready yet)
        or ``None`` when no more rows will come; ``emit(row)`` receives each finished sample as
        ``{"_row", "_group"?, "_version", output fields...}``. Returns the number served."""
        if self.spec.extra.get("env"):  # multi-turn, one state machine per episode (sim_turns)
            return sim_turns.serve(self, pull, emit)
        names = self.spec.outputs or ("response", "logprobs")
        flight: dict[int, tuple] = {}  # row -> (finish wall time, row dict, version at start)
        heap: list = []  # (finish, seq, row): entries whose row left flight are skipped
        seq = served = 0
        exhausted = False
        self._flight = flight
        while True:
            if self._restart:  # on_update: abort -- in flight restart with the new weights
                self._restart = False
                now = time.monotonic()
                for r, (_, row, _) in list(flight.items()):
                    row["_version"] = self.version
                    finish = now + self.latency_of(r) * self.time_scale
                    flight[r] = (finish, row, self.version)
                    heapq.heappush(heap, (finish, seq, r))
                    seq += 1
            free = self.slots - len(flight)
            if not exhausted:
                got = pull(max(free, 0))
                if got is None:
                    exhausted = True
                else:
                    for r in got.get("_cancel") or ():
                        if flight.pop(int(r), None) is not None:
                            self.cancelled += 1
                    if _n_rows({k: v for k, v in got.items() if k != "_cancel"}):
                        now, rows = time.monotonic(), self.rows_of(got)
                        cols = self._outputs(got, names)
                        for i, r in enumerate(rows):
                            row = {"_row": r, "_version": self.version}
                            if "_group" in got:
                                row["_group"] = got["_group"][i]
                            row.update({name: cols[name][i] for name in names})
                            finish = now + self.latency_of(r) * self.time_scale
                            flight[r] = (finish, row, self.version)
                            heapq.heappush(heap, (finish, seq, r))
                            seq += 1
                        continue
            while heap and (heap[0][2] not in flight or flight[heap[0][2]][0] != heap[0][0]):
                heapq.heappop(heap)  # cancelled or restarted
            if not heap:
                if exhausted:
                    return served
                time.sleep(poll)
                continue
            wake = heap[0][0]
            if not exhausted:
                wake = min(wake, time.monotonic() + poll)  # new rows, cancels, weights meanwhile
            self._sleep_until(wake)
            while heap and heap[0][0] <= time.monotonic():
                finish, _, r = heapq.heappop(heap)
                if r in flight and flight[r][0] == finish:
                    emit(flight.pop(r)[1])
                    served += 1

    def update_weights(self, weights: Any, version: int) -> None:
        """Adopt ``weights`` as policy ``version`` (sleeps ``sync_seconds``). Samples in flight
        in :meth:`serve`: ``on_update: abort`` restarts them with the new version (counted in
        ``aborted``); otherwise (``continue``) they keep their start version, the oldest."""
        self.sleep(self.sync_seconds)
        with self._lock:
            self.weights, self.version = weights, int(version)
            self.adopted.append(int(version))
            self.flight_at_update.append(len(self._flight))
        if self.spec.extra.get("on_update") == "abort" and self._flight:
            self.aborted += len(self._flight)
            self._restart = True

    # -- Scorer ------------------------------------------------------------------------------
    def logprobs(self, batch: Columns) -> Columns:
        """Per-token floats for ``outputs[0]`` (log-probs < 0, or values in [-1, 1]), one per
        token of the batch's response; sleeps ``seconds_per_sample * n``."""
        n = _n_rows(batch)
        self.sleep(self.seconds_per_sample * n / self.devices)
        name = (self.spec.outputs or ("logprobs",))[0]
        rows = self.rows_of(batch)
        source = _token_source(batch, n)
        lengths = [len(t.ids) for t in source] if source else self._lengths(rows)
        return {name: self._per_tokens(rows, name, lengths)}

    # -- Trainer -----------------------------------------------------------------------------
    def train_step(self, batch: Columns) -> dict[str, float]:
        """Sleeps ``seconds_per_sample * n``, bumps the version, returns ``{loss, samples, ...}``.
        The loss falls smoothly with the version, with a little deterministic noise."""
        n = _n_rows(batch)
        self.sleep(self.seconds_per_sample * n / self.devices)
        with self._lock:
            self.version += 1
            self.steps += 1
            v = self.version
        noise = rng("loss", self.seed, v).gauss(0.0, 0.02)
        return {"loss": round(1.0 / (1.0 + 0.05 * v) + noise, 6), "samples": n, "version": v}

    def train_stream(self, micro_batches) -> dict[str, float]:
        """``stream: true``: one step over micro-batches that arrive one by one, each taking
        ``seconds_per_sample * its rows`` of device time, and the device works while the next is
        read: a micro-batch starts when it has come and the one before is done (one queued, as
        an accelerator's stream: the loop waits only for the device to take it); the step ends
        when the last is done. Then as :meth:`train_step`."""
        n = 0
        done = time.monotonic()  # when the device is done with what it was given
        for batch in micro_batches:  # reads the next micro-batch (the device works meanwhile)
            k = _n_rows(batch)
            start = max(time.monotonic(), done)
            self._sleep_until(start)  # the one before is still on the device
            done = start + self.seconds_per_sample * k / self.devices * self.time_scale
            n += k
        self._sleep_until(done)
        with self._lock:
            self.version += 1
            self.steps += 1
            v = self.version
        noise = rng("loss", self.seed, v).gauss(0.0, 0.02)
        return {"loss": round(1.0 / (1.0 + 0.05 * v) + noise, 6), "samples": n, "version": v}

    def export_weights(self) -> dict:
        """A small stand-in for the weights: ``{"version", "fingerprint"}``."""
        return {"version": self.version, "fingerprint": self.fingerprint()}

    def fingerprint(self, version: int | None = None) -> str:
        v = self.version if version is None else version
        key = f"{(self.spec.model or {}).get('name', '')}:{self.seed}:{v}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        state = {"task": self.spec.task, "version": self.version, "steps": self.steps,
                 "fingerprint": self.fingerprint()}
        with open(os.path.join(directory, STATE_FILE), "w") as f:
            json.dump(state, f)

    def load(self, directory: str) -> None:
        with open(os.path.join(directory, STATE_FILE)) as f:
            state = json.load(f)
        self.version, self.steps = int(state["version"]), int(state.get("steps", 0))


def _prompt_text(prompt: Any) -> str | None:
    """The text a simulated model sees: a string as is; a chat (a list of ``{role, content}``
    messages: the sim has no tokenizer, so no chat template) one ``role: content`` line per
    message, never the list's Python repr."""
    if prompt is None:
        return None
    from asyncflow.modelsrc import is_chat

    if is_chat(prompt):
        return "".join(f"{m['role']}: {m['content']}\n" for m in prompt)
    return str(prompt)


def _prompt_ids(prompt: Any) -> tuple:
    if isinstance(prompt, Text) and prompt.ids:
        return prompt.ids
    if prompt is None:
        return ()
    return tuple(sim_turns.tokenizer().encode(_prompt_text(prompt)))


def _token_source(batch: Columns, n: int) -> list[Text] | None:
    """The first column of ``Text`` (a response) in ``batch``: its rows' token counts."""
    for name, col in batch.items():
        if len(col) == n and n and all(isinstance(t, Text) for t in col):
            if name != "prompt":
                return col
    return None
