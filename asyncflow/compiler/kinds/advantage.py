"""The rules of ``advantage`` tasks: advantages (and returns) from rewards with an estimator."""
from __future__ import annotations

from asyncflow.compiler.kinds.base import KindRules, at
from asyncflow.diagnostics import did_you_mean
from asyncflow.kinds import ESTIMATORS, granularity


class AdvantageRules(KindRules):
    name = "advantage"

    def display_name(self, d) -> str:
        return f"{d.estimator} advantage"

    def args_known(self, t) -> bool:
        return t.estimator in ESTIMATORS  # else AF330 / AF325 already

    def check_task(self, p, t, diags, unsplittable) -> None:
        if t.estimator is not None and t.estimator not in ESTIMATORS:
            diags.add("AF330", at(t, "estimator"), did_you_mean(t.estimator, ESTIMATORS),
                      name=t.estimator, known=", ".join(ESTIMATORS))

    def report_missing(self, d, slot, hint, diags) -> bool:
        if slot.role != "values":
            return False
        diags.add("AF332", at(d, "estimator"), hint, estimator=d.estimator)  # its own code
        return True

    def need(self, d, alpha, stream, samples_per_prompt) -> str:
        return granularity(self.name, d.estimator)  # overlap rules 2, 3: its estimator's scope

    def check_need(self, d, need, samples_per_prompt, diags) -> None:
        if need == "group" and samples_per_prompt == 1:
            diags.add("AF405", at(d, "estimator"), estimator=d.estimator)
