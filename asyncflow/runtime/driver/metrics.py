"""What the driver learns from the workers' collects, up to one ``metrics.jsonl`` line per train
step (step 5 of :mod:`asyncflow.runtime.driver`): :class:`StepBook`.

A step's line is written once every trainer has reported it; a data-parallel trainer's replicas
each report their share of a step (lower rule 8), merged into the task's report once all are in
(:func:`merged_shares`).
"""
from __future__ import annotations

from asyncflow.compiler.kinds import rules_of
from asyncflow.plan import Plan
from asyncflow.runtime.trace import mean_std


class StepBook:
    """Spans, rewards, drops and train reports of one run (one :meth:`Driver._run_once
    <asyncflow.runtime.driver.core.Driver>`). ``exports``: the driver's model -> newest export
    (it outlives a restart), updated from the reports."""

    def __init__(self, plan: Plan, trainers: list[str], start: int, primary: str | None,
                 t0: float, exports: dict):
        self.plan, self.trainers, self.primary, self.exports = plan, trainers, primary, exports
        self.spans: list = []
        self.rewards: dict[int, float] = {}
        self.drops: dict[str, int] = {}
        self.done: dict[str, int] = {t: start for t in trainers}  # task -> steps trained
        self.pending: dict[int, dict] = {}  # step -> {task: report}
        self.n_replicas = {t.name: t.replicas for t in plan.tasks if rules_of(t.kind).trains}
        self.shares: dict[tuple, dict] = {}  # (step, task) -> {replica: report}
        self.last = {"t": t0, "busy": {}, "exposed": {}, "drops": 0}

    def version(self) -> int:
        """The steps every trainer has trained (the plan's steps without a trainer)."""
        return min(self.done.values()) if self.done else self.plan.step.steps

    def finished(self) -> bool:
        """Every trainer has trained the plan's last step (False without a trainer)."""
        return bool(self.trainers) and all(self.done[t] >= self.plan.step.steps
                                           for t in self.trainers)

    def take(self, c: dict) -> None:
        """One collect's spans, rewards and drops."""
        self.spans.extend(c["spans"])
        for rows, values in c["rewards"]:
            self.rewards.update(zip(rows, values))
        for _, n, reason in c["drops"]:
            self.drops[reason] = self.drops.get(reason, 0) + n

    def take_reports(self, reports: list) -> None:
        """One collect's train reports, ``(task, report)`` each."""
        for task, rep in reports:
            if self.n_replicas.get(task, 1) > 1:  # a data-parallel trainer: one per replica
                got = self.shares.setdefault((rep["step"], task), {})
                got[int(rep.get("replica", 0))] = rep
                if len(got) < self.n_replicas[task]:
                    continue
                rep = merged_shares(self.shares.pop((rep["step"], task)))
            self.pending.setdefault(rep["step"], {})[task] = rep
            if rep.get("export"):  # the newest trained model, in RUN_DIR/final
                self.exports[rep["export"]["model"]] = rep["export"]
            self.done[task] = max(self.done.get(task, 0), rep["step"] + 1)

    def complete_steps(self):
        """``(step, {task: report})`` of each step every trainer has reported, in order (each
        once)."""
        for s in sorted(self.pending):
            reps = self.pending[s]
            if not all(t in reps for t in self.trainers):
                break
            del self.pending[s]
            yield s, reps

    def row(self, s: int, reps: dict, c: dict, store, t0: float, refilled: int) -> dict:
        """Step ``s``'s metrics line from its reports and the latest collect ``c``."""
        plan, last, drops, primary = self.plan, self.last, self.drops, self.primary
        rep = reps.get(primary) or next(iter(reps.values()))
        now = max(r["end"] for r in reps.values())
        window = max(now - last["t"], 1e-9)
        rows = rep["rows"]
        rvals = rep.get("rewards") or [self.rewards.pop(r) for r in rows if r in self.rewards]
        rvals = [float(x) for x in rvals if isinstance(x, (int, float))]
        r_mean, r_std = mean_std(rvals)
        stl = rep["staleness"]
        busy, exposed = dict(c["busy"]), c["exposed"]
        for r in reps.values():  # a trainer's busy time as of its step's end (its report's)
            busy.update(r.get("busy") or {})
        util = _utilization(plan, busy, last["busy"], window)
        dev = {p.name: p.devices for p in plan.pools}
        dev_pools = [p for p in util if p in dev and dev[p]]
        total_dev = sum(dev[p] for p in dev_pools)
        bubble = 1.0 - sum(util[p] * dev[p] for p in dev_pools) / total_dev if total_dev else None
        ex_roll = sum(max(exposed.get(w, 0.0) - last["exposed"].get(w, 0.0), 0.0) for w in exposed)
        exposed_s = sum(r.get("publish_s", 0.0) for r in reps.values()) + ex_roll
        # every task's ready rows from one stats call (one round trip to each shard on Ray,
        # not one per task): what store.pending(task) says, for all tasks at once
        ready = store.stats()["tasks"]
        queue = {t.name: int(ready[t.name]["ready"]) for t in plan.tasks}
        n_drop = sum(v for k, v in drops.items() if k not in ("filter", "redundant"))
        stats = c.get("stats") or {}
        sync_bytes = sum(int(v.get("sync_bytes", 0)) for v in stats.values())
        row = {
            "step": s, "version": rep["version"], "time": round(now - t0, 6),
            "step_time": round(window, 6), "samples": len(rows),
            "samples_per_s": round(len(rows) / window, 3),
            "reward_mean": r_mean, "reward_std": r_std,
            "staleness_mean": (sum(stl) / len(stl)) if stl else None,
            "staleness_max": max(stl) if stl else None,
            "dropped": n_drop - last["drops"],
            "filtered": drops.get("filter", 0),
            "refilled": refilled,
            "cancelled": drops.get("redundant", 0),
            "aborted": sum(int(v.get("aborted", 0)) for v in stats.values()),
            "utilization": {p: round(u, 4) for p, u in sorted(util.items())},
            "bubble_fraction": round(bubble, 4) if bubble is not None else None,
            "queue_depth": queue, "exposed_sync_s": round(exposed_s, 6),
        }
        if sync_bytes:  # bytes the collective edges delivered since the last step
            row["sync_bytes"] = sync_bytes - last.get("sync_bytes", 0)
            last["sync_bytes"] = sync_bytes
        for task, r in sorted(reps.items()):
            for k, v in r["metrics"].items():
                key = k if task == primary else f"{task}/{k}"
                if key not in row:
                    row[key] = v
        last["t"], last["busy"], last["exposed"], last["drops"] = now, dict(busy), dict(exposed), n_drop
        return row


def _utilization(plan: Plan, busy: dict, before: dict, window: float) -> dict[str, float]:
    """Each pool's busy-seconds of its workers over the window, over its capacity."""
    used: dict[str, float] = {}
    cap: dict[str, float] = {}
    dev = {p.name: p.devices for p in plan.pools}
    dpr = {t.name: t.devices_per_replica for t in plan.tasks}
    for w in plan.workers:
        pool = w.pool or "cpu"
        db = busy.get(w.id, 0.0) - before.get(w.id, 0.0)
        used[pool] = used.get(pool, 0.0) + max(db, 0.0) * (dpr.get(w.task, 1) if w.pool else 1)
        cap[pool] = dev.get(pool, 0) or (cap.get(pool, 0.0) + 1)
    return {p: min(1.0, used[p] / (window * cap[p])) for p in used if cap.get(p)}


def merged_shares(reps: dict[int, dict]) -> dict:
    """One train step's report of a data-parallel trainer from its replicas' (``{replica:
    report}``, each of its share of the step's rows): the rows, their rewards and staleness
    together in row order; the metrics, samples, checkpoint and export replica 0's (the metrics
    are the global step's on every replica; only replica 0 exports); the slowest compute; each
    replica's busy time as of its share's end."""
    first = reps[min(reps)]
    triples = sorted((r, rw, st) for rep in reps.values()
                     for r, rw, st in zip(rep["rows"], _padded(rep.get("rewards"), rep["rows"]),
                                          _padded(rep.get("staleness"), rep["rows"])))
    rewarded = all(len(rep.get("rewards") or []) == len(rep["rows"]) for rep in reps.values())
    return {**first, "rows": [t[0] for t in triples],
            "rewards": [t[1] for t in triples] if rewarded else [],
            "staleness": [t[2] for t in triples],
            "checkpoint": first.get("checkpoint") or next(
                (r["checkpoint"] for r in reps.values() if r.get("checkpoint")), None),
            "next_row": max(r.get("next_row") or 0 for r in reps.values()),
            "compute_s": max(r.get("compute_s", 0.0) for r in reps.values()),
            "busy": {w: b for r in reps.values() for w, b in (r.get("busy") or {}).items()}}


def _padded(values, rows) -> list:
    values = list(values or [])
    return values + [None] * (len(rows) - len(values))
