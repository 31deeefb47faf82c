"""The ``eval:`` section resolved: which rollout generates, which function scores, with which
inputs, at which policy versions (docs/language.md, "Evaluation").

One function, :func:`resolve`, answers for both the validate pass (which reports what it cannot
resolve, AF384-AF389) and the lower pass (which writes :class:`asyncflow.plan.EvalPlan`), so the
checker and the plan never disagree. The rules, cited by the validate pass and the tests:

1. the held-out source is ``eval.data`` (a data source; it feeds no task, so its fields are not
   "never read", AF309); if it is the training source itself, evaluation runs on training prompts;
2. the rollout is ``eval.rollout``, else the one rollout task on a trained model, else the one
   rollout task; its replica 0 evaluates (a worker of the rollout pool, between its requests);
3. the metric is ``eval.fn`` (``module:function``) with ``eval.inputs`` (default: the metric
   task's inputs), else the function of ``eval.metric`` (a reward task), else of the one reward
   task; it is called as that reward task calls it (inputs in the declared order, its ``args``);
4. every input of the rollout is a field of the held-out source; every input of the metric is a
   field of the source or an output of the rollout;
5. versions evaluated: 0, ``every``, 2 ``every``, ... and ``steps`` (without ``every``: 0 and
   ``steps``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from asyncflow.compiler.kinds import rules_of
from asyncflow.dsl import ast
from asyncflow.plan import eval_versions as versions  # rule 5
from asyncflow.ir.graph import held_out  # noqa: F401  (rule 1 lives with the graph it shapes)


@dataclass
class Resolved:
    rollout: str | None = None
    metric_task: str | None = None
    fn: str | None = None
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    name: str | None = None
    args: dict = field(default_factory=dict)
    batched: bool = False
    # (code, key of eval the problem is at, format fields) -- the validate pass reports them
    problems: list[tuple[str, str, dict]] = field(default_factory=list)


def _trained(p: ast.Pipeline) -> set[str]:
    return {t.model for t in p.tasks.values() if rules_of(t.kind).trains and t.model}


def resolve(p: ast.Pipeline) -> Resolved:
    """Rules 2-4 for ``p.eval`` (which must be set)."""
    e = p.eval
    assert e is not None
    r = Resolved()
    # rule 2: the rollout
    rollouts = [t for t in p.tasks.values() if rules_of(t.kind).samples]
    if e.rollout is not None:
        t = p.tasks.get(e.rollout)
        if t is None or not rules_of(t.kind).samples:
            what = "there is no such task" if t is None else f"it is a {t.kind} task"
            r.problems.append(("AF385", "rollout", {"problem": f"rollout '{e.rollout}': {what}",
                                                     "known": _names(rollouts)}))
        else:
            r.rollout = t.name
    else:
        on_trained = [t for t in rollouts if t.model in _trained(p)]
        pick = on_trained if len(on_trained) == 1 else rollouts
        if len(pick) == 1:
            r.rollout = pick[0].name
        else:
            why = "the pipeline has no rollout task" if not rollouts else \
                f"it has {len(rollouts)} rollout tasks: say which with `rollout:`"
            r.problems.append(("AF385", "", {"problem": why, "known": _names(rollouts)}))
    # rule 3: the metric
    rewards = [t for t in p.tasks.values() if rules_of(t.kind).rewards]
    task = None
    if e.metric is not None:
        t = p.tasks.get(e.metric)
        if e.fn is not None:
            r.problems.append(("AF386", "fn", {"problem": "both 'metric' and 'fn' are given: keep one"}))
        elif t is None or not rules_of(t.kind).rewards or not t.fn:
            what = "there is no such task" if t is None else \
                f"it is a {t.kind} task" if not rules_of(t.kind).rewards else "it has no fn"
            r.problems.append(("AF386", "metric", {"problem": f"metric '{e.metric}': {what} "
                                                   f"(reward tasks: {_names(rewards)})"}))
        else:
            task = t
    elif len(rewards) == 1 and rewards[0].fn:
        task = rewards[0]
    elif e.fn is None:
        why = "the pipeline has no reward task: name a function with `fn: module:function`" \
            if not rewards else f"it has {len(rewards)} reward tasks ({_names(rewards)}): " \
                                "say which with `metric:`, or give `fn:`"
        r.problems.append(("AF386", "", {"problem": why}))
    if e.fn is not None and not any(c == "AF386" and k == "fn" for c, k, _ in r.problems):
        r.fn = e.fn
        fallback = rewards[0] if len(rewards) == 1 else None
        r.inputs = tuple(e.inputs) or (tuple(fallback.inputs) if fallback else ())
        r.name = e.name or e.fn.rpartition(":")[2].split(".")[-1]
        r.outputs = (r.name,)
        r.args = dict(e.args)
        if not r.inputs:
            r.problems.append(("AF386", "fn", {"problem": f"fn '{e.fn}' needs `inputs:` (there is "
                                                        "no single reward task to take them from)"}))
    elif task is not None:
        r.metric_task, r.fn = task.name, task.fn
        r.inputs = tuple(e.inputs) or tuple(task.inputs)
        r.outputs = tuple(task.outputs) or ("reward",)
        r.name = e.name or r.outputs[0]
        r.args = dict(e.args) or dict(task.args)
        r.batched = task.batched
    # rule 4: the fields
    src = p.data.get(e.data)
    if src is not None and r.rollout is not None:
        have = set(src.fields)
        roll = p.tasks[r.rollout]
        for f in roll.inputs:
            if f not in have:
                r.problems.append(("AF387", "data", {
                    "field": f, "who": f"rollout '{roll.name}'", "source": src.name,
                    "have": ", ".join(src.fields) or "none"}))
        for i, f in enumerate(r.inputs):
            if f not in have and f not in roll.outputs:
                r.problems.append(("AF387", f"inputs.{i}" if e.inputs else "data", {
                    "field": f, "who": f"the metric ({r.fn})", "source": src.name,
                    "have": ", ".join([*src.fields, *roll.outputs])}))
    return r


def _names(tasks) -> str:
    return ", ".join(t.name for t in tasks) or "none"


def eval_plan(p: ast.Pipeline, plain):
    """The plan's :class:`asyncflow.plan.EvalPlan` (None without ``eval:``); the pipeline passed
    validation, so :func:`resolve` found everything. ``plain``: the lower pass's JSON-shaping."""
    from asyncflow.plan import EvalPlan

    e = p.eval
    if e is None:
        return None
    r = resolve(p)
    roll = p.tasks[r.rollout]
    temp = e.temperature if e.temperature is not None else roll.args.get("temperature", 1.0)
    loc = e.loc
    return EvalPlan(
        data=e.data, versions=versions(e.every, p.step.steps), rollout=roll.name,
        worker=f"{roll.name}/0", fn=r.fn, inputs=list(r.inputs), outputs=list(r.outputs),
        name=r.name, every=e.every or 0, metric_task=r.metric_task or "", args=plain(r.args),
        batched=r.batched, greedy=e.greedy, temperature=float(temp),
        samples_per_prompt=e.samples_per_prompt, max_prompts=e.max_prompts or 0,
        loc=str(loc) if loc is not None and loc.line else "")
