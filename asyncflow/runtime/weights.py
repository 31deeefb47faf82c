"""Weight publication and adoption (DESIGN.md, "Weight sync"): deferred, measured.

- The trainer, after train step ``n``, *publishes* version ``n + 1``: ``export_weights()``, then
  (on Ray) one ``ray.put`` whose reference goes to the board -- the weights cross the object
  store once, however many replicas adopt them. It does not wait for anyone to adopt.
- A replica fed through a sync edge *adopts* the newest published version between requests
  (``update_weights``), never in the middle of one.
- Exposed sync time is the time a worker is blocked on sync: the trainer's export + put +
  publish, a replica's fetch + ``update_weights``. Both are measured and reported per step.

The board keeps only the newest version of each model (older ones are never adopted: a replica
jumps straight to the newest). Weights travel boxed in a one-element list so that Ray passes the
object reference through actor calls instead of resolving it.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from asyncflow.runtime.options import DEFAULT_CALL_TIMEOUT_S


class WeightBoard:
    """The newest published (version, boxed weights) of every trained model (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._latest: dict[str, tuple[int, list]] = {}
        self.published: list[tuple[str, int, float]] = []  # (model, version, time.time())
        self._closed = False

    def publish(self, model: str, version: int, box: list) -> None:
        with self._lock:
            cur = self._latest.get(model)
            if cur is None or version > cur[0]:
                self._latest[model] = (int(version), box)
            self.published.append((model, int(version), time.time()))
            self._lock.notify_all()

    def newer(self, known: dict[str, int], timeout: float = 0.0) -> dict[str, tuple[int, list]]:
        """``{model: (version, box)}`` for every model whose newest version beats ``known``;
        with ``timeout`` > 0, waits up to that long for a publication when there is nothing
        newer yet (a gated rollout waits here, woken at once by :meth:`publish`)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                newer = {m: vb for m, vb in self._latest.items()
                         if m in known and vb[0] > known[m]}
                left = deadline - time.monotonic()
                if newer or left <= 0 or self._closed:
                    return newer
                self._lock.wait(left)

    def wake(self) -> None:
        """The run is stopping: wake every waiter; later waits return at once."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def version(self, model: str) -> int:
        with self._lock:
            cur = self._latest.get(model)
            return cur[0] if cur else 0

    def versions(self) -> dict[str, int]:
        with self._lock:
            return {m: v for m, (v, _) in self._latest.items()}


class FlatWeights:
    """A state dict of CPU tensors as one contiguous byte buffer (numpy) and a table of (name,
    dtype, shape, offset): Ray's object store moves the buffer without pickling each tensor,
    and the reader rebuilds every tensor with one copy of the buffer. Measured on a 2-core CPU
    machine, ``ray.put`` + ``ray.get`` of tiny_decoder's state dict, before -> packed: 2 x 64
    4.3 -> 2.2 ms, 4 x 128 17.2 -> 9.2 ms, 4 x 256 29.8 -> 17.9 ms (the put is the trainer's
    PUBLISH, the get a rollout's ADOPT: both on the weight-sync critical path)."""

    __slots__ = ("table", "buf")
    ALIGN = 64  # every tensor starts on a 64-byte boundary (so a byte view casts to any dtype)

    def __init__(self, table: list, buf):
        self.table, self.buf = table, buf

    @classmethod
    def pack(cls, state: dict) -> "FlatWeights | None":
        """``state`` packed, or None when it is not a dict of CPU tensors (sent as it is).
        Never imports torch: weights can only be tensors where torch is already imported (a
        sim engine's trainer does not pay torch's import at its first publish)."""
        import sys

        torch = sys.modules.get("torch")
        if torch is None or not isinstance(state, dict) or not state or not all(
                isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in state.values()):
            return None
        table, off = [], 0
        for name, t in state.items():
            n = t.numel() * t.element_size()
            table.append((name, t.dtype, tuple(t.shape), off, n))
            off += -(-n // cls.ALIGN) * cls.ALIGN
        import numpy as np

        buf = np.empty(off, np.uint8)
        flat = torch.from_numpy(buf)
        for (name, _, _, o, n), t in zip(table, state.values()):
            if n:
                flat[o:o + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        return cls(table, buf)

    def unpack(self) -> dict:
        """The state dict again: writable tensors over one private copy of the buffer."""
        import numpy as np
        import torch

        flat = torch.from_numpy(np.array(self.buf))  # the object store's buffer is read-only
        return {name: flat[o:o + n].view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)
                for name, dtype, shape, o, n in self.table}


def box_weights(weights: Any, use_ray: bool) -> Any:
    """The store's payload: on Ray the weights put in the object store once (a state dict of
    CPU tensors as :class:`FlatWeights`), without Ray the weights themselves."""
    if use_ray:
        import ray

        flat = FlatWeights.pack(weights)
        return ray.put(flat if flat is not None else weights)
    return weights


def unbox_weights(payload: Any, use_ray: bool,
                  timeout_s: float = DEFAULT_CALL_TIMEOUT_S) -> Any:
    """:func:`box_weights`' payload unboxed; on Ray a get bounded by ``timeout_s``."""
    if use_ray:
        import ray

        got = ray.get(payload, timeout=timeout_s)
        return got.unpack() if isinstance(got, FlatWeights) else got
    return payload


# A board entry ("box") is a one-element list (Ray passes an object reference inside it through
# actor calls instead of resolving it) holding {"store": payload} and/or {"collective":
# descriptor}, one per way the trainer's sync edges send the model (SyncPlan.via).


class Adopter:
    """A worker's view of the models it receives: adopts the newest version between requests,
    each model the way its sync edge says (``vias``: model -> "store" | "collective")."""

    def __init__(self, engine, models: list[str], use_ray: bool, vias: dict | None = None,
                 replica: str = "", delta: dict | None = None,
                 call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S):
        self.engine = engine
        self.call_timeout_s = float(call_timeout_s)  # the bound of a weight payload's get
        self.known: dict[str, int] = {m: 0 for m in models}
        self.use_ray = use_ray
        self.vias = dict(vias or {})
        self.delta = dict(delta or {})
        self.replica = replica
        self.receivers: dict = {}  # model -> collective.Receiver
        self.exposed_s = 0.0  # seconds blocked on fetch + update_weights, cumulative
        self.bytes = 0  # bytes received through collectives, cumulative
        self.adoptions: list[tuple[str, int, float, float]] = []  # (model, version, start, end)
        self._failing: dict[str, float] = {}  # model -> when its collective fetches began failing
        self.last_error = ""  # the last failed collective fetch, as text

    @property
    def version(self) -> int:
        """The (policy) version this worker generates with: the oldest of its models'."""
        return min(self.known.values()) if self.known else 0

    def adopt(self, newer: dict[str, tuple[int, list]]) -> bool:
        """Take up every newer version offered (call only between requests)."""
        took = False
        for model, (version, box) in sorted(newer.items()):
            if version <= self.known.get(model, -1):
                continue
            t = time.time()
            entry = box[0]
            if self.vias.get(model) == "collective" and "collective" in entry:
                got = self._fetch(model, entry["collective"])
                if got is None:
                    continue
                version = got
            else:
                weights = unbox_weights(entry["store"], self.use_ray, self.call_timeout_s)
                update = getattr(self.engine, "update_weights", None)
                if update is not None:
                    update(weights, version)
            end = time.time()
            self.exposed_s += end - t
            self.adoptions.append((model, version, t, end))
            self.known[model] = version
            took = True
        return took

    def _fetch(self, model: str, desc: dict) -> int | None:
        """One collective sync of ``model``: the version taken, or None after a failure that
        may pass (a trainer restarting: the next heartbeat offers its new address); AF638 once
        fetches have failed for longer than the peer wait."""
        from asyncflow.runtime import collective

        rec = self.receivers.get(model)
        if rec is None:
            rec = self.receivers[model] = collective.Receiver(
                self.replica, getattr(self.engine, "device", None), self.delta.get(model, False))
        try:
            version, chunks, partial = rec.fetch(desc)
            before = rec.bytes[-1]
            collective.feed(self.engine, version, chunks, partial, rec)
        except Exception as e:  # noqa: BLE001 - judged below: a coded error, or tried again
            rec.reset()
            self.last_error = f"{type(e).__name__}: {e}"
            first = self._failing.setdefault(model, time.time())
            if time.time() - first > rec.timeout:
                from types import SimpleNamespace

                from asyncflow.errors import TaskError

                raise TaskError("AF638", SimpleNamespace(name=self.replica, loc=""), model=model,
                                at=f"{desc.get('host')}:{desc.get('port')}",
                                waited=f"{rec.timeout:g}",
                                error=f"{type(e).__name__}: {e}") from e
            time.sleep(0.2)
            return None
        self._failing.pop(model, None)
        self.bytes += before
        return version

class Publisher:
    """A trainer's sending side: per model, the object store and/or a collective
    :class:`asyncflow.runtime.collective.Sender` (started at the first publication)."""

    def __init__(self, engine, use_ray: bool, syncs: list):
        self.engine, self.use_ray = engine, use_ray
        self.vias: dict[str, set] = {}
        self.opts: dict[str, tuple[int, bool]] = {}
        for s in syncs:
            self.vias.setdefault(s.model, set()).add(s.via)
            if s.via == "collective":
                b, d = self.opts.get(s.model, (s.bucket_bytes, s.delta))
                self.opts[s.model] = (min(b, s.bucket_bytes), d or s.delta)
        self.senders: dict = {}

    def publish(self, model: str, version: int, send: Callable[[str, int, list], Any]) -> float:
        """Export the trainer's weights as ``version`` and hand them to ``send`` (the board);
        returns the seconds the trainer was blocked (exposed sync time)."""
        t = time.time()
        export = getattr(self.engine, "export_weights", None)
        weights = export() if export is not None else None
        entry: dict = {}
        vias = self.vias.get(model) or {"store"}
        if "store" in vias:
            entry["store"] = box_weights(weights, self.use_ray)
        if "collective" in vias:
            entry["collective"] = self._sender(model).publish(version, weights)
        send(model, int(version), [entry])
        return time.time() - t

    def _sender(self, model: str):
        from asyncflow.runtime import collective
        from asyncflow.runtime.devices import node_address

        s = self.senders.get(model)
        if s is None:
            bucket, delta = self.opts[model]
            s = self.senders[model] = collective.Sender(
                model, node_address(self.use_ray), getattr(self.engine, "device", None),
                bucket, delta)
        return s

    def latest(self, model: str) -> tuple[int, Any] | None:
        """The newest (version, weights) this trainer published through its collective."""
        s = self.senders.get(model)
        return s.latest() if s is not None else None

    def close(self) -> None:
        for s in self.senders.values():
            s.close()
