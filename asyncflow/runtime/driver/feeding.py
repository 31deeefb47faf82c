"""The driver as the data sources' producer (step 4 of :mod:`asyncflow.runtime.driver`).

Prompt ``k`` is replicated ``samples_per_prompt`` times (one ``_group``) and belongs to step
``k // prompts_per_step``, so step ``s`` owns rows ``[s * samples_per_step, (s + 1) *
samples_per_step)``. Each source channel is kept as full as the plan's ``capacity`` says (rows of
steps below ``trained + capacity / samples_per_step``; staleness rule 5), plus one new group per
group dropped for a reason the plan replaces. ``asyncflow simulate`` feeds by the same rule
(:func:`feed_target`).
"""
from __future__ import annotations

from asyncflow.plan import Plan
from asyncflow.runtime.faults import RunError, fault

#: AF635: a refilling filter may replace at most this many steps' launched groups in a row (a
#: random policy on pipelines/dapo.yaml needed more than 10 before its first step)
REFILL_ROUNDS = 100


def feed_ahead(plan: Plan) -> int:
    """Steps fed beyond the last trained one: the most a data source's channel holds (its
    ``capacity``, staleness rule 5), in whole steps."""
    sources = {d.name for d in plan.data}
    sps = plan.step.samples_per_step
    caps = [c.capacity for c in plan.channels if c.src in sources]
    return max(1, -(-max(caps, default=sps) // sps))


def replaced_groups(st, drops: dict) -> int:
    """Groups dropped for a reason the plan replaces (``StepPlan.replace``: refill,
    first_ready's staleness), each replaced by a new prompt."""
    return sum(drops.get(r, 0) for r in st.replace) // st.samples_per_prompt


def feed_target(st, version: int, ahead: int, drops: dict, offset: int = 0) -> int:
    """The groups fed once every trainer has trained ``version`` steps: the launches of the
    steps the channels may hold, plus one new group per replaced group (``asyncflow simulate``
    feeds by this same rule)."""
    launch = st.launch_groups or st.prompts_per_step
    return min(st.steps, version + ahead) * launch + replaced_groups(st, drops) + offset


class Feeder:
    """Feeds one run's prompts into its store. ``first_row`` and ``start``: where a resumed run
    goes on (its rows before ``first_row`` were trained before its checkpoint)."""

    def __init__(self, plan: Plan, prompts: list[dict], first_row: int = 0, start: int = 0):
        st = plan.step
        self.plan, self.prompts = plan, prompts
        self.launch = st.launch_groups or st.prompts_per_step  # groups launched per step
        self.fed = first_row // st.samples_per_prompt  # groups fed so far
        # groups replaced before the checkpoint (a resumed run's windows start after them)
        self.offset = max(0, self.fed - start * self.launch)
        self.ahead = feed_ahead(plan)
        self.refilled = 0  # groups fed to replace dropped ones (metrics' "refilled")
        self.filtered_at_step = 0  # rows filtered out when the last step's metrics came in

    def first(self, store, start: int) -> None:
        """The steps the channels may hold from step ``start`` on."""
        self.feed(store, min(self.plan.step.steps, start + self.ahead) * self.launch + self.offset)

    def top_up(self, store, version: int, drops: dict) -> None:
        """Once every trainer has trained ``version`` steps: groups launched up to the steps the
        channels may hold, plus one new group for every group dropped for a replaced reason
        (refill, first_ready); AF635 when a refilling filter drops everything."""
        st = self.plan.step
        self.refilled = replaced_groups(st, drops)
        self.check_refill(drops.get("filter", 0) - self.filtered_at_step)
        self.feed(store, feed_target(st, version, self.ahead, drops, self.offset))

    def step_done(self, drops: dict) -> None:
        """A step's metrics are in: the filter's drops count anew from here (AF635)."""
        self.filtered_at_step = drops.get("filter", 0)

    def feed(self, store, upto: int) -> None:
        """Add groups ``fed .. upto - 1`` (group ``k`` is prompt ``k``, replicated
        ``samples_per_prompt`` times)."""
        fed, prompts = self.fed, self.prompts
        if upto <= fed:
            return
        spp = self.plan.step.samples_per_prompt
        fields = list(prompts[0])
        cols: dict[str, list] = {f: [] for f in fields}
        groups: list[int] = []
        for k in range(fed, upto):
            p = prompts[k % len(prompts)]
            for f in fields:
                cols[f].extend([p[f]] * spp)
            groups.extend([k] * spp)
        rows = store.add_rows(cols, groups)
        want = list(range(fed * spp, upto * spp))
        if list(rows) != want:
            raise RunError(f"store numbered rows {rows[:3]}..., expected {want[:3]}... "
                           "(a step must own a contiguous row range)")
        self.fed = upto

    def check_refill(self, filtered_rows: int) -> None:
        """AF635: a refilling filter dropped every group of ``REFILL_ROUNDS`` steps' worth of
        launches since the last train step: new prompts would be fed for ever."""
        st = self.plan.step
        if "filter" not in st.replace:
            return
        groups = filtered_rows // st.samples_per_prompt
        if groups > REFILL_ROUNDS * self.launch:
            tasks = [t for t in self.plan.tasks if t.refill]  # only a filter refills
            raise fault("AF635", groups=groups, rounds=REFILL_ROUNDS, tasks=", ".join(
                f"{t.name!r} ({t.loc})" if t.loc else repr(t.name) for t in tasks))

    def all_fed(self) -> bool:
        """Every step's groups are fed (a run without a trainer ends once they are consumed)."""
        return self.fed >= self.plan.step.steps * self.launch

    def all_consumed(self, store) -> bool:
        """Every task has consumed every row fed that was not dropped."""
        s = store.stats()
        total = self.fed * self.plan.step.samples_per_prompt - sum(s.get("drops", {}).values())
        return all(t["consumed"] >= total for t in s["tasks"].values())
