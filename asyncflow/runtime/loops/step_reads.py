"""Reads inside one train step (a mixin of :class:`asyncflow.runtime.loops.state.Loop`):
a ``micro_batch``/``step`` READ leases step n's rows ``op.rows`` at a time -- in_order windows,
first_ready, redundancy and refills (:class:`asyncflow.runtime.windows.Windows`), the
staleness check of gate rule 4 -- and a lease is split into micro-batches (:func:`micro_slices`).
The loops' flows (:mod:`asyncflow.runtime.loops.flow`) run these for the runtime and the
simulator alike."""
from __future__ import annotations

import time

from asyncflow.plan import Op
from asyncflow.runtime.signals import Stop


def micro_slices(n: int, size: int) -> list[tuple[int, int]]:
    """A lease of ``n`` rows as micro-batches of at most ``size`` rows (0: one): (start, rows)
    of each."""
    step = size if 0 < size < n else n
    return [(i, min(step, n - i)) for i in range(0, n, step)] if n else []


class StepReads:
    """:meth:`step_reads` and the helpers of a step's reads; the state is the
    :class:`~asyncflow.runtime.loops.state.Loop`'s."""

    def claim_step(self, it: dict) -> None:
        """The step a step READ of a batches loop reads next (replica r of R takes r, r + R,
        ...) into ``it["step"]``; :class:`~asyncflow.runtime.signals.Stop` past the last."""
        if self.cursor >= self.st.steps:
            raise Stop()
        it["step"] = self.cursor
        self.cursor += self.task.replicas

    def join_leases(self, it: dict) -> bool:
        leases = it.get("leases") or []
        if not leases:
            it.update(rows=[], cols={})
            return self.loop == "train"  # a trainer still trains (nothing) and publishes
        cols: dict = {f: [x for l in leases for x in l.columns[f]] for f in leases[0].columns}
        order = sorted(range(len(cols["_row"])), key=cols["_row"].__getitem__)
        it.update(lease=leases[0] if len(leases) == 1 else None, cols={
            f: [v[i] for i in order] for f, v in cols.items()}, version=self.current_version())
        it["rows"] = list(it["cols"]["_row"])
        return True

    def lease_step(self, want: int, *, step: int, min_rows: int, split: int | None = None,
                    timeout: float | None = None, **kw) -> list:
        """One store read of a step READ: its leases, ``[]`` when not ``min_rows`` rows are
        ready yet (within ``timeout`` s: the run's ``train_read_timeout_s`` unless given). With
        ``split`` < ``want``, up to ``want`` rows as leases of ``split`` rows (the READ's
        micro-batches) in one store call (:meth:`SampleStore.get_split`). A trainer drops rows
        beyond its staleness bound (gate rule 4: counted, and replaced when ``staleness`` is a
        replaced reason) and reads again."""
        leases = self.read_leases(want, min_rows=min_rows, split=split, timeout=timeout, **kw)
        return self.take_leases(leases, step, kw)

    def read_leases(self, want: int, *, min_rows: int, split: int | None = None,
                    timeout: float | None = None, **kw) -> list:
        """:meth:`lease_step`'s store call alone (no state of the loop: it may run on another
        thread, :meth:`~asyncflow.runtime.loops.state.Loop.fetch`)."""
        if timeout is None:
            timeout = float(self.opt.get("train_read_timeout_s", 0.05))
        if split and split < want and not kw.get("whole_groups"):
            kw = {k: v for k, v in kw.items() if k not in ("whole_groups", "group_size")}
            return self.store.get_split(self.task.name, want, split, min_rows=min_rows,
                                        timeout=timeout, fields=self.fields, owner=self.id, **kw)
        lease = self.store.get(self.task.name, want, min_rows=min_rows, timeout=timeout,
                               fields=self.fields, owner=self.id, **kw)
        return [] if lease is None else [lease]

    def take_leases(self, leases: list, step: int, kw: dict) -> list:
        """The leases a read of step ``step`` got, taken up by the loop (held; rows beyond a
        trainer's staleness bound dropped, the leases given back and ``[]`` returned)."""
        if not leases:
            self.sync(force=True)  # learn of removals: the window may have moved
            return []
        for lease in leases:
            self.hold(lease, kw.get("lease_s"))
        self.check()
        if self.loop == "train" and not self.follows:
            bad = [r for lease in leases for r, v in
                   zip(lease.rows, lease.columns.get("_version") or [None] * len(lease.rows))
                   if not self.accept.accepts(step, v)]
            if bad:
                self.stale_reads += 1
                now = time.time()
                self.rec.span("DROP", len(bad), now, now, step=step)
                self.remove_rows(bad, "staleness")
                for lease in leases:
                    self.release_lease(lease.id)
                return []
        self.stats["leases"] += len(leases)
        return leases

    def remove_rows(self, rows: list[int], reason: str) -> None:
        """Drop ``rows`` from the store -- whole groups: a group missing a row can be neither
        normalised nor trained (and a replaced reason replaces whole groups) -- and tell every
        worker (the control's ``dropped`` stream)."""
        spp = self.st.samples_per_prompt
        rows = sorted({g * spp + i for g in {int(r) // spp for r in rows} for i in range(spp)}
                      - set(self.windows.gone))
        if not rows:
            return
        self.store.drop(rows, reason)
        self.control.note_drops(rows, reason)
        self.windows.note(rows, reason)

    def lease_groups(self, op: Op, rows: int, left: int, step: int, **kw) -> list:
        """first_ready: one read of whole groups for step ``step``, up to ``rows`` rows and the
        ``left`` the step still needs, at least one group (:meth:`lease_step`)."""
        spp = self.st.samples_per_prompt
        return self.lease_step(max(spp, min(rows, left) // spp * spp), step=step, min_rows=spp,
                               whole_groups=True, group_size=spp, lease_s=op.lease_s or None,
                               **kw)

    def read_ahead(self, op: Op, step: int) -> None:
        """A streaming trainer has handed its device step ``step - 1``'s last micro-batch:
        lease up to ``op.ahead`` rows of step ``step`` now (the device computes meanwhile, so the
        step boundary's store calls cost no device time); :meth:`step_reads` of step ``step``
        starts with them. ``first_ready``: its lowest ready fresh-enough groups, without
        waiting; ``in_order``: :meth:`read_window_ahead`. Rows too stale for step ``step`` are
        dropped as by any read of it."""
        if not op.ahead or step >= self.st.steps or self.follows or self.sync():
            return
        if self.consume != "first_ready":
            self.read_window_ahead(op, step)
            return
        goal = self.st.prompts_per_step * self.st.samples_per_prompt
        got: list = []
        for _ in range(4):  # a read that found only rows too stale (dropped) reads again
            t, drops = time.time(), self.stale_reads
            got = self.lease_groups(op, op.ahead, goal, step, timeout=0.0)
            if got or self.stale_reads == drops:
                break
        for lease in got:
            self.rec.span("READ", len(lease.rows), t, version=step, step=step)
        if got:
            self.ahead[step] = got

    def read_window_ahead(self, op: Op, step: int) -> None:
        """in_order (one replica, no redundancy): the read of step ``step``'s window its first
        read would make -- up to ``op.ahead`` rows, whole micro-batches of ``op.rows`` -- made
        now through :meth:`~asyncflow.runtime.loops.state.Loop.fetch` (on Ray on a thread of
        its own, waiting for rows as a step read does, while the loop publishes and reports);
        :meth:`step_reads` of step ``step`` takes its leases up."""
        g0 = self.next_group if self.st.replace else step * self.launch
        g_end, live = self.windows.window(g0)
        if not live:
            return
        kw = {"max_row": g_end * self.st.samples_per_prompt, "lease_s": op.lease_s or None}
        fut = self.fetch(self.read_leases, min(len(live), op.ahead),
                         min_rows=min(op.rows, len(live)), split=op.rows,
                         timeout=None if self.fetches() else 0.0, **kw)
        self.ahead[step] = (fut, kw, time.time())

    def take_window_ahead(self, step: int) -> list:
        """The leases :meth:`read_window_ahead` read for step ``step`` (``[]``: none), taken up
        as any read's (:meth:`take_leases`); a failed read is raised here."""
        fut, kw, t = self.ahead.pop(step)
        got = fut.result()
        if not got:  # nothing was ready: the step's first read is made as always
            return []
        leases = self.take_leases(got, step, kw)
        for lease in leases:
            self.rec.span("READ", len(lease.rows), t, version=step, step=step)
        return leases

    def step_reads(self, op: Op, step: int, leases: list):
        """Lease step ``step``'s rows as they become ready, yielding each lease, or None after a
        read that found nothing (the caller's flow waits:
        :meth:`~asyncflow.runtime.loops.flow.Flows.flow_step_read`). Module :mod:`asyncflow.runtime.windows` says
        which rows: ``in_order`` takes the step's window (with redundancy: its first
        ``prompts_per_step`` ready groups, cancelling the rest); ``first_ready`` the lowest ready
        fresh-enough groups; a train task that is not the primary trains exactly the rows the
        primary chose."""
        spp, pps = self.st.samples_per_prompt, self.st.prompts_per_step
        lease_s = op.lease_s or None
        # a data-parallel trainer's replica reads only its share of the step: the plan's
        # [k, n], the step's groups g with g % n == k (lower rule 8); the others' are theirs
        k, n = op.share if op.share else (0, 1)
        mine = (lambda r: int(r) // spp % n == k) if n > 1 else None
        t = time.time()

        def got(lease):
            self.rec.span("READ", len(lease.rows), t,
                          version=step if self.loop == "train" else self.current_version(), step=step)
            leases.append(lease)
            return lease

        if self.follows:  # another train task chose this step's rows
            rows = None
            while rows is None:
                if self.sync():
                    raise Stop()
                rows = self.control.chosen(step)
                if rows is None:
                    yield None
            need = set(r for r in rows if mine is None or mine(r))
            while need:
                if self.sync():
                    raise Stop()
                got_ = self.lease_step(min(op.rows, len(need)), step=step, min_rows=1,
                                        max_row=max(need) + 1, filter_fn=_InSet(need),
                                        lease_s=lease_s)
                for lease in got_:
                    need.difference_update(lease.rows)
                    yield got(lease)
                if not got_:
                    yield None
                t = time.time()
            return
        taken: list[int] = []
        if self.loop == "train" and self.consume == "first_ready":
            goal = pps * spp
            for lease in self.ahead.pop(step, ()):  # read while the last step computed
                taken.extend(lease.rows)
                leases.append(lease)
                yield lease
            while len(taken) < goal:
                if self.sync():
                    raise Stop()
                got_ = self.lease_groups(op, op.rows, goal - len(taken), step)
                for lease in got_:
                    taken.extend(lease.rows)
                    yield got(lease)
                if not got_:
                    yield None
                t = time.time()
        else:
            redundant = self.loop == "train" and self.launch > pps
            g0 = self.next_group if (self.st.replace or redundant) else step * self.launch
            have: set[int] = set()
            if step in self.ahead:  # read while the last step computed
                for lease in self.take_window_ahead(step):
                    have.update(lease.rows)
                    leases.append(lease)
                    yield lease
            # the window's live rows are the same list until a removal: this replica's share
            # of them, their set and how many of them ``have`` holds are kept between reads
            # (not a pass over the whole window on every read)
            base = live_set = None
            inside = 0
            while True:
                g_end, rows_ = self.windows.window(g0)
                lo, hi = g0 * spp, g_end * spp
                if rows_ is not base:
                    base, live_set = rows_, None
                    live = rows_ if mine is None else [r for r in rows_ if mine(r)]
                if redundant:  # whole groups, no row of them removed, until pps are taken
                    counts: dict[int, int] = {}
                    for r in live:
                        counts[r // spp] = counts.get(r // spp, 0) + 1
                    left = [g for g, c in counts.items() if c == spp and g * spp not in have]
                    need = min(pps - len(have) // spp, len(left))
                    if need <= 0:
                        break
                    want, least, split = max(spp, min(op.rows, need * spp) // spp * spp), spp, None
                else:
                    if live_set is None:
                        live_set = set(live)
                        inside = len(have.intersection(live_set))
                    left = len(live) - inside
                    if not left:
                        break
                    # the rest of the window as micro-batches of op.rows, as many in one
                    # store call as the plan lets a read take (op.per_read)
                    want = min(left, op.rows * max(1, op.per_read))
                    least, split = min(op.rows, left), op.rows
                if self.sync():
                    raise Stop()
                got_ = self.lease_step(
                    want, step=step, min_rows=least, max_row=hi, whole_groups=redundant,
                    group_size=spp, lease_s=lease_s, split=split,
                    filter_fn=(_Share(lo, spp, k, n) if mine is not None
                               else _AtLeast(lo) if lo and self.task.replicas > 1 else None))
                for lease in got_:
                    for r in lease.rows:
                        if r not in have:
                            have.add(r)
                            if live_set is not None and r in live_set:
                                inside += 1
                    yield got(lease)
                if not got_:
                    yield None
                t = time.time()
            taken = sorted(have)
            if redundant:  # the rest of the window is not needed: cancel it
                g_end, live = self.windows.window(g0)
                cancel = [r for r in live if r not in have]
                if cancel:
                    self.remove_rows(cancel, "redundant")
            if self.st.replace or redundant:
                self.next_group = g_end
        if self.leads:
            self.control.choose(step, taken)

    def next_row(self, step: int, rows: list[int]) -> int:
        """Where a run resumed after train step ``step`` numbers its rows from: the next
        window; with first_ready, past the highest row trained (samples in flight then are
        replaced by new prompts, never trained twice)."""
        spp = self.st.samples_per_prompt
        if self.consume == "first_ready":
            self.top_row = max([self.top_row] + [int(r) for r in rows])
            return (self.top_row // spp + 1) * spp
        if self.st.replace or self.launch != self.st.prompts_per_step:
            return self.next_group * spp
        return (step + 1) * self.launch * spp


class _InSet:
    """A picklable row filter: rows in ``rows``."""

    def __init__(self, rows):
        self.rows = frozenset(int(r) for r in rows)

    def __call__(self, r: dict) -> bool:
        return r["_row"] in self.rows


class _Share:
    """A picklable row filter: rows with index >= lo of the groups g with g % n == k (a data-
    parallel trainer replica's share of a step, lower rule 8)."""

    def __init__(self, lo: int, spp: int, k: int, n: int):
        self.lo, self.spp, self.k, self.n = lo, max(1, spp), k, n

    def __call__(self, r: dict) -> bool:
        return r["_row"] >= self.lo and r["_row"] // self.spp % self.n == self.k


class _AtLeast:
    """A picklable row filter: rows with index >= lo."""

    def __init__(self, lo: int):
        self.lo = lo

    def __call__(self, r: dict) -> bool:
        return r["_row"] >= self.lo
