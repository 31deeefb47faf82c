"""The staleness gate (DESIGN.md, "Semantics that must be exact").

Rows are numbered so that a row's step is known from its index alone: prompt ``k`` belongs to
step ``k // prompts_per_step`` and is replicated ``samples_per_prompt`` times, so the rows of
step ``s`` are ``[s * samples_per_step, (s + 1) * samples_per_step)``.

The rules (the tests cite them by number):

1. The policy has a version: 0 at start, +1 per train step. The train step that produces
   version ``n + 1`` is step ``n`` and consumes exactly the rows of step ``n``.
2. A gated producer (a rollout on the trained model) holding version ``v`` may *start* a sample
   of step ``s`` only if ``v >= s - alpha``: it leases rows below :meth:`Gate.max_row` ``(v)``.
3. Each rollout output row records ``_version``, the version it was generated with (multi-turn:
   the oldest). A row about to be written with ``s - v > alpha`` (possible only when a lease was
   re-issued to a replica holding an older version) is not written: it is counted as dropped
   and generated again with the newest weights, in place (same row), so no sample is lost.
4. The train step ``n`` accepts a row of version ``v`` only if ``n - v <= alpha``; it records
   ``n - v`` (the staleness) of every row it consumes. A row beyond the bound is dropped and
   counted (rules 2 and 3 make this unreachable; the check stays as the last line of defence).
5. ``alpha = 0`` is the synchronous schedule: step ``s`` starts only once version ``s`` is out,
   i.e. after train step ``s - 1``; the trainer always sees its whole step at once, ordered by
   row index, so the batches and their order are those of the synchronous plan.

The scheduling keys (docs/language.md, "Scheduling keys") generalise the numbering without
changing the rules: with ``redundancy`` a step *launches* ``launch_groups`` groups (its rows are
``launch_rows = launch_groups * samples_per_prompt`` long) and trains ``prompts_per_step`` of them;
with replacement (``refill``, ``consume: first_ready``) every group dropped for a replaceable
reason is replaced by a new one fed after all others, so a producer may start ``extra`` rows more
(:meth:`Gate.max_row`'s ``extra``: the replaced rows seen so far). Rule 3 then reads "a row may be
written with the version that may start it" (:meth:`Gate.fresh_enough`), and rule 4 is checked
against the step that trains the row, whichever that is.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gate:
    alpha: int  # max_staleness of the sync edge
    samples_per_step: int  # rows trained per step
    steps: int  # total train steps (rows past the last step never exist)
    launch_rows: int = 0  # rows launched per step (redundancy); 0: samples_per_step

    @property
    def per_step(self) -> int:
        return self.launch_rows or self.samples_per_step

    def step_of(self, row: int) -> int:
        """The step ``row`` was launched for (the step that trains it is never later)."""
        return int(row) // self.per_step

    def rows_of(self, step: int) -> range:
        return range(step * self.per_step, (step + 1) * self.per_step)

    def max_step(self, version: int) -> int:
        """The last step a producer holding ``version`` may start (rule 2)."""
        return min(version + self.alpha, self.steps - 1)

    def max_row(self, version: int, extra: int = 0) -> int:
        """Exclusive upper bound on the rows a producer holding ``version`` may lease (rule 2);
        ``extra``: rows fed to replace dropped ones."""
        return (self.max_step(version) + 1) * self.per_step + int(extra)

    def staleness(self, train_step: int, version: int | None) -> int:
        return 0 if version is None or version < 0 else int(train_step) - int(version)

    def accepts(self, train_step: int, version: int | None) -> bool:
        """Rule 4: may train step ``train_step`` consume a row of ``version``."""
        return self.staleness(train_step, version) <= self.alpha

    def fresh_enough(self, row: int, version: int, extra: int = 0) -> bool:
        """Rule 3: may a rollout write ``row`` generated with ``version``."""
        return int(row) < (version + self.alpha + 1) * self.per_step + int(extra)
