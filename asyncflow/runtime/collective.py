"""Weight sync through a collective group (``via: collective``, docs/weight-sync.md).

The object store (``via: store``, :mod:`asyncflow.runtime.weights`) copies a trainer's weights
into Ray's object store once per version and every replica reads them back. A collective edge
moves them instead as ``torch.distributed`` broadcasts, in buckets, from the trainer's process
straight into each replica's engine: NCCL between two GPUs, gloo otherwise (the CPU, or two
engines on one GPU, which NCCL refuses).

The semantics are the store's (versions, staleness, adoption between requests): the trainer
publishes version n without waiting for anyone, a replica adopts the newest version when it is
between requests. So each replica has its own group with the trainer (two ranks: the trainer 0,
the replica 1) and is served when *it* asks, not when the trainer publishes:

- PUBLISH (:meth:`Sender.publish`): the trainer keeps the exported weights as the newest
  snapshot, starts (once) a ``TCPStore`` on a free port of its node and a serving thread, and
  puts on the weight board only a small descriptor (address, port, version, device).
- ADOPT (:meth:`Receiver.fetch`): the replica posts a request (its id, its incarnation, the
  version it holds) under the next sequence number; on a new incarnation (first contact, or a
  replica that died and came back) both sides build their group for it, rank 0 and 1, over the
  store (bounded by ``timeout``: a peer that never arrives is AF638, never a hang); the trainer
  broadcasts a header, a table of contents and the buckets; the replica hands the tensors to its
  engine bucket by bucket (``update_weights_stream``, the engine's own loading path).
- Delta (``delta: true``): the trainer keeps the snapshot each replica last received and sends,
  per tensor, nothing when no element changed, the changed elements (indices and values) when
  that is smaller, else the tensor; the replica keeps a copy of what it holds, applies the
  changes and hands the engine only the tensors that changed (``partial=True``).

Bytes per sync (the buckets' bytes, header excluded) are counted on both sides.
"""
from __future__ import annotations

import datetime
import json
import logging
import threading
import time
import uuid
from typing import Any, Iterator

log = logging.getLogger(__name__)

PEER_WAIT_S = 120.0  # how long either side waits for the other to join a group (then AF638)
HEADER = 4  # int64s: version, table bytes, buckets, payload bytes


def _torch():
    import torch

    return torch


def _dist():
    import torch.distributed as dist

    return dist


def device_id(device: str | None) -> str:
    """``cuda:<uuid>`` for a CUDA device (so two processes can tell whether they share one),
    ``cpu`` otherwise."""
    if not device or not str(device).startswith("cuda"):
        return "cpu"
    torch = _torch()
    try:
        return f"cuda:{torch.cuda.get_device_properties(torch.device(device)).uuid}"
    except Exception as e:  # noqa: BLE001 - an unknown device cannot share NCCL with anyone
        log.warning("collective: %s's UUID could not be read (%s: %s); its weights travel by "
                    "gloo, as from the CPU", device, e.__class__.__name__, e)
        return "cpu"


def backend_for(a: str, b: str) -> str:
    """NCCL between two different CUDA devices, gloo otherwise (NCCL refuses two ranks on one
    device; the CPU has only gloo)."""
    return "nccl" if a.startswith("cuda:") and b.startswith("cuda:") and a != b else "gloo"


def _group(backend: str, store, prefix: str, rank: int, timeout: float):
    dist = _dist()
    sub = dist.PrefixStore(prefix, store)
    td = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = td
        return dist.ProcessGroupNCCL(sub, rank, 2, opts)
    return dist.ProcessGroupGloo(sub, rank, 2, td)


def _broadcast(pg, t) -> None:
    dist = _dist()
    o = dist.BroadcastOptions()
    o.rootRank = 0
    pg.broadcast([t], o).wait()


# -- packing ----------------------------------------------------------------------------------

def _bits(t):
    """``t`` viewed as integers of its element size (exact comparison, NaN and -0.0 included)."""
    torch = _torch()
    size = t.element_size()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return t.contiguous().view(as_int).reshape(-1)


def encode(state: dict, base: dict | None) -> list[tuple[str, str, Any]]:
    """``[(name, how, payload)]``: ``how`` is ``full`` (the tensor), ``sparse`` (int32/int64
    indices and the values there, against ``base``) or absent (unchanged: not listed)."""
    torch = _torch()
    out = []
    for name, t in state.items():
        t = t.detach().contiguous()
        b = None if base is None else base.get(name)
        if b is None or b.shape != t.shape or b.dtype != t.dtype:
            out.append((name, "full", t))
            continue
        idx = torch.nonzero(_bits(t) != _bits(b)).reshape(-1)
        if idx.numel() == 0:
            continue
        idx = idx.to(torch.int32 if t.numel() < 2**31 else torch.int64)
        if idx.numel() * (idx.element_size() + t.element_size()) < t.numel() * t.element_size():
            out.append((name, "sparse", (idx, t.reshape(-1)[idx.long()])))
        else:
            out.append((name, "full", t))
    return out


def _raw(t):
    return t.reshape(-1).view(_torch().uint8)


ALIGN = 8  # every part starts on an 8-byte boundary (so a byte view casts to any dtype)


def pack(entries: list, bucket_bytes: int) -> tuple[list[dict], list]:
    """The table of contents and the byte buckets (each at most ``bucket_bytes``, a larger
    tensor alone) of encoded entries; each part of an entry at an offset of its own."""
    torch = _torch()
    table, buckets, cur, size = [], [], [], 0

    def flush():
        nonlocal cur, size
        if cur:
            buckets.append(torch.cat(cur) if len(cur) > 1 else cur[0].clone())
        cur, size = [], 0

    for name, how, payload in entries:
        parts = [payload] if how == "full" else list(payload)
        raws = [_raw(p) for p in parts]
        n = sum(-(-r.numel() // ALIGN) * ALIGN for r in raws)
        if size and size + n > bucket_bytes:
            flush()
        rec = {"name": name, "how": how, "bucket": len(buckets), "parts": []}
        for p, r in zip(parts, raws):
            rec["parts"].append([str(p.dtype).removeprefix("torch."), list(p.shape), size,
                                 r.numel()])
            pad = -(-r.numel() // ALIGN) * ALIGN - r.numel()
            cur.append(r)
            if pad:
                cur.append(torch.zeros(pad, dtype=torch.uint8))
            size += r.numel() + pad
        table.append(rec)
    flush()
    return table, buckets


def unpack(rec: dict, bucket) -> list:
    """The tensors of one table record, views into its (received) bucket."""
    torch = _torch()
    return [bucket[off:off + n].view(getattr(torch, dtype)).reshape(shape)
            for dtype, shape, off, n in rec["parts"]]


# -- the trainer's side -----------------------------------------------------------------------

class Sender:
    """The trainer's end of a model's collective edges: the newest snapshot, a ``TCPStore``
    on a free port, one thread serving the replicas' requests in the order they come. A full
    copy is packed into buckets once per version and kept for the next replica that asks (one
    more copy of the weights in host memory, until the next version)."""

    def __init__(self, model: str, host: str, device: str | None, bucket_bytes: int,
                 delta: bool, timeout: float | None = None):
        timeout = PEER_WAIT_S if timeout is None else timeout
        from torch.distributed import TCPStore

        self.model, self.host, self.bucket_bytes, self.delta = model, host, int(bucket_bytes), delta
        self.device, self.dev_id, self.timeout = device, device_id(device), timeout
        self.store = TCPStore(host, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout))
        self.port = self.store.port
        self._lock = threading.Lock()
        self._latest: tuple[int, dict] | None = None
        self._held: dict[str, tuple] = {}  # delta: replica -> (incarnation, version, state) sent
        self._full: tuple | None = None  # (version, table, buckets) of the last full copy packed
        self._groups: dict[str, tuple[str, Any]] = {}  # replica id -> (incarnation, group)
        self._next, self._closed = 1, False
        self.sent_bytes = 0
        self.served: list[dict] = []  # one record per sync served
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._serve, name=f"asyncflow:sync:{model}",
                                        daemon=True)
        self._thread.start()

    def publish(self, version: int, state: dict) -> dict:
        """Take ``state`` as version ``version``; the board's descriptor of it."""
        with self._lock:
            self._latest = (int(version), state)
        return {"via": "collective", "host": self.host, "port": self.port,
                "version": int(version), "device": self.dev_id}

    def latest(self) -> tuple[int, dict] | None:
        """The newest (version, weights) published: what the next request is served."""
        with self._lock:
            return self._latest

    def close(self) -> None:
        """Stop serving (wakes the thread with a request of its own)."""
        if self._closed:
            return
        self._closed = True
        try:  # through a connection of its own: the thread's wait holds the store's client
            from torch.distributed import TCPStore

            own = TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
            n = own.add("seq", 1)
            own.set(f"req/{n}", json.dumps({"stop": True}))
        except Exception as e:  # noqa: BLE001 - the store is going away with the process anyway
            log.info("collective: the sender's serving thread was not told to stop (%s: %s); "
                     "it ends with the process", e.__class__.__name__, e)
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        forever = datetime.timedelta(days=365)
        while not self._closed:
            key = f"req/{self._next}"
            try:
                self.store.wait([key], forever)
                req = json.loads(self.store.get(key))
            except Exception as e:  # noqa: BLE001 - the store closed: the trainer is ending
                if not self._closed:
                    self.errors.append(f"{type(e).__name__}: {e}")
                return
            self._next += 1
            if req.get("stop"):
                return
            try:
                self._serve_one(req)
            except Exception as e:  # noqa: BLE001 - that replica's group is dropped; it asks again
                self.errors.append(f"{req.get('replica')}: {type(e).__name__}: {e}")
                self._groups.pop(req.get("replica"), None)

    def _serve_one(self, req: dict) -> None:
        torch = _torch()
        rid, inc = req["replica"], req["incarnation"]
        backend = backend_for(self.dev_id, req.get("device", "cpu"))
        held = self._groups.get(rid)
        if held is None or held[0] != inc:  # first contact, or a replica that came back
            pg = _group(backend, self.store, f"pg/{rid}/{inc}/", 0, self.timeout)
            self._groups[rid] = (inc, pg)
        pg = self._groups[rid][1]
        with self._lock:
            version, state = self._latest
        t0 = time.time()
        base = self._held.get(rid) if self.delta else None  # (incarnation, version, state)
        if base is not None and base[:2] != (inc, int(req.get("have", -1))):
            base = None  # a new incarnation, or it holds something else: send it all
        if base is not None:
            table, buckets = pack(encode(state, base[2]), self.bucket_bytes)
        else:  # a full copy: packed once per version, whichever replicas ask for it
            if self._full is None or self._full[0] != version:
                self._full = (version, *pack(encode(state, None), self.bucket_bytes))
            _, table, buckets = self._full
        meta = json.dumps({"version": version, "table": table,
                           "full": base is None}).encode()
        nbytes = sum(int(b.numel()) for b in buckets)
        dev = "cuda" if backend == "nccl" else "cpu"
        header = torch.tensor([version, len(meta), len(buckets), nbytes], dtype=torch.int64)
        _broadcast(pg, header.to(dev))
        _broadcast(pg, torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(dev))
        for b in buckets:
            _broadcast(pg, b.to(dev))
        if self.delta:
            self._held[rid] = (inc, version, state)
        self.sent_bytes += nbytes
        self.served.append({"replica": rid, "version": version, "bytes": nbytes,
                            "tensors": len(table), "backend": backend,
                            "seconds": time.time() - t0})


# -- a replica's side -------------------------------------------------------------------------

class Receiver:
    """A replica's end of one model's collective edge (one per model it adopts)."""

    def __init__(self, replica: str, device: str | None, delta: bool,
                 timeout: float | None = None):
        timeout = PEER_WAIT_S if timeout is None else timeout
        self.replica, self.device, self.dev_id = replica, device, device_id(device)
        self.incarnation = uuid.uuid4().hex[:12]  # a restarted replica is a new incarnation
        self.delta, self.timeout = delta, timeout
        self._store = None
        self._at: tuple[str, int] | None = None
        self._pg = None
        self.version = -1
        self.shadow: dict = {}  # delta: what this replica holds (CPU)
        self.bytes: list[int] = []  # per sync received

    def reset(self) -> None:
        """Forget the connection and the group (after a failure: the next fetch starts over as
        a new incarnation, with everything sent again)."""
        self._store = self._at = self._pg = None

    def _connect(self, desc: dict) -> None:
        from torch.distributed import TCPStore

        at = (desc["host"], int(desc["port"]))
        if at != self._at:  # first contact, or a trainer that restarted elsewhere
            self._store = TCPStore(at[0], at[1], is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=self.timeout))
            self._at, self._pg = at, None
            self.incarnation = uuid.uuid4().hex[:12]
            self.version, self.shadow = -1, {}

    def fetch(self, desc: dict) -> tuple[int, Iterator[dict], bool]:
        """Ask the trainer for its newest version: ``(version, chunks, partial)``; ``chunks``
        yields ``{name: tensor}`` per bucket and must be consumed before the next fetch."""
        torch = _torch()
        self._connect(desc)
        n = self._store.add("seq", 1)
        self._store.set(f"req/{n}", json.dumps({
            "replica": self.replica, "incarnation": self.incarnation, "device": self.dev_id,
            "have": self.version if self.delta else -1}))
        backend = backend_for(desc.get("device", "cpu"), self.dev_id)
        if self._pg is None:
            self._pg = _group(backend, self._store, f"pg/{self.replica}/{self.incarnation}/", 1,
                              self.timeout)
        dev = "cuda" if backend == "nccl" else "cpu"
        header = torch.empty(HEADER, dtype=torch.int64, device=dev)
        _broadcast(self._pg, header)
        version, meta_n, n_buckets, nbytes = (int(x) for x in header.tolist())
        meta_t = torch.empty(meta_n, dtype=torch.uint8, device=dev)
        _broadcast(self._pg, meta_t)
        meta = json.loads(bytes(meta_t.cpu().numpy()))
        table = meta["table"]
        by_bucket: dict[int, list] = {}
        for rec in table:
            by_bucket.setdefault(rec["bucket"], []).append(rec)
        sizes: dict[int, int] = {}
        for rec in table:
            end = max(-(-(off + n) // ALIGN) * ALIGN for _, _, off, n in rec["parts"])
            sizes[rec["bucket"]] = max(sizes.get(rec["bucket"], 0), end)
        partial = not meta["full"]
        self.bytes.append(nbytes)

        def chunks():
            for i in range(n_buckets):
                buf = torch.empty(sizes[i], dtype=torch.uint8, device=dev)
                _broadcast(self._pg, buf)
                if dev != "cpu":
                    buf = buf.cpu()
                out = {}
                for rec in by_bucket.get(i, []):
                    parts = unpack(rec, buf)
                    if rec["how"] == "full":
                        out[rec["name"]] = parts[0]
                    else:  # sparse: apply to what this replica holds
                        idx, vals = parts
                        t = self.shadow[rec["name"]]
                        t.reshape(-1)[idx.long()] = vals
                        out[rec["name"]] = t
                    if self.delta:  # views of a bucket of this sync's own: no copy needed
                        self.shadow[rec["name"]] = out[rec["name"]]
                yield out
            self.version = version

        return version, chunks(), partial


def feed(engine, version: int, chunks: Iterator[dict], partial: bool, rec: Receiver) -> None:
    """Hand received buckets to the engine: its ``update_weights_stream`` where it has one
    (bucket by bucket; ``partial``: only the tensors that changed), else one ``update_weights``
    of them all (after a delta, all that the receiver holds)."""
    stream = getattr(engine, "update_weights_stream", None)
    if stream is not None:
        stream(chunks, version, partial=partial)
        return
    state: dict = {}
    for c in chunks:
        state.update(c)
    if partial:
        state = dict(rec.shadow)
    update = getattr(engine, "update_weights", None)
    if update is not None:
        update(state, version)
