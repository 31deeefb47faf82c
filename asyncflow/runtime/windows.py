"""Which rows a train step takes: the step windows of the scheduling keys (docs/language.md,
"Scheduling keys"). Pure bookkeeping, no I/O: a worker feeds it the removals it hears of.

Rows come in groups (``samples_per_prompt`` rows of one prompt, contiguous), fed in order. A
step *launches* ``launch_groups`` groups (``ceil(prompts_per_step * redundancy)``) and trains
``prompts_per_step`` of them.

- ``consume: in_order``: train step ``n``'s *window* is the next ``launch_groups`` groups after
  step ``n - 1``'s window, skipping every group removed for a replaceable reason (``refill``'s
  ``filter``; a replacement group is fed for each, after all others, so the window still holds
  ``launch_groups`` live groups). Without redundancy the step trains every live row of its window;
  with it, the first ``prompts_per_step`` groups of the window whose rows are ready, and the rest
  of the window is cancelled. Without redundancy and replacement the window of step ``n`` is
  exactly the rows ``[n * samples_per_step, (n + 1) * samples_per_step)``: the synchronous
  loop's batches (gate rule 5).
- ``consume: first_ready``: no window; train step ``n`` takes the lowest ready groups whose rows
  are fresh enough (``n - version <= alpha``), dropping (and replacing) the stale ones.
"""
from __future__ import annotations


class Windows:
    """The in_order windows of one train task (module docstring)."""

    def __init__(self, samples_per_prompt: int, launch_groups: int, replace=()):
        self.spp = max(1, int(samples_per_prompt))
        self.launch = max(1, int(launch_groups))
        self.replace = frozenset(replace)
        self.gone: dict[int, str] = {}  # row -> why it was removed
        self.replaced_rows = 0  # rows removed for a replaceable reason (fed again as new groups)
        self._last: tuple | None = None  # ((g0, removals), window): the last window asked for

    def note(self, rows, reason: str) -> None:
        """Rows removed from the store (the control's ``dropped`` stream)."""
        for r in rows:
            r = int(r)
            if r not in self.gone:
                self.gone[r] = reason
                if reason in self.replace:
                    self.replaced_rows += 1

    def replaced(self, group: int) -> bool:
        """Every row of ``group`` removed for a replaceable reason: a new group stands in."""
        lo = group * self.spp
        return all(self.gone.get(r) in self.replace for r in range(lo, lo + self.spp))

    def window(self, g0: int) -> tuple[int, list[int]]:
        """``(g_end, rows)``: the window starting at group ``g0`` ends before group ``g_end``;
        ``rows`` are its live rows, ascending (the same list until a removal: do not change
        it)."""
        key = (g0, len(self.gone))
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        self._last = (key, self._window(g0))
        return self._last[1]

    def _window(self, g0: int) -> tuple[int, list[int]]:
        rows: list[int] = []
        g, live = g0, 0
        while live < self.launch:
            if not (self.replace and self.replaced(g)):
                live += 1
                rows.extend(r for r in range(g * self.spp, (g + 1) * self.spp)
                            if r not in self.gone)
            g += 1
        return g, rows
