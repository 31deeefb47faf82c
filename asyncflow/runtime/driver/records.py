"""The run's records in ``RUN_DIR`` and its checkpoints, as the driver writes them:
``plan.json``, ``metrics.jsonl`` (and the ``--log`` loggers), ``train_rows.jsonl``,
``samples.jsonl``, and the closing of each checkpoint the trainers saved
(:mod:`asyncflow.runtime.checkpoint`; ``resume`` continues from the newest complete one).
"""
from __future__ import annotations

import os

from asyncflow.plan import Plan
from asyncflow.runtime import checkpoint as ckpt
from asyncflow.runtime.samples import SamplesLog
from asyncflow.runtime.trace import MetricsLog


def resume_point(out_dir: str | None, plan: Plan, resume: bool) -> dict | None:
    """The newest complete checkpoint of ``out_dir`` to go on from (None: start at step 0)."""
    return ckpt.prepare_resume(out_dir, plan.step.samples_per_step) if resume else None


def write_plan(out_dir: str | None, plan: Plan) -> None:
    """``RUN_DIR/plan.json`` (the directory made if need be)."""
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "plan.json"), "w") as f:
        f.write(plan.to_json())


class RunRecords:
    """One run's ``metrics.jsonl``, ``train_rows.jsonl`` and ``samples.jsonl`` (continued from
    ``resumed``'s copies), and its checkpoints' closing."""

    def __init__(self, out_dir: str | None, resumed: dict | None, *, loggers=None,
                 log_samples: bool = True, keep_checkpoints: int | None = None):
        self.out_dir, self.keep_checkpoints = out_dir, keep_checkpoints
        self.metrics = MetricsLog(os.path.join(out_dir, "metrics.jsonl") if out_dir else None,
                                  loggers=loggers)
        for row in (resumed["metrics"] if resumed else []):
            self.metrics.append(row)
        self.train_rows = ckpt.TrainRowsLog(out_dir, resumed["train_rows"] if resumed else None)
        # RUN_DIR/samples.jsonl: the rows the primary trainer's reports carry (runtime/samples.py)
        self.samples = SamplesLog(out_dir if log_samples else None,
                                  resumed["version"] if resumed else None)

    def step(self, s: int, row: dict, reps: dict, primary: str | None,
             trainers: list[str]) -> None:
        """Train step ``s``'s metrics line, its logged samples and every trainer's rows."""
        self.metrics.append(row)
        self.metrics.text(s, self.samples.append(s, (reps.get(primary) or {}).get("samples")))
        for task in trainers:
            self.train_rows.append(s, task, reps[task]["rows"])

    def checkpoint(self, s: int, reps: dict, primary: str | None, plan: Plan, groups_fed: int,
                   store) -> None:
        """Close the checkpoint the trainers saved after step ``s``, if they did (then prune to
        ``keep_checkpoints``)."""
        if not any(r.get("checkpoint") for r in reps.values()):
            return
        st = plan.step
        launch = st.launch_groups or st.prompts_per_step
        ckpt.close(self.out_dir, s + 1, steps=st.steps, fed=-(-groups_fed // launch),
                   prompts_per_step=st.prompts_per_step, samples_per_step=st.samples_per_step,
                   metrics=self.metrics.rows, train_rows=self.train_rows.rows, store=store,
                   first_row=(reps.get(primary) or {}).get("next_row"))
        if self.keep_checkpoints:
            ckpt.prune(self.out_dir, self.keep_checkpoints)

    def close(self) -> None:
        self.metrics.close()
        self.train_rows.close()
        self.samples.close()
