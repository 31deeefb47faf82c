"""The op handlers of a worker's loops (:mod:`asyncflow.runtime.loops`; a mixin of
:class:`~asyncflow.runtime.loops.state.Loop`): WAIT, ADOPT, READ, COMPUTE, WRITE, PUBLISH and
the end of a train step. Each takes ``(op, it)``: ``it`` holds this turn's lease, rows,
columns, version, step; a handler returns False when the rest of the body has nothing to do
this turn. The host is reached through the hooks of :class:`~asyncflow.runtime.loops.state.Loop`
(``sync``, ``hold``, ``inject``, ``publish_version``, ...)."""
from __future__ import annotations

import sys
import time
from typing import Any

from asyncflow.plan import Op
from asyncflow.runtime import checkpoint, export


class OpHandlers:
    """The op handlers; the state is the :class:`~asyncflow.runtime.loops.state.Loop`'s."""

    def op_wait(self, op: Op, it: dict) -> bool:
        """Block on the weight board when the last READ found nothing the gate lets this version
        start: the board wakes the worker the moment the trainer publishes (a serve loop never
        blocks: it keeps emitting finished samples)."""
        if self.wants_weights(it):
            self.flush_acks()
            self.sync(wait_s=self.timeout)
        return True

    def wants_weights(self, it: dict) -> bool:
        """Whether a WAIT waits for newer weights now (the last READ found nothing, the worker
        is gated, the turn is not a serve loop's pull); the idle mark is used up."""
        if self.idle and "pull" not in it and self.adopter is not None and self.adopter.known:
            self.idle = False
            return True
        return False

    def op_adopt(self, op: Op, it: dict) -> bool:
        """Take up the newer weights the last heartbeat offered (between requests)."""
        if "pull" in it and self.on_update == "finish" and self.in_flight > 0:
            return True  # on_update: finish -- in-flight samples end with the old weights first
        newer, self.newer = self.newer, {}
        if newer and self.adopter is not None and not self.stopped:
            self.flush_acks()  # taking up weights may take a while: what was written goes first
            t = time.time()
            aborted = int(getattr(self.engine, "aborted", 0))
            if self.adopter.adopt(newer):
                self.rec.span("ADOPT", 0, t, version=self.adopter.version)
                gone = int(getattr(self.engine, "aborted", 0)) - aborted
                if gone > 0:  # on_update: abort -- the samples in flight start again
                    now = time.time()
                    self.rec.span("ABORT", gone, now, now, version=self.adopter.version)
                self.evaluate()  # eval: a version the plan lists (between requests)
        return True

    def op_read(self, op: Op, it: dict) -> bool:
        """READ what is ready, once (a ``step``/``micro_batch`` READ is the flows':
        :meth:`~asyncflow.runtime.loops.flow.Flows.flow_step_read`)."""
        n = it.get("pull", op.rows)
        gated = self.gate is not None and self.adopter is not None and bool(self.adopter.known)
        t = time.time()
        # a gated worker waits on the weight board (its WAIT), not on the store: the rows it may
        # not start yet become readable only with a newer version
        lease = self.store.get(self.task.name, n, min_rows=min(op.min_rows, n),
                               whole_groups=op.granularity == "group" and op.unit > 1,
                               group_size=op.unit, max_row=self.max_row(),
                               timeout=0.0 if gated or "pull" in it else self.timeout,
                               lease_s=op.lease_s or None, owner=self.id,
                               **self.carried_acks())
        if lease is None:
            self.stats["empty_reads"] += 1
            self.idle = True
            if not gated and "pull" not in it:
                time.sleep(self.backoff)
            return False
        self.hold(lease, op.lease_s)
        self.check()
        self.stats["leases"] += 1
        version = self.current_version()
        self.rec.span("READ", len(lease.rows), t, version=version,
                      step=self.gate.step_of(lease.rows[0]) if self.gate else None)
        it.update(lease=lease, rows=list(lease.rows), cols=lease.columns, version=version)
        return True

    def op_compute(self, op: Op, it: dict) -> bool:
        rows = it.get("rows", [])
        step = it["step"] if it.get("step") is not None else self.step_of_rows(rows)
        if self.faults:
            self.inject(step, rows)
        t = self.rec.compute_begin()
        if self.loop == "train":  # a trainer's runner returns metrics, not columns
            if rows:
                it["metrics"] = self.call(self.to_roles(dict(it.get("cols") or {})))
            elif self.shares:  # an empty share still joins the replicas' collectives
                it["metrics"] = self.call(self.to_roles({f: [] for f in self.task.inputs}))
            else:
                it["metrics"] = {}
            version = it["step"]
        elif self.engine is not None:
            out = self.call(self.to_roles(it["cols"]))
            it["out"] = self.to_fields(self.nan(step, out) if self.faults else out, rows)
            version = it["version"]
        else:
            out, it["keep"] = self.call(it["cols"])
            if self.faults:
                out = self.nan(step, out)
            it["out"] = self.checked({f: out.get(f) for f in self.task.outputs}, rows)
            version = it["version"]
        it["end"] = end = self.rec.compute_end()
        it["compute_s"] = end - t
        self.progress += 1
        self.check()
        if it.get("step") is None and self.gate is not None:
            it["step"] = self.gate.step_of(rows[0])
        self.rec.span("COMPUTE", len(rows), t, end, version, it.get("step"))
        return True

    def op_write(self, op: Op, it: dict) -> bool:
        """Ack the lease with the output columns (gate rule 3 first: a row too stale for the
        rows its version may start is given back and generated again with newer weights, in
        place; a filter's dropped rows go before the ack, so no downstream task sees them).
        ``it["partial"]``: the rows are some of the lease's (a serve loop writes each sample as
        it finishes); the rest stay leased."""
        rows, version, lease = it["rows"], it["version"], it["lease"]
        cols = {o: list(v) for o, v in it["out"].items()}
        partial = bool(it.get("partial"))
        if self.stamps:
            versions = it.get("versions") or [version if version is not None else 0] * len(rows)
            extra = self.extra_rows()
            stale = ([r for r, v in zip(rows, versions)
                      if not self.gate.fresh_enough(r, v, extra)] if self.gate else [])
            if stale:
                self.stats["stale_dropped"] += len(stale)
                self.pending_drops.append((stale, "regenerated"))
                self.store.release_rows(lease.id, stale)
                gone = set(stale)
                keep = [i for i, r in enumerate(rows) if r not in gone]
                if not keep:
                    return False
                rows = [rows[i] for i in keep]
                versions = [versions[i] for i in keep]
                cols = {f: [v[i] for i in keep] for f, v in cols.items()}
                partial = True
            cols["_version"] = versions
        keep = it.get("keep")
        if keep is not None:
            gone = [r for r, k in zip(rows, keep) if not k]
            if gone:
                self.store.drop(gone, self.task.name)
                self.control.note_drops(gone, "filter")
        if partial:
            self.store.ack_rows(lease.id, rows, cols)
            self.progress += 1
        else:
            self.ack_later(lease.id, cols)  # with the next READ where the store can
        self.stats["rows"] += len(rows)
        if self.reports_rewards:
            self.pending_rewards.append((list(rows), list(cols[self.task.outputs[0]])))
        self.rec.span("WRITE", len(rows), it["end"], version=version, step=it.get("step"))
        return True

    def op_publish(self, op: Op, it: dict) -> bool:
        """Publish version n + 1 after train step n (every ``publish_every`` steps and the
        last), before anything else: the gated rollout waits for exactly this version."""
        step = it["step"]
        if self.publish_due(step):
            tp = time.time()
            it["publish_s"] = it.get("publish_s", 0.0) + self.publish_version(op.model, step + 1)
            self.rec.span("PUBLISH", 0, tp, version=step + 1, step=step)
        return True

    def publish_due(self, step: int) -> bool:
        """Whether train step ``step`` publishes version ``step + 1``: every ``publish_every``
        steps, and the last."""
        return (step + 1) % self.publish_every == 0 or step + 1 == self.st.steps

    def ack_step(self, leases: list) -> None:
        """Ack a train step's micro-batch leases, in one store call."""
        ids = [lease.id for lease in leases]
        for lid in ids:
            self.unhold(lid)
        if ids:
            self.progress += len(ids)
            self.send(self.store.ack_many, ids)

    def staleness_of(self, step: int, versions) -> list[int]:
        """Gate rule 4's record: the staleness of each row train step ``step`` consumed."""
        return [self.accept.staleness(step, v) for v in versions]

    def end_step(self, it: dict) -> None:
        """A train step is done: ack its rows, checkpoint, report (after the last step and at each
        checkpoint, the trained model is first written to ``RUN_DIR/final/<model>``:
        runtime/export.py)."""
        step, rows = it["step"], it.get("rows", [])
        self.ack_step(it.get("leases", []))
        self.stats["rows"] += len(rows)
        cols = it.get("cols") or {}
        versions = cols.get("_version") or [None] * len(rows)
        ckpt = None
        run_dir, every = self.opt.get("run_dir"), self.opt.get("checkpoint_every")
        if run_dir and every:
            if checkpoint.wanted(every, step + 1, self.st.steps):  # before step + 1 starts
                ckpt = checkpoint.save_engine(self.engine, run_dir, step + 1, self.id)
        exported = None
        if run_dir and self.wp.replica == 0 and (ckpt or step + 1 == self.st.steps):
            # the last step, and each checkpoint: RUN_DIR/final holds the newest trained model
            # even of a run that is killed later
            exported = export.write_final(self.engine, run_dir, self.plan, self.task.name, step + 1)
        self.report_step(self.task.name, {
            "replica": self.wp.replica, "checkpoint": ckpt, "export": exported, "step": step,
            "version": step + 1, "end": time.time(),
            "rows": rows, "staleness": self.staleness_of(step, versions),
            "rewards": list(cols.get(self.reward) or []) if self.reward else [],
            "metrics": plain_metrics(it.get("metrics")), "publish_s": it.get("publish_s", 0.0),
            "next_row": self.next_row(step, rows),
            "compute_s": it.get("compute_s", 0.0),
            "samples": self.sampler.take(step, cols) if self.sampler is not None else []})




_UNREADABLE: set[str] = set()  # metrics said to be unreadable (once each)


def plain_metrics(m: Any) -> dict:
    """A train step's metrics as plain values; one that is neither (a tensor of many values:
    ``.item()`` raises) is left out of the step's report, said once per name."""
    out = {}
    for k, v in (m or {}).items():
        if hasattr(v, "item"):
            try:
                v = v.item()
            except Exception as e:  # noqa: BLE001 (any tensor type's refusal)
                if str(k) not in _UNREADABLE:
                    _UNREADABLE.add(str(k))
                    print(f"asyncflow: metric {k!r} is left out of the step reports: it is not "
                          f"one value ({e.__class__.__name__}: {e})", file=sys.stderr)
                continue
        if isinstance(v, (int, float, str, bool)) or v is None:
            out[str(k)] = v
    return out
