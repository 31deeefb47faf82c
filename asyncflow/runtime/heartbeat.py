"""A real-time worker's heartbeat to the control plane (a mixin of
:class:`asyncflow.runtime.worker.Worker`): :meth:`Heartbeats.sync` sends its spans, busy time,
counters, rewards, drops and events, and takes up the stop flag, newer weights and removed rows.

On Ray each heartbeat is an actor call (about 0.6 ms of CPU on each side), so heartbeats go
together where they can (docs/architecture.md):

- a trainer's rides on its step report (:meth:`Heartbeats.report_step`, sent by its courier):
  its next step's periodic sync is not a call of its own, and the report carries its busy time
  as of the step's end (the driver's utilization of the train pool for that step);
- the workers of one actor process (:data:`PROCESS`) share syncs: one carries the busy time and
  spans of its neighbours that take no weights and report no rewards
  (:meth:`Heartbeats.carriable`), and each is told its own stop flag and removed rows.

Answers that come on another thread (the courier's, a neighbour's) wait in ``_heard`` until
the worker's own loop takes them up at its next :meth:`Heartbeats.sync`. (The liveness beat --
leases renewed, the op the loop is in -- is another thing: ``Worker._heartbeat``'s thread.)
"""
from __future__ import annotations

import time

# the workers running in this process (a Ray actor's threads): a sync of one carries the
# heartbeats of those that may be carried (Heartbeats.carriable), one actor call for several
PROCESS: list = []


class Heartbeats:
    """The control-plane heartbeat of :class:`~asyncflow.runtime.worker.Worker` (its state:
    ``control``, ``rec``, ``courier``, ``host``, ``sync_every``, ``_last_sync``, ``_heard``,
    ``_synced``)."""

    def sync(self, force: bool = False, wait_s: float = 0.0) -> bool:
        """Flush spans/busy/reports, learn the stop flag, of newer weights (the ADOPT op takes
        them up) and of removed rows. ``wait_s``: wait up to that long for a newer version if
        there is none (a gated worker's WAIT). Returns True when the run is stopping."""
        self.check()
        if self.courier is not None:
            self.courier.check()
        while self._heard:  # answers to heartbeats that went with a report or another's sync
            self._hear(self._heard.popleft())
        now = time.time()
        if not force and not wait_s and now - self._last_sync < self.sync_every:
            return self.stopped
        self._last_sync = now
        carried = self._carried(now)
        reply = self.control.sync(*self._beat(), wait_s=wait_s,
                                  **({"others": [b for _, b in carried]} if carried else {}))
        self._hear(reply)
        self._synced = True
        for w, _ in carried:
            w._heard.append(reply["others"][w.id])
        return self.stopped

    def carriable(self) -> bool:
        """Whether another worker of this process may carry this one's heartbeat (its busy
        time and spans) with its own sync: a ``batches`` loop that takes no weights and reports
        no rewards, with nothing else to report now, on Ray (one actor call a heartbeat), once
        it has synced itself (its first sync says its engine is built: the driver's start-up
        waits for it)."""
        return (self._synced and self.host.ray and self.loop == "batches" and self.adopter is None
                and not self.reports_rewards and not self.pending_drops
                and not self.pending_events and not self._crash)

    def _carried(self, now: float) -> list:
        """The heartbeats this sync carries: those of the other workers of this process that
        may be carried (:meth:`carriable`) and are due within half a sync period; each is
        marked as made now (its own next periodic sync waits a period)."""
        out = []
        for w in list(PROCESS):
            if w is not self and w.carriable() and now - w._last_sync >= 0.5 * w.sync_every:
                w._last_sync = now
                out.append((w, (w.id, w.rec.drain(), {"busy": w.rec.busy()})))
        return out

    def _beat(self) -> tuple:
        """This worker's heartbeat: :meth:`Control.sync`'s arguments (worker, spans, state,
        known), what it reports taken out of the loop's pending lists."""
        known = dict(self.adopter.known) if self.adopter else {}
        for k in ("aborted", "cancelled"):  # the engine's in-flight samples restarted / dropped
            if hasattr(self.engine, k):
                self.stats[k] = int(getattr(self.engine, k))
        if self.adopter is not None and self.adopter.receivers:  # bytes a collective brought
            self.stats["sync_bytes"] = self.adopter.bytes
        state = {"busy": self.rec.busy(),
                 "exposed_s": self.adopter.exposed_s if self.adopter else 0.0,
                 "rewards": self.pending_rewards, "drops": self.pending_drops,
                 "stats": dict(self.stats), "events": self.pending_events}
        self.pending_rewards, self.pending_drops, self.pending_events = [], [], []
        return self.id, self.rec.drain(), state, known

    def _hear(self, reply: dict) -> None:
        """A heartbeat's answer: the stop flag (once set it stays), newer weights, removed
        rows."""
        self.stopped = self.stopped or bool(reply.get("stop"))
        if reply.get("newer"):
            self.heard_newer(reply["newer"])
        for rows, reason in reply.get("dropped") or ():
            self.heard_dropped(rows, reason)

    def report_step(self, task: str, report: dict) -> None:
        """A trainer's step report carries its busy time as of the step's end (``busy``); on
        Ray also its heartbeat (through the courier, in order), so the next step's periodic
        sync is not a call of its own; the answer is taken up at the loop's next
        :meth:`sync`."""
        # its busy time as of the step's end: the driver's utilization of its pool for this
        # step, whatever other reports the collect that brings it holds
        report = {**report, "busy": {self.id: self.rec.busy()}}
        if self.courier is None:
            super().report_step(task, report)
            return
        beat = self._beat()
        self._last_sync = time.time()
        self.courier.send(self._report_and_hear, task, report, beat)

    def _report_and_hear(self, task: str, report: dict, beat: tuple) -> None:
        """(the courier's thread) The report with the heartbeat; its answer kept for the loop."""
        self._heard.append(self.control.report_step(task, report, beat))
