"""Latency distributions: the one definition the compiler's cost pass and the ``sim`` engine share.

Pure Python (``math``, ``random``, ``statistics``): importing it imports nothing heavy.

A *spec* is what a pipeline writes for a latency (``args.latency`` of a ``sim`` task, or the
``latency`` of a task's ``cost:`` hints), exactly as docs/language.md's sim engine section says:

==============================================  ==============================================
spec                                            distribution (seconds)
==============================================  ==============================================
``0.05`` (a number)                             constant 0.05
``{dist: constant, value: 0.05}``               constant ``value``
``{dist: uniform, min: 0.01, max: 0.1}``        uniform on [min, max]
``{dist: lognormal, median: 0.05, sigma: 1.0,   exp(N(ln median, sigma^2)), capped at ``max``
max: 1.0}``                                     (``max`` optional: uncapped)
``{dist: pareto, scale: 0.01, alpha: 1.5,       scale * U^(-1/alpha) (>= scale), capped at
max: 2.0}``                                     ``max`` (required when alpha <= 1: infinite mean)
==============================================  ==============================================

Every form takes ``seed`` (an int, default 0): :meth:`Distribution.rng` is a ``random.Random``
seeded with it, so a sim replica that draws from ``dist.rng()`` (or from a Random seeded with
``seed`` and its replica index) reproduces its latencies exactly. A cap (``max``) *clips* a draw:
``min(draw, max)``, so the capped distribution has an atom at ``max``.

Methods: ``sample(rng)`` one draw; ``mean()``; ``cdf(x)``; ``quantile(p)``;
``expected_max(k)`` the expected maximum of ``k`` independent draws (what a synchronous step
waits for), computed by numeric integration of the order statistic -- deterministic, no sampling:
``E[max of k] = integral_0^1 Q(v^(1/k)) dv`` (substituting ``u = v^(1/k)`` in
``integral_0^1 Q(u) k u^(k-1) du``), midpoint rule on 2048 points (cached per distribution and k); closed forms where they exist.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from statistics import NormalDist

DISTS = {
    "constant": ("value",),
    "uniform": ("min", "max"),
    "lognormal": ("median", "sigma"),
    "pareto": ("scale", "alpha"),
}
OPTIONAL = {"constant": (), "uniform": (), "lognormal": ("max",), "pareto": ("max",)}
_N = 2048  # integration points for expected_max
_EMAX_CACHE: dict = {}  # (dist, params, k) -> E[max of k]; the seed does not change it
_STD = NormalDist()


class SpecError(ValueError):
    """A latency spec that cannot be read; ``key`` names the offending key (or None)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Distribution:
    dist: str
    params: dict = field(default_factory=dict)
    seed: int = 0

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec) -> "Distribution":
        """Read a spec (a number or a ``{dist: ...}`` mapping); raise SpecError if it is bad."""
        if isinstance(spec, bool):
            raise SpecError(f"a latency must be a number or a mapping, not {spec!r}")
        if isinstance(spec, (int, float)):
            if spec < 0 or not math.isfinite(spec):
                raise SpecError(f"a latency must be a finite number >= 0, not {spec!r}")
            return cls("constant", {"value": float(spec)})
        if not isinstance(spec, dict):
            raise SpecError(f"a latency must be a number or a mapping, not {type(spec).__name__}")
        name = spec.get("dist", "constant" if "value" in spec else None)
        if not isinstance(name, str) or name not in DISTS:
            raise SpecError(f"unknown distribution {name!r}: choose one of {', '.join(DISTS)}",
                            "dist")
        allowed = set(DISTS[name]) | set(OPTIONAL[name]) | {"dist", "seed"}
        for k in spec:
            if k not in allowed:
                raise SpecError(f"'{k}' is not a parameter of a {name} distribution "
                                f"(it takes {', '.join(DISTS[name] + OPTIONAL[name])}, seed)", k)
        params = {}
        for k in DISTS[name] + OPTIONAL[name]:
            if k not in spec:
                if k in DISTS[name]:
                    raise SpecError(f"a {name} distribution needs '{k}'", None)
                continue
            v = spec[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise SpecError(f"'{k}' must be a finite number, not {v!r}", k)
            params[k] = float(v)
        seed = spec.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise SpecError(f"'seed' must be an integer, not {seed!r}", "seed")
        d = cls(name, params, seed)
        d._check()
        return d

    def _check(self) -> None:
        p = self.params
        if self.dist == "constant" and p["value"] < 0:
            raise SpecError("'value' must be >= 0", "value")
        if self.dist == "uniform" and not 0 <= p["min"] <= p["max"]:
            raise SpecError("a uniform distribution needs 0 <= min <= max", "min")
        if self.dist == "lognormal":
            if p["median"] <= 0:
                raise SpecError("'median' must be > 0", "median")
            if p["sigma"] < 0:
                raise SpecError("'sigma' must be >= 0", "sigma")
        if self.dist == "pareto":
            if p["scale"] <= 0:
                raise SpecError("'scale' must be > 0", "scale")
            if p["alpha"] <= 0:
                raise SpecError("'alpha' must be > 0", "alpha")
            if p["alpha"] <= 1 and "max" not in p:
                raise SpecError("a pareto distribution with alpha <= 1 has an infinite mean: "
                                "give it a 'max'", "alpha")
        cap = p.get("max")
        if cap is not None and self.dist in ("lognormal", "pareto") and cap <= 0:
            raise SpecError("'max' must be > 0", "max")

    # -- draws ----------------------------------------------------------------------------
    def rng(self, stream: int = 0) -> random.Random:
        """A generator seeded with this spec's ``seed`` (and ``stream``, e.g. a replica index)."""
        return random.Random(self.seed * 1_000_003 + stream)

    def sample(self, rng: random.Random) -> float:
        p = self.params
        if self.dist == "constant":
            return p["value"]
        if self.dist == "uniform":
            return rng.uniform(p["min"], p["max"])
        if self.dist == "lognormal":
            x = p["median"] * math.exp(p["sigma"] * rng.gauss(0.0, 1.0))
        else:  # pareto
            x = p["scale"] * (1.0 - rng.random()) ** (-1.0 / p["alpha"])
        cap = p.get("max")
        return min(x, cap) if cap is not None else x

    # -- moments and quantiles ------------------------------------------------------------
    @property
    def cap(self) -> float:
        return self.params.get("max", math.inf) if self.dist != "uniform" else self.params["max"]

    def cdf(self, x: float) -> float:
        p = self.params
        if x >= self.cap:
            return 1.0
        if self.dist == "constant":
            return 1.0 if x >= p["value"] else 0.0
        if self.dist == "uniform":
            lo, hi = p["min"], p["max"]
            return 0.0 if x < lo else 1.0 if hi == lo else (x - lo) / (hi - lo)
        if self.dist == "lognormal":
            if x <= 0:
                return 0.0
            if p["sigma"] == 0:
                return 1.0 if x >= p["median"] else 0.0
            return _STD.cdf(math.log(x / p["median"]) / p["sigma"])
        return 0.0 if x < p["scale"] else 1.0 - (p["scale"] / x) ** p["alpha"]

    def quantile(self, q: float) -> float:
        p = self.params
        q = min(max(q, 0.0), 1.0)
        if self.dist == "constant":
            return p["value"]
        if self.dist == "uniform":
            return p["min"] + q * (p["max"] - p["min"])
        if self.dist == "lognormal":
            if q >= 1.0:
                return self.cap
            z = _STD.inv_cdf(q) if 0.0 < q else -math.inf
            x = p["median"] * math.exp(p["sigma"] * z) if z != -math.inf else 0.0
        else:
            x = p["scale"] * (1.0 - q) ** (-1.0 / p["alpha"]) if q < 1.0 else math.inf
        return min(x, self.cap)

    def mean(self) -> float:
        p = self.params
        if self.dist == "constant":
            return p["value"]
        if self.dist == "uniform":
            return (p["min"] + p["max"]) / 2
        m = self.cap
        if self.dist == "lognormal":
            mu, s = math.log(p["median"]), p["sigma"]
            if s == 0:
                return min(p["median"], m)
            full = math.exp(mu + s * s / 2)
            if m == math.inf:
                return full
            # E[min(X, m)] = E[X; X < m] + m P(X >= m)
            lm = math.log(m)
            return full * _STD.cdf((lm - mu - s * s) / s) + m * (1 - _STD.cdf((lm - mu) / s))
        xm, a = p["scale"], p["alpha"]
        if m <= xm:
            return m
        if m == math.inf:
            return xm * a / (a - 1)
        # E[min(X, m)] = integral_0^m P(X > x) dx = xm + integral_xm^m (xm/x)^a dx
        if a == 1:
            return xm + xm * math.log(m / xm)
        return xm + xm ** a * (m ** (1 - a) - xm ** (1 - a)) / (1 - a)

    def expected_max(self, k: int) -> float:
        """E[max of k independent draws] (k >= 1); deterministic."""
        if k <= 0:
            return 0.0
        if k == 1:
            return self.mean()
        p = self.params
        if self.dist == "constant":
            return p["value"]
        if self.dist == "uniform":
            return p["min"] + (p["max"] - p["min"]) * k / (k + 1)
        if self.dist == "lognormal" and p["sigma"] == 0:
            return min(p["median"], self.cap)
        key = (self.dist, tuple(sorted(p.items())), k)
        hit = _EMAX_CACHE.get(key)
        if hit is None:
            inv_k = 1.0 / k
            hit = sum(self.quantile(((i + 0.5) / _N) ** inv_k) for i in range(_N)) / _N
            if len(_EMAX_CACHE) > 4096:
                _EMAX_CACHE.clear()
            _EMAX_CACHE[key] = hit
        return hit


def expected_makespan(dist: Distribution, n: int, slots: int) -> float:
    """Expected time for one worker with ``slots`` parallel slots to finish ``n`` independent
    samples when every wave must finish before the next starts (the synchronous bound used by the
    cost pass): ``sum over waves of E[max of the wave's draws]``."""
    if n <= 0:
        return 0.0
    slots = max(1, slots)
    full, rest = divmod(n, slots)
    t = full * dist.expected_max(slots) if full else 0.0
    return t + (dist.expected_max(rest) if rest else 0.0)


__all__ = ["Distribution", "SpecError", "DISTS", "expected_makespan"]
