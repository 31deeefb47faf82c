"""Evaluation during training (``eval:``; the plan's :class:`asyncflow.plan.EvalPlan`).

The worker the plan names (replica 0 of the rollout task) holds an :class:`Evaluator`. It
evaluates on its own engine, between requests, the moment it holds a version the plan lists:

1. at start-up, on the initial weights (version 0), before its first READ;
2. when it adopts a version ``v`` with a listed version ``t <= v`` not yet evaluated (a
   weight sync that skips versions evaluates the first one it adopts at or after ``t``; the row
   says both: ``eval/version`` what it ran on, ``eval/target`` what the plan asked for);
3. the driver ends the run only once the last listed version (``steps``) is evaluated.

An evaluation generates every held-out prompt ``samples_per_prompt`` times (greedy: the engine's
``temperature`` attribute set to 0 for the call; otherwise the plan's temperature; the engine's
``generator`` state is restored after, so training samples draw as they would without eval),
scores each sample with the metric function called as a reward task calls it (inputs in the
declared order, :class:`asyncflow.runtime.tasks.FnRunner`), and returns one row:
``{"step": version, "eval/<name>": mean, "eval/<name>_std": std, "eval/n": samples,
"eval/version": version, "eval/target": t, "eval/seconds": time it took}`` (and the mean of every
further numeric output of the metric as ``eval/<output>``). The held-out rows never enter the
sample store: they go from the data file to the engine to the metric, in this worker.
"""
from __future__ import annotations

import contextlib
import math
import time
from types import SimpleNamespace
from typing import Any, Callable

from asyncflow.plan import Plan

# keys of the eval rows the engine sees: far above any store row (engines key per-row draws and
# length caps by ``_row``), so an eval sample never repeats a training sample's draws
ROW_BASE = 1 << 40


def load_rows(plan: Plan, name: str, paths) -> list[dict]:
    """The rows of data source ``name``, read and checked as the training source is (AF60x
    located at that source)."""
    from asyncflow.runtime import data

    return list(data.load_rows(plan, name, paths))


class Evaluator:
    """Held-out rows, the metric, and which versions are still to evaluate."""

    def __init__(self, plan: Plan, paths=()):
        ev = plan.eval
        assert ev is not None
        self.ev = ev
        rows = load_rows(plan, ev.data, list(paths))
        self.rows = rows[:ev.max_prompts] if ev.max_prompts else rows
        self.pending = sorted(ev.versions)
        from asyncflow.runtime.tasks import FnRunner

        self.task = SimpleNamespace(name=f"eval ({ev.metric_task or ev.fn})", kind="reward",
                                    fn=ev.fn, args=dict(ev.args), inputs=list(ev.inputs),
                                    outputs=list(ev.outputs), batched=ev.batched, loc=ev.loc)
        self.metric = FnRunner(self.task, list(paths))

    def due(self, version: int | None) -> int | None:
        """The listed version an evaluation at ``version`` answers (None: nothing due)."""
        if version is None:
            return None
        done = [t for t in self.pending if t <= version]
        return done[-1] if done else None

    @property
    def finished(self) -> bool:
        return not self.pending

    def run(self, engine, version: int, to_roles: Callable[[dict], dict],
            to_fields: Callable[[dict, list], dict]) -> dict:
        """Evaluate ``engine`` (holding ``version``) on the held-out rows; see the module doc."""
        target = self.due(version)
        self.pending = [t for t in self.pending if t > version]
        t0 = time.time()
        ev = self.ev
        spp = max(1, int(ev.samples_per_prompt))
        cols: dict[str, list] = {f: [r[f] for r in self.rows for _ in range(spp)]
                                 for f in (self.rows[0] if self.rows else {})}
        n = len(self.rows) * spp
        rows = [ROW_BASE + i for i in range(n)]
        cols["_row"] = rows
        cols["_group"] = [ROW_BASE + i // spp for i in range(n)]
        with sampling(engine, 0.0 if ev.greedy else float(ev.temperature)):
            out = engine.generate(to_roles(cols)) if n else {}
        fields = to_fields(out, rows) if n else {}
        scored, _ = self.metric({**cols, **fields})
        row: dict[str, Any] = {"step": int(version)}
        for i, name in enumerate(ev.outputs):
            vals = [float(v) for v in scored.get(name, []) if _number(v)]
            key = ev.name if i == 0 else name
            mean = sum(vals) / len(vals) if vals else None
            row[f"eval/{key}"] = mean
            if i == 0:
                row[f"eval/{key}_std"] = (math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
                                          if vals else None)
        row.update({"eval/n": n, "eval/version": int(version), "eval/target": target,
                    "eval/seconds": round(time.time() - t0, 6)})
        return row


@contextlib.contextmanager
def sampling(engine, temperature: float):
    """``engine`` samples at ``temperature`` (0: greedy) for the block; its random generator's
    state is put back after, so the training samples draw what they would have drawn."""
    had = hasattr(engine, "temperature")
    old = getattr(engine, "temperature", None)
    gen = getattr(engine, "generator", None)
    state = gen.get_state() if gen is not None and hasattr(gen, "get_state") else None
    if had:
        engine.temperature = temperature
    try:
        yield
    finally:
        if had:
            engine.temperature = old
        if state is not None:
            gen.set_state(state)


def _number(v: Any) -> bool:
    try:
        return not isinstance(v, (str, bytes)) and math.isfinite(float(v))
    except (TypeError, ValueError):
        return False
