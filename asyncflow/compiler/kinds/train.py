"""The rules of ``train`` tasks: update a model's weights with a loss and publish versions."""
from __future__ import annotations

from asyncflow.compiler.kinds.base import KindRules, SyncFacts, at
from asyncflow.diagnostics import did_you_mean
from asyncflow.engines.base import capabilities
from asyncflow.kinds import LOSSES


class TrainRules(KindRules):
    name = "train"
    trains = True
    device_parallel = True

    def display_name(self, d) -> str:
        return f"{d.loss} train"

    def args_known(self, t) -> bool:
        return t.loss in LOSSES  # else AF331 / AF325 already

    def check_task(self, p, t, diags, unsplittable) -> None:
        if t.replicas > 1 and not capabilities(t.engine, load=False).data_parallel:
            # a train replica trains the whole step on its own copy: two would not split the
            # rows (asyncflow.runtime.worker); a data-parallel engine splits them itself
            diags.add("AF327", t.locs.get("replicas", t.loc), task=t.name, replicas=t.replicas,
                      engine=t.engine)
        elif isinstance(t.replicas, int) and t.replicas > 1 and unsplittable:
            # the replicas split each step by group (lower rule 8): the step's groups must be
            # fixed in advance, not chosen as they become ready
            diags.add("AF328", t.locs.get("replicas", t.loc), task=t.name,
                      replicas=t.replicas, why=unsplittable)
        if t.loss is not None and t.loss not in LOSSES:
            diags.add("AF331", at(t, "loss"), did_you_mean(t.loss, LOSSES), name=t.loss,
                      known=", ".join(LOSSES))

    def unsplittable(self, t) -> str | None:
        if t.consume == "first_ready":
            return f"train task '{t.name}' consumes first_ready"
        return None

    def check_scheduling(self, t, facts: SyncFacts, diags) -> None:
        if t.consume == "first_ready" and facts.alpha.get(t.name, 0) == 0:
            diags.add("AF382", at(t, "consume"), "raise the sync edge's max_staleness, or drop "
                      "consume", task=t.name)
        mb = t.args.get("micro_batch")
        sps = facts.samples_per_step
        if t.stream is True and (mb is None or (isinstance(mb, int) and not isinstance(mb, bool)
                                                and mb >= sps)):
            why = ("it has no args.micro_batch, so a step is one micro-batch" if mb is None
                   else f"micro_batch {mb} is the whole step ({sps} samples)")
            diags.add("AF383", at(t, "stream"), task=t.name, why=why)

    def need(self, d, alpha, stream, samples_per_prompt) -> str:
        # overlap rules 1, 5; a streaming trainer takes micro-batches at alpha 0 too
        return "step" if alpha == 0 and not stream else "micro_batch"

    def replaces(self, sched: dict) -> str | None:
        return "staleness" if sched["consume"] == "first_ready" else None

    def scheduling_text(self, task, plan) -> tuple[str, str]:
        if not task.consume:
            return "", ""
        short = task.consume + (", stream" if task.stream else "")
        words = ["trains exactly step n's rows" if task.consume == "in_order" else
                 f"takes the first ready rows with n - version <= {task.version_lag}, from any "
                 "step; too stale: dropped, replaced"]
        mb = task.args.get("micro_batch")
        words.append(f"forward/backward per micro-batch of {mb} as it is ready, one optimiser "
                     "step" if task.stream else "one train_step on the whole step")
        return short, "; ".join(words)

    def batch_rows(self, task, step) -> list[tuple[str, str]]:
        mb = task.args.get("micro_batch", step.samples_per_step)
        if isinstance(mb, int) and mb > 0:
            return [(f"micro-batches per step ({task.name}: {mb})",
                     str(step.samples_per_step // mb))]
        return []
