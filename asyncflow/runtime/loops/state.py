"""The state of one task replica's loop, and the hooks a host provides
(:mod:`asyncflow.runtime.loops`).

:class:`Loop` is built from a :class:`~asyncflow.plan.WorkerPlan` alone: its gate, windows,
staleness acceptance, bindings, op list and loop shape. Its loops and op handlers (the mixins
:class:`~asyncflow.runtime.loops.ops.OpHandlers`,
:class:`~asyncflow.runtime.loops.serve.ServeLoop`,
:class:`~asyncflow.runtime.loops.step_reads.StepReads`) call the host through the hooks below;
a host subclasses :class:`Loop` and overrides them: :class:`asyncflow.runtime.worker.Worker`
(a thread or a Ray actor's thread, real time) and the simulator's workers (virtual time,
:mod:`asyncflow.simulate.core`).
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

from asyncflow import kinds
from asyncflow.compiler.kinds import rules_of
from asyncflow.plan import Op, Plan
from asyncflow.runtime.contract import check_outputs
from asyncflow.runtime.gate import Gate
from asyncflow.runtime.loops.flow import Flows
from asyncflow.runtime.loops.ops import OpHandlers
from asyncflow.runtime.loops.serve import ServeLoop
from asyncflow.runtime.loops.step_reads import StepReads
from asyncflow.runtime.samples import Sampler
from asyncflow.runtime.trace import Recorder
from asyncflow.runtime.windows import Windows


def body(ops: list[Op]) -> list[Op]:
    """The op list as the worker runs it: a run of READs (one per channel) is one READ over
    their fields, a run of WRITEs one WRITE (one lease, one ack)."""
    out: list[Op] = []
    for op in ops:
        if out and op.kind in ("READ", "WRITE") and out[-1].kind == op.kind:
            out[-1] = Op(**{**out[-1].__dict__,
                            "fields": list(dict.fromkeys(out[-1].fields + op.fields))})
        else:
            out.append(op)
    return out


class Loop(Flows, OpHandlers, ServeLoop, StepReads):
    """One task replica's loop state; :meth:`run_loop` runs the loop its plan names."""

    def __init__(self, plan: Plan | dict, worker_id: str, store, control,
                 options: dict | None = None):
        self.plan = Plan.from_dict(plan) if isinstance(plan, dict) else plan
        self.wp = self.plan.worker(worker_id)
        self.task = self.plan.task(self.wp.task)
        self.id = worker_id
        self.store, self.control = store, control
        self.opt = dict(options or {})
        self.backoff = float(self.opt.get("backoff_s", 0.005))
        self.timeout = float(self.opt.get("read_timeout_s", 0.02))
        self.rec = Recorder(worker_id, self.task.name, self.wp.pool)
        self.st = self.plan.step
        self.body = body(self.wp.ops)
        self.ops = {"WAIT": self.op_wait, "ADOPT": self.op_adopt, "READ": self.op_read,
                    "COMPUTE": self.op_compute, "WRITE": self.op_write,
                    "PUBLISH": self.op_publish}
        self.loops = {"batches": self.loop_batches, "serve": self.loop_serve,
                      "train": self.loop_train}
        # what it does, as the plan says (lower rule 9): its loop, the gate's alphas, ...
        self.loop = self.wp.loop
        sps, steps, spp = self.st.samples_per_step, self.st.steps, self.st.samples_per_prompt
        # the scheduling keys: groups launched per step (redundancy), drop reasons replaced by
        # new groups (refill, first_ready), and the trainer's step windows over them
        self.launch = int(self.st.launch_groups or self.st.prompts_per_step)
        self.windows = Windows(spp, self.launch, self.st.replace)
        launch_rows = self.launch * spp
        # gate rule 2: alpha is the WAIT ops' max_lag (the smallest of the task's sync edges)
        alpha = self.wp.gate_alpha
        self.gate: Gate | None = Gate(alpha, sps, steps, launch_rows) if alpha is not None else None
        # gate rule 4 for a trainer: the staleness its published versions may carry
        self.accept = Gate(self.wp.accept_alpha, sps, steps, launch_rows)
        self.on_update = self.task.on_update or "finish"
        self.consume = self.task.consume or "in_order"
        # the train task whose choice of rows the others follow (first_ready, redundancy)
        self.primary = self.wp.primary
        self.leads = self.wp.chooses == "leads"  # records its rows per step
        self.follows = self.wp.chooses == "follows"  # trains the rows the primary chose
        self.next_group = int(self.opt.get("start_step", 0)) * self.launch  # the next window's
        if self.opt.get("start_row") is not None:
            self.next_group = int(self.opt["start_row"]) // spp
        self.cancel_queue: list[int] = []  # rows removed while perhaps in flight (serve loop)
        self.in_flight = 0  # samples a serve loop has in its engine
        self.top_row = int(self.opt.get("start_row") or 0) - 1  # the highest row trained
        self.newest = 0  # the newest policy version published, as far as this worker knows
        # first_ready: a sample in flight that no train step may take any more is cancelled
        # and replaced at once (not generated to the end and dropped)
        self.hopeless = (self.loop == "serve" and self.gate is not None
                         and "staleness" in self.st.replace and self.on_update != "abort")
        self.models_in = sorted({o.model for o in self.body if o.kind == "ADOPT" and o.model})
        self.publish_every = self.wp.publish_every
        self.engine: Any = None
        self.adopter: Any = None  # the versions (and weights) it receives: weights.Adopter
        self.stopped = False
        self.flow = None  # the loop's flow while a host drives it (Flows.drive)
        self.newer: dict = {}  # model -> (version, entry) offered, not yet adopted
        self.idle = False  # the last READ found nothing
        self.cursor = int(self.opt.get("start_step", 0)) + self.wp.replica  # step READs
        self.ahead: dict[int, list] = {}  # step -> leases read ahead of it (StepReads.read_ahead)
        self.stale_reads = 0  # a trainer's reads that found rows too stale (and dropped them)
        # a data-parallel trainer's replica: its READs take its share of each step (lower rule 8)
        self.shares = any(o.share for o in self.body if o.kind == "READ")
        # what the next sync reports: (rows, values) of rewards, (rows, reason) of drops, run
        # events (an injected kill: when it struck; an eval row)
        self.pending_rewards: list = []
        self.pending_drops: list = []
        self.pending_events: list = []
        # a batches loop's acks that go out with its next READ (a store whose reads carry acks:
        # the sharded store on Ray), so a lease costs one store call, not two (Loop.ack_later)
        self.carried: list = []
        self.carries_acks = self.loop == "batches" and bool(getattr(store, "carries_acks", False))
        self.stats: dict = {"rows": 0, "leases": 0, "empty_reads": 0, "stale_dropped": 0}
        self.faults: list = []  # injected faults (a host with faults sets them: inject, nan)
        self.progress = 0  # a counter of work done (the watchdog's)
        self.paths = list(self.opt.get("search_path") or ())
        # the plan's bindings: which of the store's fields is which role (never a fixed name)
        self.roles_in = [(f, r) for f, r in self.task.bind_in if r != "keep"]
        self.roles_out = [(f, r) for f, r in self.task.bind_out]
        self.out_types = [(f, kinds.ROLES[r].type if r in kinds.ROLES else "any")
                          for f, r in self.roles_out]
        # a task that writes a response stamps each row with the version it was generated with
        self.stamps = any(r == "response" for _, r in self.roles_out)
        # a trainer's reads carry the reward column (for the step's reward_mean): the field a
        # reward task writes as its reward, else a multi-turn rollout's episode return
        self.reward = self.wp.reward_field
        # a reward task reports what it writes (its first output) for the step's reward_mean
        self.reports_rewards = bool(rules_of(self.task.kind).rewards and self.task.outputs)
        self.fields = None
        if self.loop == "train":
            if self.reward and self.reward not in self.task.inputs:
                self.fields = list(self.task.inputs) + [self.reward]
        # samples.jsonl: the primary trainer's report of a logged step carries a few of its rows
        # (runtime/samples.py); they may need a field the trainer does not train on (the prompt)
        self.sampler = Sampler.of(self)
        if self.sampler is not None and self.sampler.extra:
            self.fields = list(dict.fromkeys((self.fields or list(self.task.inputs))
                                             + self.sampler.extra))

    # ------------------------------------------------------------------ host hooks
    # a host overrides these (the Host protocol, asyncflow.runtime.loops.host); the defaults
    # are those of a host without a control plane, faults or liveness
    def sync(self, force: bool = False, wait_s: float = 0.0) -> bool:
        """Flush reports, learn of the stop flag, newer weights and removed rows (through
        :meth:`heard_newer` and :meth:`heard_dropped`); True when the run is stopping."""
        return self.stopped

    def clock(self) -> float:
        """Now, in seconds (the simulator's: virtual)."""
        return time.time()

    def send(self, fn, *args) -> None:
        """Make a call whose answer the loop does not need (a trainer's publish notice, its
        step's ack and report): at once here; the Ray host hands it to its courier
        (:mod:`asyncflow.runtime.courier`)."""
        fn(*args)

    def report_step(self, task: str, report: dict) -> None:
        """Report a train step to the control (:meth:`send`: the loop does not wait); the Ray
        host's heartbeat goes with it."""
        self.send(self.control.report_step, task, report)

    def fetch(self, fn, *args, **kwargs) -> Future:
        """Make a call whose answer the loop takes later (a trainer's read of the next step's
        rows, made while it finishes this one): at once here, its answer (or exception) in a
        done future; the Ray host makes it on a thread of its own (:meth:`fetches`)."""
        f: Future = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 -- raised where the loop takes the answer
            f.set_exception(e)
        return f

    def fetches(self) -> bool:
        """Whether :meth:`fetch` runs beside the loop (then a read made through it may wait
        for rows; made at once, it must not: the loop would wait before it publishes)."""
        return False

    def check(self) -> None:
        """Raise :class:`~asyncflow.runtime.signals.Crash` when this worker was killed."""

    def enter(self, op: str) -> None:
        """The loop enters op ``op`` (liveness, CPU time per op)."""

    def hold(self, lease, lease_s) -> None:
        """The loop holds ``lease`` (a host renews it while the loop computes)."""
        self.progress += 1

    def unhold(self, lease_id) -> None:
        """The loop no longer holds lease ``lease_id``."""

    def inject(self, step: int, rows) -> None:
        """Apply the injected faults due at ``step`` (``asyncflow run --inject``)."""

    def nan(self, step: int, out: dict) -> dict:
        """``out`` as an injected ``nan`` fault leaves it."""
        return out

    def evaluate(self) -> None:
        """eval: evaluate the version held now, if the plan lists it."""

    def publish_version(self, model: str, version: int) -> float:
        """A trainer publishes ``version`` of ``model``; returns the seconds it took."""
        raise NotImplementedError

    # ------------------------------------------------------------------ what it hears
    def heard_newer(self, newer: dict) -> None:
        """Newer weights are offered (model -> (version, entry)); the ADOPT op takes them up."""
        self.newer = newer
        self.newest = max([self.newest] + [int(v[0]) for v in newer.values()])

    def heard_dropped(self, rows: list[int], reason: str) -> None:
        """``rows`` were removed from the store: the windows move; a serve loop cancels those
        it has in flight."""
        self.windows.note(rows, reason)
        if self.loop == "serve":
            self.cancel_queue.extend(rows)

    # ------------------------------------------------------------------ leases
    def ack(self, lease_id, cols=None) -> bool:
        self.unhold(lease_id)
        self.progress += 1
        return self.store.ack(lease_id, cols) if cols is not None else self.store.ack(lease_id)

    def ack_later(self, lease_id, cols) -> None:
        """Ack a lease with its output columns -- where the store's reads carry acks (a batches
        loop's, whose next op is a READ), as part of the next READ's call: one store round trip
        per lease, not two. The ack still reaches the store before that READ leases anything;
        :meth:`flush_acks` sends what is carried before anything that may wait."""
        if not self.carries_acks:
            self.ack(lease_id, cols)
            return
        self.unhold(lease_id)
        self.progress += 1
        self.carried.append((lease_id, cols))

    def carried_acks(self) -> dict:
        """The keyword a READ passes its store to send the carried acks with it (none: {})."""
        if not self.carried:
            return {}
        out, self.carried = self.carried, []
        return {"acks": out}

    def flush_acks(self) -> None:
        """Send the carried acks now (before a wait, at the end of the loop)."""
        out, self.carried = self.carried, []
        for lease_id, cols in out:
            self.store.ack(lease_id, cols)

    def release_lease(self, lease_id) -> bool:
        self.unhold(lease_id)
        return self.store.release(lease_id)

    # ------------------------------------------------------------------ bindings
    def to_roles(self, cols: dict) -> dict:
        """Store columns (the user's fields) -> an engine batch keyed by role; a rollout's
        ``context`` (its further inputs, for an environment) is one tuple per row."""
        out = {k: v for k, v in cols.items() if k.startswith("_")}
        ctx = [cols[f] for f, r in self.roles_in if r == "context"]
        for f, r in self.roles_in:
            if r != "context":
                out[r] = cols[f]
        if ctx:
            out["context"] = list(zip(*ctx))
        return out

    def to_fields(self, out: dict, rows) -> dict:
        """An engine's columns (keyed by role) -> the task's output fields, checked."""
        return self.checked({f: out.get(r) for f, r in self.roles_out}, rows)

    def checked(self, cols: dict, rows) -> dict:
        """``cols`` (the task's output fields) checked against their roles' types (a missing
        output, a wrong length, NaN: AF611/AF612)."""
        check_outputs(self.task, cols, self.out_types, list(rows))
        return cols

    # ------------------------------------------------------------------ versions
    def current_version(self) -> int | None:
        return self.adopter.version if self.adopter else None

    def max_row(self) -> int | None:
        """Gate rule 2: the rows this worker's version may start."""
        return None if self.gate is None else self.gate.max_row(self.current_version() or 0,
                                                                self.extra_rows())

    def extra_rows(self) -> int:
        """Rows fed to replace removed groups, as far as this worker has heard (gate rule 2)."""
        spp = self.st.samples_per_prompt
        return self.windows.replaced_rows // spp * spp

    def step_of_rows(self, rows) -> int:
        return int(rows[0]) // self.st.samples_per_step if rows else 0

    # ------------------------------------------------------------------ loops
    def run_loop(self) -> None:
        """Run the loop the plan names (``batches``, ``serve`` or ``train``) to its end."""
        self.loops[self.loop]()

    def loop_batches(self) -> None:
        """The ``batches`` loop in real time (:meth:`Flows.flow_batches`)."""
        self.drive(self.flow_batches())

    def loop_train(self) -> None:
        """The ``train`` loop in real time (:meth:`Flows.flow_train`)."""
        self.drive(self.flow_train())
