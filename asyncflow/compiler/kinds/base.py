"""The protocol of a task kind's rules: :class:`KindRules`, whose hooks do nothing by default.

A kind's rules are what the compiler's passes ask about a task of that kind, instead of
comparing its kind's name: what it is (its traits: ``samples``, ``trains``, ...), the checks
of its keys (validate rules 3 and 7), how it binds (bind rules 2-3), what granularity it needs
(overlap rules 1-6), which dropped groups it replaces, and its rows of ``asyncflow compile``'s
tables. The data of a kind -- the keys it needs and takes, its signature, its worker loop --
is :data:`asyncflow.kinds.KINDS`; the rules read it. One module per kind under
:mod:`asyncflow.compiler.kinds`, registered by :mod:`asyncflow.compiler.kinds` (``rules_of``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from asyncflow.kinds import KINDS, Kind


def at(defn: Any, key: str):
    """Where ``key`` of ``defn`` is written, else where ``defn`` itself is."""
    return defn.locs.get(key, defn.loc)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class SyncFacts:
    """What validate rule 7 (scheduling keys) knows of the pipeline's sync edges."""

    trained: frozenset = frozenset()  # models some train task updates (not frozen)
    synced: frozenset = frozenset()  # tasks a sync edge from a train task brings weights
    alpha: dict = field(default_factory=dict)  # train task -> its sync edges' largest alpha
    samples_per_step: int = 0
    # rollout task -> the train task with consume: first_ready whose weights it takes at alpha >= 1
    first_ready: dict = field(default_factory=dict)
    # rollouts that launch one group ahead a step by default (compiler.passes.launches_ahead)
    ahead: frozenset = frozenset()


class KindRules:
    """The rules of one task kind (``name``: a key of :data:`asyncflow.kinds.KINDS`).

    The traits say what a task of the kind is, for the passes (and the runtime and the
    simulator) that need to know it; the hooks do nothing, or the common thing, unless a kind
    says otherwise."""

    name: ClassVar[str] = ""
    samples: ClassVar[bool] = False  # samples responses with a policy (an eval rollout)
    rewards: ClassVar[bool] = False  # scores samples (an eval metric; the reward field)
    trains: ClassVar[bool] = False  # updates its model's weights: one per model, publishes
    critic: ClassVar[bool] = False  # its model is a critic (a value head)
    device_parallel: ClassVar[bool] = False  # a replica splits a call's rows over its devices
    fn_keywords: ClassVar[tuple[str, ...]] = ()  # keywords the runtime passes its function

    @property
    def kind(self) -> Kind:
        return KINDS[self.name]

    # -- validate (rule 3: the task's keys; rule 6: args; rule 7: scheduling keys) ------------
    def display_name(self, d) -> str:
        """How messages name a task of this kind (``grpo advantage``, ``ppo train``)."""
        return d.kind

    def fn_key(self, t) -> str | None:
        """The key naming the user function its ``args`` go to (``fn``, ``env``), if any."""
        return "fn" if self.kind.fn_inputs else None

    def args_known(self, t) -> bool:
        """Whether every owner of its ``args`` is known (else an unknown arg is not reported)."""
        return True

    def check_task(self, p, t, diags, unsplittable: str | None) -> None:
        """Validate rule 3's checks of this kind. ``unsplittable``: why a data-parallel
        trainer's steps cannot be split in advance, if they cannot."""

    def unsplittable(self, t) -> str | None:
        """Why this task makes a step's rows chosen as they become ready, if it does."""
        return None

    def check_scheduling(self, t, facts: SyncFacts, diags) -> None:
        """Validate rule 7: what the scheduling keys written on ``t`` do here (AF380-AF383)."""

    # -- bind ---------------------------------------------------------------------------------
    def slot_candidates(self, slot, inputs: list[str], role: dict, bound: dict) -> list | None:
        """The inputs that may fill ``slot`` (bind rule 3), or None for the common rule."""
        return None

    def outputs_hint(self, d) -> str | None:
        """A hint for AF375 (more outputs than the kind writes)."""
        return None

    def report_missing(self, d, slot, hint: str | None, diags) -> bool:
        """Report a required slot left empty in the kind's own words; False: the common AF370."""
        return False

    # -- overlap ------------------------------------------------------------------------------
    def need(self, d, alpha: int, stream: bool, samples_per_prompt: int) -> str:
        """The granularity it needs on its inputs (overlap rules 1-6): ``sample`` (rule 6).
        ``alpha``: the largest max_staleness of its sync edges out; ``stream``: its key."""
        return "sample"

    def check_need(self, d, need: str, samples_per_prompt: int, diags) -> None:
        """Warnings about what it needs (overlap)."""

    # -- scheduling (passes.replaced) ---------------------------------------------------------
    def replaces(self, sched: dict) -> str | None:
        """The drop reason whose groups it has replaced by new prompts, given its scheduling
        keys (``StepPlan.replace``), if any."""
        return None

    # -- asyncflow compile's tables -----------------------------------------------------------
    def scheduling_text(self, task, plan) -> tuple[str, str]:
        """Its scheduling keys, short, and what they mean, in words; ("", "") for none."""
        return "", ""

    def batch_rows(self, task, step) -> list[tuple[str, str]]:
        """Its rows of the ``batch`` table."""
        return []
