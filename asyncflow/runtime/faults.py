"""Run-time faults: :class:`RunError`, the AF63x faults as RunErrors (:func:`fault`), what a
worker's failure becomes (:func:`worker_error`), and ``--inject``: its parsing
(:func:`parse_inject`) and which worker applies which fault.

No Ray, no driver here: :mod:`asyncflow.runtime.data`, the driver and the CLI all import it.
"""
from __future__ import annotations

import re

from asyncflow.compiler.kinds import rules_of
from asyncflow.diagnostics import error, table
from asyncflow.errors import AsyncflowError
from asyncflow.loc import SourceLoc, Sources
from asyncflow.plan import Plan


class RunError(AsyncflowError):
    """A worker failed (its traceback is in ``details``) or the run could not start."""

    def __init__(self, message: str, details: str = "", code: str | None = None):
        super().__init__(message)
        self.details = details
        self.code = code


def fault(code: str, details: str = "", **fields) -> RunError:
    """A run-time fault (AF63x, :mod:`asyncflow.diagnostics.runtime`) as a :class:`RunError`
    whose message starts with its code."""
    return RunError(f"{code}: {table()[code].message.format(**fields)}", details, code)


#: the faults ``--inject`` knows: the driver does ``kill``; the worker the rest
INJECT_KINDS = ("kill", "hang", "nan", "oom", "raise", "exit")


def parse_inject(spec: str, plan: Plan, backend: str = "ray") -> dict:
    """``KIND@WHEN:TARGET`` -> ``{"kind", "at_step" | "at_s", "target", "spec"}``; a bad spec is
    AF634 naming the part. WHEN: ``stepN`` (when train step N starts; for a task's own faults:
    from the rows of step N on) or ``Ns`` (N seconds into the run). TARGET: a task (every
    replica; ``kill``: replica 0) or ``task/R``; ``kill`` also takes ``control`` and
    ``store[/N]`` (a shard; Ray only)."""
    def bad(part: str, why: str):
        return error("AF634", None, spec=spec, part=part, why=why)

    kind, at, rest = spec.partition("@")
    if not at:
        raise bad(repr(spec), "is not KIND@WHEN:TARGET (e.g. kill@step5:generate/0)")
    if kind not in INJECT_KINDS:
        raise bad(f"kind {kind!r}", f"is not one of {', '.join(INJECT_KINDS)}")
    when, colon, target = rest.partition(":")
    if not colon or not target:
        raise bad(repr(rest), "needs WHEN:TARGET (e.g. step5:generate/0 or 20s:score)")
    out: dict = {"kind": kind, "spec": spec, "at_step": None, "at_s": None}
    m_step, m_s = re.fullmatch(r"step(\d+)", when), re.fullmatch(r"(\d+(?:\.\d+)?)s", when)
    if m_step:
        out["at_step"] = int(m_step.group(1))
        if out["at_step"] >= plan.step.steps:
            raise bad(f"when {when!r}", f"is past the run's last step ({plan.step.steps - 1})")
    elif m_s:
        out["at_s"] = float(m_s.group(1))
    else:
        raise bad(f"when {when!r}", "is not stepN (a train step) or Ns (seconds into the run)")
    name, slash, rep = target.partition("/")
    if name in ("control", "store"):
        if kind != "kill":
            raise bad(f"target {target!r}", f"is an actor: only kill applies to it, not {kind}")
        if backend != "ray":
            raise bad(f"target {target!r}", "is a Ray actor: it exists on --backend ray only")
        if name == "control" and slash:
            raise bad(f"target {target!r}", "has no replicas")
        if name == "store" and slash and not rep.isdigit():
            raise bad(f"target {target!r}", "names a shard by its number (store/0)")
        out["target"] = target
        return out
    task = next((t for t in plan.tasks if t.name == name), None)
    if task is None:
        names = ", ".join([t.name for t in plan.tasks] + ["control", "store"])
        raise bad(f"target {target!r}", f"is not a task of the plan ({names})")
    if slash and (not rep.isdigit() or int(rep) >= task.replicas):
        raise bad(f"target {target!r}", f"task {name!r} has replicas 0..{task.replicas - 1}")
    if kind == "nan" and rules_of(task.kind).trains:
        raise bad(f"target {target!r}", "is a train task: nan applies to a task's output columns")
    out["target"] = target if (slash or kind != "kill") else f"{name}/0"
    return out


def by_worker(fault: dict) -> bool:
    """Whether the targeted worker applies ``fault`` itself, at the step it names: every kind
    but a ``kill`` timed in seconds or aimed at an actor. A worker kills itself when it starts
    on step N's rows, so the kill always strikes while the worker still has work (a driver's
    kill, sent when it has seen step N end, could arrive after a fast worker had finished)."""
    if fault["kind"] != "kill":
        return True
    return fault.get("at_step") is not None and not is_actor(fault["target"])


def is_actor(target: str) -> bool:
    """``control`` or ``store[/N]``: a Ray actor of the run, not a worker."""
    return target.partition("/")[0] in ("control", "store")


def hits(fault: dict, wid: str) -> bool:
    """Whether worker ``wid`` is ``fault``'s target (a task names every replica)."""
    t = fault["target"]
    return wid == t or ("/" not in t and wid.partition("/")[0] == t)


def worker_error(wid: str, msg, tb: str) -> AsyncflowError:
    """What the driver raises when a worker fails: a located AF6xx error when the worker found a
    user error (``msg`` is :meth:`~asyncflow.runtime.contract.TaskError.payload`), else
    :class:`RunError` with the worker's traceback."""
    if not isinstance(msg, dict):
        if str(msg).startswith(("StoreLost", "ControlLost")):  # an actor of the run is gone
            what = "sample store" if str(msg).startswith("StoreLost") else "control actor"
            return fault("AF632", tb, what=what, cause=f"{msg} (seen by worker {wid})")
        return RunError(f"worker {wid} failed: {msg}", tb)
    loc, sources = SourceLoc.parse(msg.get("loc")), Sources()
    if loc is not None:
        sources.add_file(loc.file)
    fields = {k: v for k, v in msg["fields"].items() if k != "tb"}
    e = error(msg["code"], loc, f"in worker {wid}", sources=sources, **fields)
    e.details = msg["fields"].get("tb") or tb
    return e


def lost(what: str, e: Exception) -> RunError:
    """AF632: an actor of the run (``what``: the sample store, the control actor) is gone."""
    return fault("AF632", what=what, cause=f"{e.__class__.__name__}: {e}")


def worker_options(options: dict, inject: list[dict], worker_ids: list[str],
                   resume: bool) -> dict:
    """The workers' options; a worker targeted by ``--inject`` gets its faults (``per_worker``;
    a restarted run does not inject again)."""
    base = {k: v for k, v in options.items() if k != "per_worker"}
    faults = [f for f in inject if by_worker(f)]
    if not faults or resume:
        return base
    per = {}
    for wid in worker_ids:
        mine = [f for f in faults if hits(f, wid)]
        if mine:
            per[wid] = {**base, "inject": mine}
    return {**base, "per_worker": per}
