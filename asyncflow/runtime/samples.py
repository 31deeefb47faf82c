"""What the model writes: ``RUN_DIR/samples.jsonl``.

At the first and the last train step and every ``--log-samples K`` steps (default
:data:`DEFAULT_EVERY`; 0 turns it off), :data:`ROWS` of the rows the step trained on, one JSON
object a line: one sample from each of 4 prompts spread over the step (round-robin over its
prompts when it has fewer, :func:`pick`)::

    {"step": 10, "row": 2560, "prompt": "<|im_start|>user\\n12+7=<|im_end|>\\n<|im_start|>assistant\\n",
     "completion": "19", "reward": 1.0, "version": 9, "rendered": true,
     "from": {"prompt": "prompts.prompt", "completion": "generate.response",
              "reward": "score.reward"}}

``prompt`` is the text the model saw: the prompt after the chat template, as the rollout
rendered it (``rendered: true``), or the prompt field's value as given where the engine did not
record one (``rendered: false``; a list of chat messages stays a list). ``completion`` is the
response text, ``reward`` the reward the trainer read, ``version`` the policy version that
generated the sample (``_version``), ``from`` the ``source.field`` / ``task.field`` each value
came from. ``advantage`` is there when the advantage is one number per sample.

Where: the primary train worker already holds every row of the step it trains (prompt,
response, reward, version); at a logged step it puts the chosen rows in the step report it sends
anyway (:meth:`Sampler.take`), so logging costs no extra call. The driver writes them here,
to TensorBoard's text tab and to every ``--log`` logger (:mod:`asyncflow.runtime.loggers`).
"""
from __future__ import annotations

import json
import os

from asyncflow.compiler.kinds import rules_of
from asyncflow.runtime.trace import json_safe

#: rows logged per logged step
ROWS = 4
#: ``--log-samples`` default: every this many train steps (and the first and the last)
DEFAULT_EVERY = 10
FILE = "samples.jsonl"


def wanted(step: int, every: int, steps: int, first: int = 0) -> bool:
    """Whether train step ``step`` (of ``steps``; the run's first is ``first``, a resumed run's
    later) logs samples."""
    if not every:
        return False
    return step in (0, first, steps - 1) or step % every == 0


def spread(n: int, k: int = ROWS) -> list[int]:
    """``k`` indices spread evenly over ``range(n)``."""
    k = min(k, n)
    return [i * n // k for i in range(k)]


def pick(rows: list[int], spp: int, k: int = ROWS) -> list[int]:
    """Indices of ``k`` of a step's ``rows`` (row ``r`` is of prompt group ``r // spp``): one
    from each of ``k`` groups spread over the step, or round-robin over all of them when the
    step has fewer groups."""
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(int(r) // max(1, spp), []).append(i)
    members = list(groups.values())
    members = [members[j] for j in spread(len(members), min(k, len(members)))]
    out: list[int] = []
    depth = 0
    while len(out) < min(k, len(rows)):
        for g in members:
            if depth < len(g) and len(out) < k:
                out.append(g[depth])
        depth += 1
    return out


def _role_field(bind, role: str) -> str | None:
    return next((f for f, r in bind if r == role), None)


class Sampler:
    """A primary train task's sample rows of a logged step (module docstring). ``extra``: the
    fields the trainer must read besides its inputs for them (a prompt it does not train on)."""

    def __init__(self, plan, task, every: int, reward: str | None, first: int = 0):
        self.every, self.steps, self.first = int(every), plan.step.steps, int(first)
        self.spp = plan.step.samples_per_prompt
        self.reward = reward
        self.response = _role_field(task.bind_in, "response")
        producers = [t for t in plan.tasks if not rules_of(t.kind).trains]
        if self.response is None:  # a trainer that does not read the response (rare)
            self.response = next((f for t in producers for f, r in t.bind_out if r == "response"),
                                 None)
        rollout = next((t for t in producers if (self.response, "response") in
                        [tuple(b) for b in t.bind_out]), None)
        self.prompt = _role_field(rollout.bind_in, "prompt") if rollout else None
        if self.prompt is None:
            self.prompt = _role_field(task.bind_in, "prompt")
        self.advantage = _role_field(task.bind_in, "advantages")
        reward_task = next((t for t in sorted(plan.tasks, key=lambda t: not rules_of(t.kind).rewards)
                            if reward and (reward, "reward") in [tuple(b) for b in t.bind_out]),
                           None)
        source = next((d.name for d in plan.data if self.prompt in d.fields), None)
        self.origin = {
            "prompt": f"{source}.{self.prompt}" if source else self.prompt,
            "completion": f"{rollout.name}.{self.response}" if rollout else self.response,
            "reward": f"{reward_task.name}.{reward}" if reward_task else reward}
        self.extra = [f for f in (self.prompt, self.response)
                      if f and f not in task.inputs and f != reward]

    @classmethod
    def of(cls, worker) -> "Sampler | None":
        """The sampler of a :class:`~asyncflow.runtime.worker.Worker`: its primary trainer's,
        when the run's ``log_samples`` option (the driver's, ``--log-samples``) is not 0; else
        None (a worker the driver did not start: ``asyncflow simulate``'s)."""
        every = int(worker.opt.get("log_samples") or 0)
        if worker.loop != "train" or worker.task.name != worker.primary or not every:
            return None
        return cls(worker.plan, worker.task, every, worker.reward,
                   int(worker.opt.get("start_step", 0)))

    def take(self, step: int, cols: dict) -> list[dict]:
        """The sample rows of train step ``step`` from its joined columns (field -> values in
        row order), or ``[]`` at a step that logs none."""
        rows = cols.get("_row") or []
        if not rows or not wanted(step, self.every, self.steps, self.first):
            return []
        out = []
        for i in pick(rows, self.spp):
            response = _at(cols, self.response, i)
            rendered = getattr(response, "prompt_text", None)
            out.append({
                "step": step, "row": int(rows[i]),
                "prompt": rendered if rendered is not None else _at(cols, self.prompt, i),
                "completion": None if response is None else str(response),
                "reward": _number(_at(cols, self.reward, i)),
                "version": _at(cols, "_version", i), "rendered": rendered is not None,
                "from": dict(self.origin)})
            adv = _number(_at(cols, self.advantage, i))
            if adv is not None:
                out[-1]["advantage"] = adv
        return out


def _at(cols: dict, field: str | None, i: int):
    vals = cols.get(field) if field else None
    return vals[i] if vals is not None and i < len(vals) else None


def _number(v):
    if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:
        v = v.item()
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


class SamplesLog:
    """``RUN_DIR/samples.jsonl``, appended and flushed per logged step (made at the first).
    ``keep_before``: a resumed run keeps the rows of the steps before the one it resumes at."""

    def __init__(self, out_dir: str | None, keep_before: int | None = None):
        self.path = os.path.join(out_dir, FILE) if out_dir else None
        self._f = None
        self._kept: list[dict] = []
        if self.path and keep_before is not None:
            self._kept = [r for r in read(self.path) if int(r.get("step", -1)) < keep_before]

    def append(self, step: int, samples) -> list[dict]:
        """Write ``samples`` (a step report's) as step ``step``'s rows; returns them, JSON-safe."""
        rows = [json_safe(dict(s, step=step)) for s in samples or ()]
        if not rows or not self.path:
            return rows
        if self._f is None:
            self._f = open(self.path, "w")
            for r in self._kept:
                self._f.write(json.dumps(r, ensure_ascii=False) + "\n")
        for r in rows:
            self._f.write(json.dumps(r, ensure_ascii=False) + "\n")
        self._f.flush()
        return rows

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read(path: str) -> list[dict]:
    """The rows of a samples.jsonl (none where there is no file)."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def last(run_dir: str) -> list[dict]:
    """The rows of the last step logged in ``run_dir``'s samples.jsonl."""
    rows = read(os.path.join(run_dir, FILE))
    if not rows:
        return []
    step = max(r.get("step", -1) for r in rows)
    return [r for r in rows if r.get("step") == step]
