"""Trace and metrics recording: RUN_DIR/trace.json (Chrome trace) and RUN_DIR/metrics.jsonl.

Every op a worker runs is one :class:`Span` ``(worker, task, op, rows, version, step, start,
end)``; workers buffer them in a :class:`Recorder` and flush them in batches to the run's
control (never one call per op on Ray). ``trace.json`` is the Chrome trace format that Perfetto
and ``chrome://tracing`` open::

    {"traceEvents": [
        {"name": "COMPUTE", "cat": "generate", "ph": "X", "ts": 1200.0, "dur": 350.0,
         "pid": "rollout", "tid": "generate/0", "args": {"rows": 8, "version": 1, "step": 2}},
        {"name": "process_name", "ph": "M", "pid": "rollout", "args": {"name": "rollout"}},
        {"name": "thread_name", "ph": "M", "pid": "rollout", "tid": "generate/0",
         "args": {"name": "generate/0"}}, ...],
     "displayTimeUnit": "ms",
     "otherData": {"startup_s": {"imports and compile": 0.9, "backend": 2.8, ...}}}

``ts``/``dur`` are microseconds since the run started; ``pid`` is the worker's pool (``"cpu"``
for pool-less tasks), ``tid`` its worker id. ``metrics.jsonl`` holds one JSON object per train
step (keys in :data:`METRIC_KEYS`, plus the trainer's own metrics such as ``loss``).

Busy time is accounted separately from spans (:meth:`Recorder.busy`): a batch worker is busy
while it computes; a continuous-batching rollout is busy in proportion to its occupied slots, so
a long-tail step that keeps 1 of 64 slots busy shows as the idle device it is.
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import dataclass

METRIC_KEYS = ("step", "version", "time", "step_time", "samples", "samples_per_s", "reward_mean",
               "reward_std", "staleness_mean", "staleness_max", "dropped", "utilization",
               "bubble_fraction", "queue_depth", "exposed_sync_s")


@dataclass
class Span:
    worker: str
    task: str
    op: str
    rows: int
    version: int | None
    step: int | None
    start: float  # time.time()
    end: float
    pool: str

    def chrome(self, t0: float) -> dict:
        return {"name": self.op, "cat": self.task, "ph": "X",
                "ts": round((self.start - t0) * 1e6, 1),
                "dur": round(max(self.end - self.start, 0.0) * 1e6, 1),
                "pid": self.pool, "tid": self.worker,
                "args": {"rows": self.rows, "version": self.version, "step": self.step}}


class Recorder:
    """One worker's span buffer and busy-time integral (thread-safe)."""

    def __init__(self, worker: str, task: str, pool: str | None):
        self.worker, self.task, self.pool = worker, task, pool or "cpu"
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        self._busy = 0.0  # seconds busy, completed
        self._busy_since: float | None = None  # a computation in progress (batch workers)
        self._occ = 0.0  # fraction of slots in use (continuous batching)
        self._occ_since = time.time()

    def span(self, op: str, rows: int, start: float, end: float | None = None,
             version: int | None = None, step: int | None = None, lane: int = 0) -> None:
        """Record one op. ``lane`` > 0 puts it on its own track ``worker#lane`` (concurrent
        requests of a continuous-batching rollout, which would not nest on one track)."""
        end = time.time() if end is None else end
        tid = self.worker if not lane else f"{self.worker}#{lane}"
        with self._lock:
            self._spans.append(Span(tid, self.task, op, int(rows), version, step,
                                    start, end, self.pool))

    def compute_begin(self) -> float:
        now = time.time()
        with self._lock:
            self._busy_since = now
        return now

    def compute_end(self) -> float:
        now = time.time()
        with self._lock:
            if self._busy_since is not None:
                self._busy += now - self._busy_since
                self._busy_since = None
        return now

    def occupancy(self, fraction: float) -> None:
        """Continuous batching: the fraction of slots in use from now on."""
        now = time.time()
        with self._lock:
            self._busy += self._occ * (now - self._occ_since)
            self._occ, self._occ_since = float(fraction), now

    def busy(self) -> float:
        """Seconds busy so far, including the computation or occupancy in progress."""
        now = time.time()
        with self._lock:
            b = self._busy + self._occ * (now - self._occ_since)
            if self._busy_since is not None:
                b += now - self._busy_since
            return b

    def drain(self) -> list[Span]:
        with self._lock:
            out, self._spans = self._spans, []
            return out


def chrome_trace(spans: list[Span], t0: float, workers: dict[str, str] | None = None,
                 other: dict | None = None) -> dict:
    """The Chrome-trace document of ``spans`` (``workers``: worker id -> pool, for metadata of
    workers that recorded nothing; ``other``: the format's ``otherData``, e.g. the run's
    ``startup_s`` phases)."""
    events = [s.chrome(t0) for s in sorted(spans, key=lambda s: (s.start, s.worker))]
    threads = dict(workers or {})
    for s in spans:
        threads.setdefault(s.worker, s.pool)
    meta = []
    for pool in sorted(set(threads.values())):
        meta.append({"name": "process_name", "ph": "M", "pid": pool, "args": {"name": pool}})
    for w, pool in sorted(threads.items()):
        meta.append({"name": "thread_name", "ph": "M", "pid": pool, "tid": w, "args": {"name": w}})
    doc = {"traceEvents": meta + events, "displayTimeUnit": "ms"}
    if other:
        doc["otherData"] = other
    return doc


def write_trace(path: str, spans: list[Span], t0: float, workers: dict[str, str] | None = None,
                other: dict | None = None) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(chrome_trace(spans, t0, workers, other), f)
    os.replace(tmp, path)


def json_safe(x):
    """JSON-safe: NaN/inf become null, numpy scalars become Python numbers."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        try:
            x = x.item()
        except Exception:
            return str(x)
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class MetricsLog:
    """RUN_DIR/metrics.jsonl: appended and flushed one line per step; every row also goes to
    TensorBoard (RUN_DIR/tensorboard/, when ``tensorboard`` is installed:
    :class:`asyncflow.runtime.loggers.TensorBoard`, whose writer is made off the start-up path)
    and to ``loggers`` (:class:`asyncflow.runtime.loggers.Loggers`, the ``--log`` ones: started
    and finished by their owner, not here). :meth:`text` gives a step's samples
    (:mod:`asyncflow.runtime.samples`) to the same loggers."""

    def __init__(self, path: str | None, tensorboard: bool = True, loggers=None):
        from asyncflow.runtime.loggers import TensorBoard

        self.path = path
        self.rows: list[dict] = []
        self._f = open(path, "w") if path else None
        self._tb = TensorBoard(os.path.join(os.path.dirname(path), "tensorboard")) \
            if path and tensorboard else None
        self.loggers = loggers

    def _each(self):
        if self._tb is not None:
            yield self._tb
        if self.loggers:
            yield self.loggers

    def append(self, row: dict) -> None:
        """A train step's row: kept in :attr:`rows` (one per step) and written."""
        row = json_safe(row)
        self.rows.append(row)
        self._write(row)

    def append_eval(self, row: dict) -> None:
        """An evaluation's row (``eval/...`` keys; ``step``: the version it ran on,
        runtime/evaluate.py): a line of its own in metrics.jsonl and in every logger, not one
        of :attr:`rows`."""
        self._write(json_safe(row))

    def _write(self, row: dict) -> None:
        if self._f:
            self._f.write(json.dumps(row) + "\n")
            self._f.flush()
        if isinstance(row.get("step"), int):
            for lg in self._each():
                lg.log(row["step"], row)

    def text(self, step: int, samples: list[dict]) -> None:
        """A step's sample rows (TensorBoard's text tab, every logger's samples)."""
        if samples:
            for lg in self._each():
                lg.text(step, samples)

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None
        if self._tb is not None:
            self._tb.finish()
            self._tb = None


def mean_std(xs) -> tuple[float | None, float | None]:
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))
