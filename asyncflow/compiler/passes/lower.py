"""lower: the annotated graph -> an ExecutionPlan with per-worker op lists and the sync schedule.

A worker's op list is the body of its per-step loop (after Ray Compiled Graphs' READ / COMPUTE /
WRITE lowering). Two separate functions build it:

- :func:`naive_ops` -- the synchronous, unoverlapped schedule: a worker fed weights WAITs for
  the version of this step and ADOPTs it, READs its share of the whole step from every input
  channel, COMPUTEs, WRITEs every output channel; a trainer then PUBLISHes and nothing else runs
  until the next step's weights exist.
- :func:`overlap_rewrite` -- rewrites a naive list using the overlap and staleness annotations:

  1. every READ says how the worker leases (:func:`read_fields`, from its input granularity,
     overlap rules 1-9): ``sample`` -- whatever is ready, up to the task's batch (``args.slots``
     of a rollout, else ``args.batch_size``, else a whole step: an engine costs nearly the same
     on 64 rows as on 256); ``group`` -- the same in whole groups; a train task -- fixed-size
     reads of ``read_rows`` (its micro-batch, a whole number of groups) repeated until the step's
     rows are leased, in step order (``step`` when rule 1 makes it a barrier), every
     micro-batch that is ready in one store read (``per_read``: the step's micro-batches, so
     a step of 1,024 micro-batches of 16 is a few round trips, not 1,024; measured on Ray at
     micro-batches of 16 and 1,024, a cap of 1,024 rows a read was slower, its round trips
     costing more than the wait for a first micro-batch); a streaming ``first_ready`` trainer
     leases step n + 1's first micro-batch while its device computes step n's last (``ahead``
     rows: the step boundary's store calls are hidden behind device time, not added to it; the
     staleness bound is step n + 1's either way), and a streaming ``in_order`` trainer (one
     replica, no redundancy, max_staleness > 0) the ready rows of step n + 1's window that its
     first read would take (``ahead`` = ``rows`` x ``per_read``) -- where its device computes
     while the loop reads (a GPU plan, or the sim engine; :func:`overlaps_reads`); ``step`` --
     one whole step. A continuous-batching rollout (kind loop ``serve``) pulls at most ``chunk``
     rows per lease (its whole batch: one store call fills every free slot); a train READ holds
     its lease for the whole step (``lease_s``);
  2. COMPUTE and WRITE follow the READ (outputs stream as soon as they exist), except a train
     COMPUTE: one ``train_step`` per step on the whole step in row order -- or, for a streaming
     trainer (``stream``), one COMPUTE per micro-batch (``rows`` = micro_batch, ``repeat`` =
     samples_per_step / micro_batch: forward and backward as the rows arrive) and one optimiser
     step per step;
  3. a WAIT on a sync edge with ``max_staleness`` a > 0 gets ``max_lag = a`` (the smallest of the
     task's sync edges, as the gate): it blocks only when the worker is a versions ahead of the
     trainer (deferred sync); the ADOPT stays before the READ, so new weights are taken up
     between requests, never in the middle of one;
  4. a PUBLISH never waits for its consumers (the trainer goes on to the next step);
  5. staleness-0 edges keep their blocking WAIT (``max_lag = 0``): the synchronous plan;
  6. a rollout with ``schedule: queue`` reads single samples (granularity ``sample``, unit 1,
     whatever its inputs' granularity: prompt replication, a group's samples are independent
     requests spread over the replicas); ``schedule: batch`` keeps the shape of rule 1 (whole
     groups when an input comes in groups). A ``consume: first_ready`` trainer's READs say so in
     their note (the shape stays rule 1's; the runtime reads ``TaskPlan.consume``);
  7. of a trainer's replicas (data parallel: identical weights after every step) only replica 0
     PUBLISHes: the others' op lists have no PUBLISH;
  8. a data-parallel trainer's replicas split every step: replica k of n READs only its share,
     the step's groups g with ``g % n == k`` (``Op.share = [k, n]``; a group is never split,
     so a removal or a staleness drop stays inside one share). Every replica trains every step,
     an empty share too (fewer groups than replicas): it still joins the step's all-reduces.
     The split needs the step's groups fixed in advance (``in_order`` without redundancy or
     refill: validate, AF328).

Every :class:`TaskPlan` carries its scheduling keys with the kind's defaults filled in, and the
:class:`StepPlan` the groups a step launches (``launch_groups``) and the drop reasons whose groups
are replaced (``replace``): :func:`asyncflow.compiler.passes.scheduling`.

The sync schedule (one :class:`SyncPlan` per sync edge): ``deferred`` when ``max_staleness`` > 0,
``blocking`` when it is 0; ``via`` as written (``collective`` where only ``delta`` or
``bucket_mb`` is), else ``collective`` where both ends run engines
whose weights are torch tensors (``Capabilities.tensors``) and the backend is Ray, ``store`` otherwise
(the local backend's board hands the trainer's tensors over in memory). Worker ids are
``"task/replica"``; channel ids ``"src->dst"``.

9. Every :class:`WorkerPlan` says what its worker does (:func:`worker_settings`), so the runtime
   and the simulator derive nothing: its ``loop`` (the kind's; ``serve`` only where the engine
   serves requests and the schedule asks for it, else ``batches``), the ``primary`` trainer (a
   sync edge's source, else the first trainer in topological order), whether it ``chooses``
   rows for the others (``leads``) or trains the rows the primary chose (``follows``: several
   trainers with redundancy or ``first_ready``), the gate's ``gate_alpha`` (its WAITs' max_lag)
   and ``accept_alpha`` (a trainer: its sync edges' largest max_staleness), ``publish_every``,
   the ``reward_field`` a trainer's reads carry for the step's reward, and the rollout's
   ``sampling`` settings (the temperature scorers and trainers compute log-probs at).
"""
from __future__ import annotations

import dataclasses
import math

from asyncflow import kinds
from asyncflow.compiler.kinds import rules_of
from asyncflow.compiler.passes import (launch_groups, micro_batch, replaced, scheduling, topo_order,
                                       train_tasks_of)
from asyncflow.compiler.passes.overlap import RANK
from asyncflow.compiler.runner import Context
from asyncflow.engines.base import capabilities
from asyncflow.ir import Graph, SourceNode
from asyncflow.compiler.passes.evalplan import eval_plan, held_out
from asyncflow import lora
from asyncflow.plan import (Bundle, ChannelPlan, ModelPlan, Op, Plan, PoolPlan, SourcePlan,
                            StepPlan, SyncPlan, TaskPlan, WorkerPlan)


SERVE_CHUNK = 16  # the fewest rows one pull of a continuous-batching rollout may lease
TRAIN_LEASE_S = 3600.0  # a trainer holds its leases until the whole step is trained


def plain(v):
    """JSON-shaped data: tuples -> lists, keys -> str (so the plan round-trips exactly)."""
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    return v


def channel_id(src: str, dst: str) -> str:
    return f"{src}->{dst}"


def naive_ops(graph: Graph, task: str, ins, outs, sync_in, sync_out) -> list[Op]:
    """The synchronous schedule of one task's workers (see the module docstring)."""
    d = graph.node(task).defn
    sps = graph.pipeline.step.samples_per_step
    share = math.ceil(sps / d.replicas)
    ops: list[Op] = []
    for e in sync_in:
        model = graph.node(e.dst).defn.model
        ops.append(Op("WAIT", task, model=model, max_lag=0, note="wait for this step's version"))
        ops.append(Op("ADOPT", task, model=model, note="take the new weights"))
    for e in ins:
        ops.append(Op("READ", task, channel_id(e.src, e.dst), list(e.fields), rows=share,
                      granularity="step", unit=share, min_rows=share))
    what = d.estimator or d.loss or d.fn or d.engine or ""
    runner = kinds.KINDS[d.kind].runner.rpartition(".")[2]
    ops.append(Op("COMPUTE", task, rows=share, note=f"{runner} {what}".strip()))
    for e in outs:
        ops.append(Op("WRITE", task, channel_id(e.src, e.dst), list(e.fields), rows=share))
    if d.keep:
        ops.append(Op("WRITE", task, None, list(d.keep), rows=share, note="final output (keep)"))
    for model in sync_out:
        ops.append(Op("PUBLISH", task, model=model, note="publish version n+1, wait for adopters"))
    return ops


def read_fields(graph: Graph, task: str, grans: list[tuple[str, int]]) -> dict:
    """Rule 1: the READ fields of ``task`` given its input edges' (granularity, unit rows)."""
    st = graph.pipeline.step
    sps, spp = st.samples_per_step, st.samples_per_prompt
    d = graph.node(task).defn
    k = kinds.KINDS[d.kind]
    gran, unit = max(grans or [("sample", 1)], key=lambda x: RANK[x[0]])
    if scheduling(graph, task)["schedule"] == "queue":  # a kind that takes it: rollout
        gran, unit = "sample", 1  # rule 6: every sample its own request
    if k.loop == "train":  # in order, fixed size: micro-batches (or the step barrier)
        rows = min(sps, graph.meta(task).get("read_rows", 0) or sps)
        gran = "step" if gran == "step" or rows >= sps else "micro_batch"
        out = {"granularity": gran, "rows": rows, "unit": rows, "min_rows": rows,
               "repeat": math.ceil(sps / rows), "lease_s": TRAIN_LEASE_S}
        if gran == "micro_batch":  # one store read takes every micro-batch that is ready
            out["per_read"] = out["repeat"]
        return out
    if gran in ("step", "micro_batch"):
        return {"granularity": "step", "rows": sps, "unit": sps, "min_rows": sps, "repeat": 1}
    args = d.args or {}
    batch = int(args.get("batch_size", 0) or 0) or sps
    if rules_of(d.kind).samples:  # a rollout engine's slots
        batch = int(args.get("slots", 0) or 0) or batch
    out = {"granularity": gran, "rows": batch, "unit": 1, "min_rows": 1, "repeat": 0}
    if gran == "group" and spp > 1:
        out.update(rows=max(spp, batch // spp * spp), unit=spp, min_rows=spp)
    if k.loop == "serve":
        # one store call leases every row the free slots take (whole groups for a group
        # read): a chunk per lease would cost a round trip per 16 rows (1,024 a step at
        # 16,384 slots; benchmarks/runtime.py), and finished rows are written by row anyway
        out["chunk"] = max(SERVE_CHUNK, spp, out["rows"])
    return out


def sync_via(graph: Graph, src: str, dst: str, defn, backend: str) -> str:
    """How a sync edge's weights travel (the module docstring): as written; a collective where
    only its options (``delta``, ``bucket_mb``) are written, on either backend."""
    if defn.via:
        return defn.via
    if defn.delta or defn.bucket_mb is not None:
        return "collective"
    ends = (graph.node(src).defn.engine, graph.node(dst).defn.engine)
    tensors = all(capabilities(e, load=False).tensors for e in ends)
    return "collective" if backend == "ray" and tensors else "store"


def accept_alpha(edges, task: str) -> int:
    """Gate rule 4 for trainer ``task``: the largest ``max_staleness`` of its sync edges (0
    without one: at alpha 0 nothing of step n + 1 is ready before its weights are)."""
    return max((e.max_staleness for e in edges if e.src == task), default=0)


def overlaps_reads(graph: Graph, d) -> bool:
    """Rule 1's read-ahead: whether a trainer's device computes while its loop reads -- on a
    GPU (kernels run asynchronously) or an engine on no device (sim: modelled time). A torch
    engine on CPU computes in the loop's own thread: a read ahead would only come earlier, before
    the step publishes (measured on the main job: no faster, a longer tail)."""
    placement = graph.g.graph.get("placement") or {}
    return placement.get("device_kind") == "GPU" or not capabilities(
        d.engine, load=False).uses_device


def overlap_rewrite(graph: Graph, task: str, ops: list[Op], sync_alpha: dict[str, int],
                    grans: list[tuple[str, int]]) -> list[Op]:
    """Rules 1-6 of the module docstring, applied to a naive op list (a new list).
    ``sync_alpha``: model -> the smallest ``max_staleness`` of ``task``'s sync edges."""
    sps = graph.pipeline.step.samples_per_step
    read = read_fields(graph, task, grans)
    d = graph.node(task).defn
    train = kinds.KINDS[d.kind].loop == "train"
    sched = scheduling(graph, task)
    out = []
    for op in ops:
        new: dict = {"fields": list(op.fields)}  # what this rule changes in a copy of op
        if op.kind == "READ":  # rule 1
            new.update(read)
            if sched["consume"] == "first_ready":
                a = sync_alpha.get(d.model or "", 0)
                new["note"] = (f"first ready rows of any step with step - version <= {a}; "
                               "too stale: dropped and replaced")
                if (train and sched["stream"] and read["granularity"] == "micro_batch"
                        and overlaps_reads(graph, d)):
                    new["ahead"] = read["rows"]  # rule 1: the next step's first micro-batch
            elif (train and sched["stream"] and read["granularity"] == "micro_batch"
                  and overlaps_reads(graph, d) and d.replicas <= 1
                  and launch_groups(graph) <= graph.pipeline.step.prompts_per_step
                  and accept_alpha(graph.pipeline.sync, task) > 0):  # 0: nothing is ready
                # rule 1, in_order: the next step's first read (what is ready of its window)
                new["ahead"] = read["rows"] * max(1, read.get("per_read", 1))
        elif op.kind == "COMPUTE" and train and sched["stream"]:  # rule 2, streaming
            mb = micro_batch(graph, task)
            new.update(rows=mb, repeat=math.ceil(sps / mb),
                       note=(f"train_stream {d.loss}: forward and backward per micro-batch as it "
                             "is read, one optimiser step per step"))
        elif op.kind in ("COMPUTE", "WRITE"):  # rule 2
            new["rows"], new["repeat"] = (sps, 1) if train else (read["rows"], read["repeat"])
            if op.kind == "COMPUTE" and sched["schedule"]:  # rule 6
                new["note"] = op.note + (", each sample its own request"
                                         if sched["schedule"] == "queue"
                                         else ", whole batches per call")
        elif op.kind == "WAIT":
            a = sync_alpha.get(op.model or "", 0)
            new.update(max_lag=a,  # rules 3, 5
                       note=(f"block only when {a} version{'s' if a != 1 else ''} ahead of the "
                             "trainer" if a else "wait for this step's version (staleness 0)"))
        elif op.kind == "ADOPT":
            new["note"] = "adopt the newest published version between requests" if sync_alpha.get(
                op.model or "", 0) else "take the new weights"
        elif op.kind == "PUBLISH" and sync_alpha.get(op.model or "", 0):  # rule 4
            new["note"] = "publish version n+1 without waiting"
        out.append(dataclasses.replace(op, **new))
    return out


def lower(graph: Graph, ctx: Context, *, naive: bool = False) -> Plan:
    g = graph
    p = g.pipeline
    st = p.step
    order = topo_order(g)
    pos = {n: i for i, n in enumerate(order)}
    trained = train_tasks_of(g)
    placement = g.g.graph.get("placement", {"device_kind": "CPU", "pools": {}})

    def resolved(name: str, seen=()) -> tuple[str | None, dict]:
        m = p.models.get(name)
        if m is None:
            return None, {}
        if m.copy_of and m.copy_of not in seen:
            return resolved(m.copy_of, seen + (name,))
        return m.init, dict(m.args)

    models = []
    for name, m in p.models.items():
        init, args = resolved(name)
        models.append(ModelPlan(name, init, plain(args), m.frozen, m.copy_of,
                                None if m.frozen else trained.get(name),
                                **_model_source(p, name, placement["device_kind"]),
                                lora=lora.resolve(plain(m.lora)), params=m.params or 0))
    data = [SourcePlan(d.name, d.source, plain(d.args), list(d.fields), d.epochs,
                       {"": _loc(d), **{k: str(v) for k, v in d.locs.items() if v.line}}, d.split)
            for d in p.data.values()]
    data.sort(key=lambda s: s.name == held_out(p))  # a source held out for eval: comes last
    pools = [PoolPlan(name, v["devices"], placement["device_kind"],
                      [Bundle(i, plain(b)) for i, b in enumerate(v["bundles"])], list(v["tasks"]),
                      _loc(p.pools[name]) if name in p.pools else "")
             for name, v in placement["pools"].items()]

    ins: dict[str, list] = {}
    outs: dict[str, list] = {}
    channels = []
    grans: dict[str, list[tuple[str, int]]] = {}  # task -> its input edges' (granularity, unit)
    for e, m in sorted(g.data_edges(), key=lambda x: (pos[x[0].dst], pos[x[0].src])):
        ins.setdefault(e.dst, []).append(e)
        outs.setdefault(e.src, []).append(e)
        grans.setdefault(e.dst, []).append((m.get("granularity", "step"), m.get("unit_rows", 1)))
        channels.append(ChannelPlan(channel_id(e.src, e.dst), e.src, e.dst, list(e.fields),
                                    m.get("granularity", "step"), m.get("staleness", 0),
                                    m.get("capacity", st.samples_per_step), m.get("unit_rows", 1)))
    sync_in: dict[str, list] = {}
    sync_out: dict[str, list[str]] = {}
    sync_alpha: dict[str, int] = {}  # model -> max_staleness of its sync edges
    wait_alpha: dict[str, dict[str, int]] = {}  # task -> model -> its smallest max_staleness
    syncs = []
    for e, m in g.sync_edges():
        model = m.get("model") or g.node(e.dst).defn.model or ""
        sync_in.setdefault(e.dst, []).append(e)
        if model not in sync_out.setdefault(e.src, []):
            sync_out[e.src].append(model)
        sync_alpha[model] = max(sync_alpha.get(model, 0), e.max_staleness)
        w = wait_alpha.setdefault(e.dst, {})
        w[model] = min(w.get(model, e.max_staleness), e.max_staleness)
        syncs.append(SyncPlan(e.src, e.dst, model, e.max_staleness,
                              "deferred" if e.max_staleness > 0 else "blocking",
                              via=sync_via(g, e.src, e.dst, e.defn, ctx.backend),
                              bucket_bytes=int((e.defn.bucket_mb or 128) * (1 << 20)),
                              delta=bool(e.defn.delta)))

    settings = worker_settings(g, order, syncs, ctx.load_engines)
    tasks, workers = [], []
    for n in order:
        node = g.node(n)
        if isinstance(node, SourceNode):
            continue
        d, m = node.defn, g.meta(n)
        tasks.append(TaskPlan(
            n, d.kind, list(d.inputs), list(d.outputs), d.replicas, d.devices_per_replica,
            d.engine, d.model, d.pool, d.fn, d.batched, d.estimator, d.loss, d.env, list(d.keep),
            plain(d.args), plain(d.cost), m.get("lag", 0), m.get("run_ahead", 0),
            m.get("time_share", 0), m.get("stage", 0), m.get("read_rows", 0),
            plain(m.get("bind_in", [])), plain(m.get("bind_out", [])), _loc(d),
            **scheduling(g, n)))
        ops = naive_ops(g, n, ins.get(n, []), outs.get(n, []), sync_in.get(n, []), sync_out.get(n, []))
        if not naive:
            ops = overlap_rewrite(g, n, ops, {**sync_alpha, **wait_alpha.get(n, {})},
                                  grans.get(n, []))
        for w in m.get("workers", [{"id": f"{n}/0", "replica": 0, "bundles": [], "resources": {}}]):
            # rule 7: of a data-parallel trainer's replicas (identical weights) only rank 0
            # publishes; the others would send the same version again
            mine = [o for o in ops if not (o.kind == "PUBLISH" and w["replica"] > 0)]
            # rule 8: each replica of a data-parallel trainer reads its share of every step
            share = ([w["replica"], d.replicas]
                     if d.replicas > 1 and kinds.KINDS[d.kind].loop == "train" else [])
            workers.append(WorkerPlan(w["id"], n, w["replica"], d.pool, list(w["bundles"]),
                                      plain(w["resources"]),
                                      [dataclasses.replace(
                                          o, fields=list(o.fields),
                                          share=list(share) if o.kind == "READ" else [])
                                       for o in mine],
                                      w.get("process") or w["id"], list(w.get("devices", [])),
                                      **settings(n, d, mine)))
    return Plan(
        pipeline=p.name, source_file=ctx.source_file, seed=p.seed,
        step=StepPlan(st.prompts_per_step, st.samples_per_prompt, st.samples_per_step, st.steps,
                      launch_groups(g), replaced(g)),
        models=models, data=data, pools=pools, tasks=tasks, workers=workers, channels=channels,
        sync=syncs, concurrency=[list(c) for c in g.g.graph.get("concurrency", [])],
        device_kind=placement["device_kind"], fields=plain(g.g.graph.get("fields", {})),
        eval=eval_plan(p, plain))


def task_loop(g: Graph, task: str, load: bool = True) -> str:
    """Rule 9: the loop a task's workers run -- the kind's, except that a ``serve`` kind runs
    ``batches`` unless its engine serves requests (continuous batching) and its ``schedule``
    asks for it (``queue``; unset: what the engine's ``serves_unless_told`` says -- sim's
    default). ``load``: a plug-in engine may be imported to read its capabilities (not at
    check, which imports no engine: a plug-in then runs ``batches`` there)."""
    d = g.node(task).defn
    loop = kinds.KINDS[d.kind].loop
    if loop != "serve":
        return loop
    schedule = scheduling(g, task)["schedule"]
    if schedule == "batch":
        return "batches"
    caps = capabilities(d.engine, load)  # a plug-in's is imported (load) where it matters
    if not caps.serves:
        return "batches"
    return "serve" if schedule == "queue" or (not schedule and caps.serves_unless_told) else "batches"


def worker_settings(g: Graph, order: list[str], syncs: list[SyncPlan], load: bool = True):
    """Rule 9: ``settings(task, defn, ops)`` -> the :class:`WorkerPlan` fields that say what a
    worker of ``task`` does (its loop, the primary trainer, the gate's alphas, ...)."""
    p = g.pipeline
    defs = {n: g.node(n).defn for n in order if not isinstance(g.node(n), SourceNode)}
    trainers = [n for n, d in defs.items() if rules_of(d.kind).trains]
    srcs = [s.src for s in syncs if s.src in trainers]
    primary = (srcs or trainers or [None])[0]
    launch = launch_groups(g) or p.step.prompts_per_step
    first_ready = any(scheduling(g, n)["consume"] == "first_ready" for n in defs)
    reward = next((f for n in sorted(defs, key=lambda n: not rules_of(defs[n].kind).rewards)
                   for f, r in g.meta(n).get("bind_out", []) if r == "reward"), None)
    temperature = next((float(d.args["temperature"]) for d in defs.values()
                        if rules_of(d.kind).samples and "temperature" in (d.args or {})), 1.0)

    def settings(task: str, d, ops: list[Op]) -> dict:
        loop = task_loop(g, task, load)
        chooses = ""
        if loop == "train" and len(trainers) > 1 and (launch != p.step.prompts_per_step
                                                       or first_ready):
            chooses = "leads" if task == primary else "follows"
        lags = [o.max_lag for o in ops if o.kind == "WAIT" and o.max_lag is not None]
        return {"loop": loop, "primary": primary, "chooses": chooses,
                "gate_alpha": min(lags) if lags else None,
                "accept_alpha": accept_alpha(syncs, task),
                "publish_every": max((int(s.publish_every or 1) for s in syncs if s.src == task),
                                     default=1),
                "reward_field": reward if loop == "train" else None,
                "sampling": {"temperature": temperature}}

    return settings


def _model_source(p, name: str, device_kind: str = "CPU") -> dict:
    """Where model ``name`` comes from (its own, or the copied model's, ``init``), resolved once
    here by the rule check used (:func:`asyncflow.modelsrc.locate`), its dtype (unset: the
    copied model's, else bfloat16 on a GPU plan and float32 on CPU slots, where bfloat16 is
    10-18x slower) and location."""
    from asyncflow.modelsrc import DEFAULT_DTYPE, SourceError, locate
    from asyncflow.refs import search_path

    m, seen, dtype, trust = p.models.get(name), set(), None, None
    while m is not None and m.name not in seen:
        seen.add(m.name)
        dtype = dtype or m.dtype
        trust = trust if trust is not None else m.trust_remote_code
        if not m.copy_of:
            break
        m = p.models.get(m.copy_of)
    out = {"dtype": dtype or ("bfloat16" if device_kind == "GPU" else DEFAULT_DTYPE),
           "trust_remote_code": bool(trust)}
    if m is None or not m.init:
        return out
    out["loc"] = str(m.locs.get("init", m.loc)) if (m.locs.get("init") or m.loc).line else ""
    try:
        src = locate(m.init, search_path(p.path or None))
    except SourceError:  # reported by validate; a plan is only lowered from a clean graph
        return out
    return {**out, "source_kind": src.kind, "source": src.ref, "path": src.path}


def _loc(defn) -> str:
    """Where ``defn`` is written, as "file:line:col" ("" when it has no source)."""
    loc = getattr(defn, "loc", None)
    return str(loc) if loc is not None and loc.line else ""
