"""The rules of ``filter`` tasks: keep or drop whole groups with a user function."""
from __future__ import annotations

from asyncflow.compiler.kinds.base import KindRules
from asyncflow.kinds import SCHED


class FilterRules(KindRules):
    name = "filter"
    fn_keywords = ("groups",)  # the runtime passes a filter function its groups

    def unsplittable(self, t) -> str | None:
        if t.refill if t.refill is not None else SCHED["refill"].default:
            return f"filter '{t.name}' refills the groups it drops"
        return None

    def need(self, d, alpha, stream, samples_per_prompt) -> str:
        return "group" if samples_per_prompt > 1 else "sample"  # overlap rule 4

    def replaces(self, sched: dict) -> str | None:
        return "filter" if sched["refill"] else None

    def scheduling_text(self, task, plan) -> tuple[str, str]:
        if task.refill:
            return "refill", "dropped groups are replaced by new prompts"
        return "no refill", "a step trains only the groups that pass"
