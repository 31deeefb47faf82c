"""The ``sim`` engine's draws and its slot schedule, shared by :mod:`asyncflow.engines.sim`, its
multi-turn part :mod:`asyncflow.engines.sim_turns` and ``asyncflow simulate``.

Every draw depends only on a key (a seed, a row, a turn, a purpose), never on call order,
batch composition, replica or process: :class:`KeyRandom` (one keyed stream), :func:`uniforms`
(a batch's per-row draws at once, in numpy), :func:`row_latency` (a row's device time).
:func:`slot_schedule` is when rows finish that ``slots`` concurrent slots take in order.
"""
from __future__ import annotations

import hashlib
import heapq
import math
import random

import numpy as np

DIGIT0 = 4  # CharTokenizer id of "0" (asyncflow.models): responses are digit strings

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_TWOPI = 2.0 * math.pi  # random.TWOPI


class KeyRandom(random.Random):
    """A ``random.Random`` whose stream depends only on a key: the key's 64-bit BLAKE2b hash
    seeds a SplitMix64 sequence (stable across processes, platforms and Python versions).

    Seeding costs about 0.5 µs where ``random.Random(str)`` costs 7 µs (SHA-512 plus the
    Mersenne Twister's 2.5 KB state): the sim engine draws several generators per sample, and
    at 16,384 samples a step that was the largest cost of a near-free engine
    (benchmarks/runtime.py). Every distribution method of ``random.Random`` (``gauss``,
    ``lognormvariate``, ``expovariate``, ``randrange``, ...) works on top of :meth:`random` and
    :meth:`getrandbits`."""

    def __init__(self, key: str):  # noqa: D107 -- no Mersenne Twister state is seeded
        self._s = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
        self.gauss_next = None

    def seed(self, *args, **kwargs) -> None:  # random.Random's API; keyed streams only
        raise TypeError("KeyRandom is seeded by its key only")

    def _next(self) -> int:
        self._s = z = (self._s + _GOLDEN) & _M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        return z ^ (z >> 31)

    def random(self) -> float:  # _next, inlined: two draws a simulated sample (gauss)
        self._s = z = (self._s + _GOLDEN) & _M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        return ((z ^ (z >> 31)) >> 11) * (1.0 / 9007199254740992.0)

    def getrandbits(self, k: int) -> int:
        out, have = 0, 0
        while have < k:
            out |= self._next() << have
            have += 64
        return out & ((1 << k) - 1)


def rng(*key) -> random.Random:
    """A generator that depends only on ``key`` (:class:`KeyRandom`)."""
    return KeyRandom(":".join(str(k) for k in key))


def _mix64(z):
    """SplitMix64's finaliser on a numpy uint64 array (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(key: tuple, rows, n: int):
    """``u[i, j]`` in [0, 1): draw ``j`` of row ``rows[i]`` for ``key``, depending only on (key,
    row, j) -- a whole batch's per-row draws in a few numpy operations (the sim engine's
    outputs; per-row :class:`KeyRandom` generators cost microseconds a row)."""
    base = int.from_bytes(hashlib.blake2b(":".join(map(str, key)).encode(),
                                          digest_size=8).digest(), "little")
    with np.errstate(over="ignore"):
        r = np.asarray(rows, dtype=np.int64).astype(np.uint64)[:, None]
        row_state = _mix64(np.uint64(base) ^ _mix64(r * np.uint64(_GOLDEN) + np.uint64(1)))
        j = np.arange(1, n + 1, dtype=np.uint64)[None, :]
        z = _mix64(row_state + j * np.uint64(_GOLDEN))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)



def row_latency(dist, row: int) -> float:
    """The draw of distribution ``dist`` for store row ``row``: depends only on (its ``seed``,
    ``row``), so a row costs the same wherever it runs (and in ``asyncflow simulate``)."""
    key = f"latency:{dist.seed!s}:{row!s}"  # rng(...)'s key
    if dist.dist == "lognormal":  # the usual one: the same draw, without a generator object
        return max(0.0, dist.sample(_Drawn(_gauss(key))))
    return max(0.0, dist.sample(KeyRandom(key)))


def _unit(z: int) -> float:
    """:meth:`KeyRandom.random`'s value at SplitMix64 state ``z`` (the state after its step)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return ((z ^ (z >> 31)) >> 11) * (1.0 / 9007199254740992.0)


def _gauss(key: str) -> float:
    """``KeyRandom(key).gauss()``, bit for bit: its first two draws through
    ``random.Random.gauss`` (Box-Muller), without the generator object (a simulated sample costs
    one: at a million samples the object was a few percent of ``simulate``)."""
    s = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    u1, u2 = _unit((s + _GOLDEN) & _M64), _unit((s + 2 * _GOLDEN) & _M64)  # its two random()s
    return math.cos(u1 * _TWOPI) * math.sqrt(-2.0 * math.log(1.0 - u2))


class _Drawn:
    """A generator whose one ``gauss`` draw is already made (:func:`row_latency`'s lognormal:
    ``Distribution.sample`` turns it into the latency, its cap included)."""

    __slots__ = ("z",)

    def __init__(self, z: float):
        self.z = z

    def gauss(self, mu: float = 0.0, sigma: float = 1.0) -> float:
        return mu + self.z * sigma  # random.Random.gauss's last line


def slot_schedule(latencies: list[float], slots: int) -> list[tuple[float, int]]:
    """``(finish_time, i)`` of each row, in completion order, when rows are taken in order by
    ``slots`` concurrent slots and a freed slot takes the next row at once. The last finish
    time is the makespan."""
    free = [0.0] * max(1, min(slots, len(latencies)))
    done = []
    for i, lat in enumerate(latencies):
        start = heapq.heappop(free)
        heapq.heappush(free, start + lat)
        done.append((start + lat, i))
    done.sort()
    return done
