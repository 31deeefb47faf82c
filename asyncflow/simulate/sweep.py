"""``asyncflow simulate --sweep KEY=v1,v2,...``: one simulation per value of a ``--set`` key, and
the resource planner (``--sweep split=...``).

``split`` is not a key of the file but a device split between the rollout and the trainer:
``R:T`` gives the rollout's pool ``R`` devices (and the rollout ``R / devices_per_replica``
replicas) and the trainer's pool ``T`` devices (the trainer one replica on all of them: a train
call's rows are split over its devices, data parallel). ``split=auto`` tries splits of the
file's own budget (the two pools' devices together) and reports the best. The rollout and the
trainer need pools of their own (colocated tasks time-share one pool: there is nothing to split).
"""
from __future__ import annotations

from dataclasses import dataclass

from asyncflow.compiler.kinds import rules_of
from asyncflow.errors import AsyncflowError
from asyncflow.plan import Plan

SPLIT = "split"


@dataclass
class SweepError(AsyncflowError):
    """A bad ``--sweep`` (AF642)."""

    spec: str
    why: str

    def __str__(self) -> str:
        return f"--sweep {self.spec}: {self.why}"


def parse(spec: str) -> tuple[str, list[str]]:
    """``KEY=v1,v2,...`` -> (KEY, [v1, v2, ...])."""
    key, eq, values = spec.partition("=")
    key = key.strip()
    vals = [v.strip() for v in values.split(",")] if eq else []
    if not key or not eq:
        raise SweepError(spec, "expected KEY=v1,v2,... (a --set key, or split=R:T,... / "
                               "split=auto)")
    if not vals or any(v == "" for v in vals):
        raise SweepError(spec, "give one or more values, separated by commas")
    if len(set(vals)) != len(vals):
        raise SweepError(spec, "a value is given twice")
    return key, vals


@dataclass
class Split:
    """The two tasks a ``split`` moves devices between, and the file's own split."""

    rollout: str
    rollout_pool: str
    rollout_dpr: int
    train: str
    train_pool: str
    rollout_devices: int
    train_devices: int

    @property
    def budget(self) -> int:
        return self.rollout_devices + self.train_devices

    def sets(self, value: str, spec: str) -> list[str]:
        r, t = _pair(value, spec)
        if r % self.rollout_dpr:
            raise SweepError(spec, f"{value}: {r} rollout devices do not divide into replicas of "
                                   f"{self.rollout_dpr} devices (rollout '{self.rollout}')")
        return [f"pools.{self.rollout_pool}.devices={r}",
                f"tasks.{self.rollout}.replicas={r // self.rollout_dpr}",
                f"pools.{self.train_pool}.devices={t}",
                f"tasks.{self.train}.replicas=1",
                f"tasks.{self.train}.devices_per_replica={t}"]

    def auto(self) -> list[str]:
        """Splits of the budget: the file's own, and the trainer on 1/16 .. 3/4 of it and on
        every power of two (the rollout keeps whole replicas)."""
        b, d = self.budget, self.rollout_dpr
        ts = {self.train_devices}
        ts |= {max(1, round(b * f)) for f in (1 / 16, 1 / 8, 3 / 16, 1 / 4, 5 / 16, 3 / 8, 1 / 2,
                                              5 / 8, 3 / 4)}
        p = 1
        while p < b:
            ts.add(p)
            p *= 2
        out = []
        for t in sorted(ts):
            r = (b - t) // d * d
            if t >= 1 and r >= d:
                out.append(f"{r}:{t}")
        return list(dict.fromkeys(out))


def _pair(value: str, spec: str) -> tuple[int, int]:
    a, sep, b = value.partition(":")
    try:
        r, t = int(a), int(b)
    except ValueError:
        r = t = 0
    if not sep or r < 1 or t < 1:
        raise SweepError(spec, f"{value!r} is not a split ROLLOUT:TRAIN of device counts >= 1 "
                               "(e.g. 12:4)")
    return r, t


def split_of(plan: Plan, spec: str) -> Split:
    """The rollout and train tasks a split moves devices between (each on a pool of its own)."""
    roll = next((t for t in plan.tasks if rules_of(t.kind).samples), None)
    train = next((t for t in plan.tasks if rules_of(t.kind).trains), None)
    if roll is None or train is None:
        raise SweepError(spec, "a split needs a rollout task and a train task")
    if not roll.pool or not train.pool:
        raise SweepError(spec, f"a split needs rollout '{roll.name}' and trainer '{train.name}' "
                               "on pools")
    if roll.pool == train.pool:
        raise SweepError(spec, f"rollout '{roll.name}' and trainer '{train.name}' share pool "
                               f"'{roll.pool}' (they time-share its devices): nothing to split")
    pools = {p.name: p for p in plan.pools}
    return Split(roll.name, roll.pool, max(1, roll.devices_per_replica), train.name, train.pool,
                 pools[roll.pool].devices, pools[train.pool].devices)
