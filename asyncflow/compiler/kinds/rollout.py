"""The rules of ``rollout`` tasks: sample responses to prompts with the policy."""
from __future__ import annotations

from asyncflow.compiler.kinds.base import KindRules, SyncFacts, at, is_num

ON_UPDATE_WORDS = {"finish": "in-flight samples finish on the old weights",
                   "abort": "in-flight samples restart with new weights",
                   "continue": "in-flight samples go on with new weights"}


class RolloutRules(KindRules):
    name = "rollout"
    samples = True

    def fn_key(self, t) -> str | None:
        return "env" if t.env else None  # a multi-turn rollout's env factory takes its args

    def unsplittable(self, t) -> str | None:
        if is_num(t.redundancy) and t.redundancy > 1:
            return f"rollout '{t.name}' has redundancy {t.redundancy:g}"
        return None

    def check_scheduling(self, t, facts: SyncFacts, diags) -> None:
        if t.on_update is not None and t.name not in facts.synced:
            diags.add("AF380", at(t, "on_update"), value=t.on_update, task=t.name,
                      why="no sync edge brings it new weights")
        elif t.on_update in ("abort", "continue") and t.schedule == "batch":
            diags.add("AF380", at(t, "on_update"),
                      "drop on_update, or use schedule: queue", value=t.on_update, task=t.name,
                      why="with schedule: batch it takes up new weights between engine calls, "
                          "when no sample is in flight")
        trainer = facts.first_ready.get(t.name)
        # a spare group a step (redundancy written > 1, or the default one group ahead of a
        # queue rollout on a trained model) keeps the buffer going even with finish: 218.4 vs
        # 40.0 samples/s without (README, "Scheduling")
        spare = (is_num(t.redundancy) and t.redundancy > 1) or t.name in facts.ahead
        if trainer is not None and not spare and (
                t.on_update == "finish" or (t.on_update is None and t.schedule == "batch")):
            # benchmarks/scheduling.py's workload in the simulator at alpha 1 (docs: README,
            # "Scheduling"): first_ready 40.0 vs in_order 40.4 samples/s with finish and no
            # spare group -- finish drains every slot before adopting, so the trainer waits for
            # the slowest sample whichever rows it takes
            how = ", ".join(["drop on_update (a queue rollout then continues)"] * bool(t.on_update)
                            + ["drop redundancy (a queue rollout then launches one group "
                               "ahead)"] * is_num(t.redundancy)
                            + ["use schedule: queue"] * (t.schedule == "batch"))
            diags.add("AF329", at(t, "on_update"), how, task=t.name, trainer=trainer,
                      written="" if t.on_update else " (the default)",
                      spare="schedule: batch" if t.schedule == "batch" else
                      f"redundancy {t.redundancy:g}" if is_num(t.redundancy) else
                      f"its model '{t.model}' is not trained")
        if is_num(t.redundancy) and t.redundancy > 1 and t.model not in facts.trained:
            why = (f"its model '{t.model}' is not trained, and a step launches extra groups "
                   "only for the rollouts on a trained model" if facts.trained
                   else "no train task updates a model, so a step launches no extra groups")
            diags.add("AF381", at(t, "redundancy"), value=f"{t.redundancy:g}", task=t.name,
                      why=why)

    def slot_candidates(self, slot, inputs, role, bound):
        if slot.role == "prompt":  # the prompt is the first input
            return inputs[:1] if inputs and role[inputs[0]] in slot.accepts else []
        if slot.role == "context":  # the rest go to the environment
            return [f for f in inputs[1:] if f not in bound]
        return None

    def outputs_hint(self, d) -> str | None:
        if d.env:
            return None
        return " (a multi-turn rollout, with `env:`, also writes the episode's reward)"

    def scheduling_text(self, task, plan) -> tuple[str, str]:
        if not task.schedule:
            return "", ""
        st = plan.step
        short = f"{task.schedule}, redundancy {task.redundancy:.3g}, on_update {task.on_update}"
        words = ["each sample is its own request, sent as a slot frees" if task.schedule == "queue"
                 else "whole batches per engine call"]
        if task.redundancy > 1:
            first_ready = any(t.consume == "first_ready" for t in plan.tasks)
            words.append(f"{st.launch_groups} groups launched for {st.prompts_per_step} trained, "
                         + ("the rest trained by later steps (first_ready)" if first_ready
                            else "the last to finish cancelled"))
        words.append(ON_UPDATE_WORDS.get(task.on_update, task.on_update))
        return short, "; ".join(words)
