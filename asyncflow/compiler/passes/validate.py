"""The validate pass: the language's rules (docs/language.md), each with its AF3xx code.

Every rule adds located diagnostics and goes on, so a file's independent errors are reported
at once. The rules, in the order they run (codes in :mod:`asyncflow.diagnostics.rules`):

1. data flow: every input has exactly one producer, every output is consumed or kept, the data
   edges form a DAG, tasks read and produce something (AF30x);
2. models: init or copy_of, no copy cycle, not trained when frozen, one trainer each (AF31x);
3. tasks: the keys each kind needs and takes, engine/pool/estimator/loss names, pool sizes,
   the critic (AF32x, AF33x);
4. ``module:function`` references and files resolve -- found and parsed, never imported (AF34x;
   :mod:`asyncflow.compiler.passes.validate_refs`);
5. weight sync: from a train task to a task on the same model, every user of a trained model
   gets one (AF35x);
6. batch arithmetic and the known task ``args`` (AF36x;
   :mod:`asyncflow.compiler.passes.validate_args`);
7. scheduling keys: what each one means in this pipeline (AF38x; which kinds take them is rule
   3's AF326, their values the builder's AF205/AF206/AF202);
8. the ``eval:`` section: its source, rollout, metric and fields (AF384-AF389; the rules are
   :mod:`asyncflow.compiler.passes.evalplan`'s).

A kind's own checks (rules 3 and 7) are its rules' hooks (:mod:`asyncflow.compiler.kinds`).
"""
from __future__ import annotations

from typing import Any

import networkx as nx

from asyncflow.compiler.kinds import SyncFacts, rules_of
from asyncflow.compiler.kinds.base import at as _at
from asyncflow.compiler.passes import first_ready_feeds, launches_ahead, trained_models
from asyncflow.compiler.passes.validate_args import KEYS, check_batch
from asyncflow.compiler.passes.validate_refs import check_init, check_ref, check_source
from asyncflow.diagnostics import Diagnostics, did_you_mean
from asyncflow.dsl import ast
from asyncflow.engines.base import BUILTIN_CAPABILITIES, Capabilities, capabilities, engine_names
from asyncflow.ir import Graph
from asyncflow.kinds import KINDS, LOSSES, REF_KEYS, SCHED_KEYS, sched_owners

# the kinds that must write something: the kinds table
NEEDS_OUTPUTS = tuple(k for k, v in KINDS.items() if v.needs_outputs)
# a plug-in engine is not judged at check by what it carries (AF216 names built-ins only)
TENSORS = Capabilities(tensors=True)


def _caps(engine: str | None) -> Capabilities:
    """An engine's capabilities as ``check`` knows them: never importing a plug-in."""
    return capabilities(engine, load=False)


def validate(graph: Graph, diags: Diagnostics) -> None:
    """Add a located diagnostic to ``diags`` for every rule ``graph`` breaks."""
    p = graph.pipeline
    _dataflow(graph, diags, clean=not diags.errors)
    _models(p, diags)
    for src in p.data.values():
        check_source(p, src, diags)
    _tasks(graph, diags)
    _sync(p, diags)
    check_batch(p, diags)
    _scheduling(p, diags)
    _eval(p, diags)


def _broken(d: Diagnostics, defn: Any, key: str) -> bool:
    """Whether an earlier error points into ``key`` of ``defn`` (its value was dropped)."""
    loc = defn.locs.get(key)
    if loc is None:
        return False
    end = (loc.end_line, loc.end_col) if loc.end_line else (loc.line, loc.col)
    return any(x.loc is not None and x.loc.file == loc.file
               and (loc.line, loc.col) <= (x.loc.line, x.loc.col) <= end for x in d.errors)


# -- 1. data flow -------------------------------------------------------------------------------
def _dataflow(graph: Graph, d: Diagnostics, clean: bool) -> None:
    """``clean``: no earlier error, so the lists of consumers are complete (an earlier error
    may have dropped a task or an ``inputs`` list; "never used" would then be noise)."""
    p = graph.pipeline
    tasks = [t for t in p.tasks.values() if t.name not in p.data]
    for t in p.tasks.values():
        if t.name in p.data:
            d.add("AF306", t.loc, name=t.name)
    producers = graph.producers()
    for f, names in producers.items():
        for name in names[1:]:
            node = graph.node(name).defn
            key = "fields" if isinstance(node, ast.DataDef) else "outputs"
            idx = getattr(node, key).index(f)
            d.add("AF302", _at(node, f"{key}.{idx}"), field=f, first=names[0], second=name)
    consumed = {f for t in tasks for f in t.inputs}
    for t in tasks:
        if not t.inputs and not _broken(d, t, "inputs"):
            d.add("AF307", t.loc, task=t.name)
        if not t.outputs and t.kind in NEEDS_OUTPUTS and not _broken(d, t, "outputs"):
            d.add("AF308", t.loc, what=f"{t.kind} task", name=t.name, key="outputs")
        for i, f in enumerate(t.inputs):
            if f not in producers:
                d.add("AF301", _at(t, f"inputs.{i}"), did_you_mean(f, producers), field=f, task=t.name)
        for i, f in enumerate(t.outputs):
            if clean and f not in consumed and f not in t.keep:
                d.add("AF303", _at(t, f"outputs.{i}"),
                      f"list it as a final output with `keep: [{f}]` in task '{t.name}'",
                      field=f, task=t.name)
        for i, f in enumerate(t.keep):
            if f not in t.outputs:
                d.add("AF304", _at(t, f"keep.{i}"), did_you_mean(f, t.outputs), field=f, task=t.name)
    for src in p.data.values():
        if src.name not in graph.g.nodes:  # held out for eval: (evalplan rule 1) feeds no task
            continue
        if not src.fields and "fields" in src.locs and not _broken(d, src, "fields"):
            d.add("AF308", _at(src, "fields"), what="data source", name=src.name, key="fields")
        for i, f in enumerate(src.fields or ()):
            if clean and f not in consumed:
                d.add("AF309", _at(src, f"fields.{i}"), field=f, source=src.name)
    _cycles(graph, d)


def _cycles(graph: Graph, d: Diagnostics) -> None:
    dag = graph.data_dag()
    order = {n: i for i, n in enumerate(graph.g.nodes)}
    for scc in sorted(nx.strongly_connected_components(dag), key=lambda s: min(order[n] for n in s)):
        first = min(scc, key=order.__getitem__)
        if len(scc) == 1 and not dag.has_edge(first, first):
            continue
        sub = dag.subgraph(scc)
        pred = min((u for u in sub.predecessors(first)), key=order.__getitem__)
        path = nx.shortest_path(sub, first, pred) if pred != first else [first]
        t = graph.node(first).defn
        fields = graph.g.edges[pred, first, "data"]["edge"].fields
        d.add("AF305", _at(t, f"inputs.{t.inputs.index(fields[0])}"),
              f"'{first}' reads '{fields[0]}' from '{pred}', which depends on '{first}'",
              cycle=" -> ".join(path + [first]))


# -- 2. models ------------------------------------------------------------------------------------
def _models(p: ast.Pipeline, d: Diagnostics) -> None:
    used = {t.model for t in p.tasks.values() if t.model}
    for m in p.models.values():
        if m.init is None and m.copy_of is None:
            d.add("AF311", m.loc, model=m.name)
        if m.init is not None and m.copy_of is not None:
            d.add("AF312", _at(m, "copy_of"), model=m.name)
        if m.copy_of is not None and m.copy_of not in p.models:
            d.add("AF310", _at(m, "copy_of"), did_you_mean(m.copy_of, p.models), name=m.copy_of)
        if m.init is not None:
            check_init(p, m, d)
    reported: set[str] = set()
    for m in p.models.values():  # copy_of chains
        chain = [m.name]
        cur = m
        while cur.copy_of in p.models and cur.copy_of not in chain:
            cur = p.models[cur.copy_of]
            chain.append(cur.name)
        if cur.copy_of in chain and m.name in chain[chain.index(cur.copy_of):]:
            cycle = chain[chain.index(cur.copy_of):]
            if not reported & set(cycle):
                reported.update(cycle)
                d.add("AF313", _at(m, "copy_of"), cycle=" -> ".join(cycle + [cycle[0]]))
    copied = {m.copy_of for m in p.models.values() if m.copy_of}
    for m in p.models.values():
        if m.name not in used and m.name not in copied:
            d.add("AF316", m.loc, model=m.name)
    _lora(p, d)
    _sync_method(p, d)


def _lora(p: ast.Pipeline, d: Diagnostics) -> None:
    """A model's ``lora:`` (asyncflow.lora): its keys and values, not on a frozen model (AF214);
    every task that trains or runs the model on an engine that takes adapters (AF215)."""
    from asyncflow import lora

    for m in p.models.values():
        if m.lora is None:
            continue
        for key, problem in lora.problems(m.lora):
            d.add("AF214", _at(m, f"lora.{key}" if key else "lora"), model=m.name,
                  key=f".{key}" if key else "", problem=problem)
        if m.frozen:
            d.add("AF214", _at(m, "lora"), model=m.name, key="",
                  problem="is on a frozen model: nothing trains it (give it to the trained model)")
        for t in p.tasks.values():
            if t.model == m.name and t.engine and not _caps(t.engine).adapters:
                d.add("AF215", _at(t, "engine"), model=m.name, task=t.name, engine=t.engine,
                      engines=", ".join(lora.ENGINES))


def _sync_method(p: ast.Pipeline, d: Diagnostics) -> None:
    """A sync edge's ``via``, ``bucket_mb`` and ``delta`` (asyncflow.runtime.collective): the
    last two belong to a collective edge (written without ``via`` they make it one: lower's
    ``sync_via``); a collective needs both ends' weights to be torch tensors (a built-in engine
    that has none, sim, cannot take part: AF216)."""
    tensors = [e for e, c in BUILTIN_CAPABILITIES.items() if c.tensors]
    for i, s in enumerate(p.sync):
        edge = dict(edge=i, src=s.src, dst=s.dst)
        given = [k for k, on in (("delta", s.delta), ("bucket_mb", s.bucket_mb is not None)) if on]
        if s.via == "store":
            for key in given:
                d.add("AF216", _at(s, key), **edge,
                      problem=f"{key} applies to via: collective only, and this edge sends "
                              "through the store (remove it, or set via: collective)")
        if s.via == "collective" or s.via is None and given:
            at = _at(s, "via" if s.via else given[0])
            for name in (s.src, s.dst):
                t = p.tasks.get(name)
                if t is not None and not BUILTIN_CAPABILITIES.get(t.engine, TENSORS).tensors:
                    d.add("AF216", at, **edge,
                          problem=f"task '{name}' runs on the {t.engine} engine, whose weights "
                                  f"are not tensors to broadcast (a collective needs "
                                  f"{', '.join(tensors)} at both ends; use via: store)")


# -- 3. tasks -------------------------------------------------------------------------------------
def _tasks(graph: Graph, d: Diagnostics) -> None:
    p = graph.pipeline
    engines = engine_names()
    unsplittable = _unsplittable(p)
    trainers: dict[str, list[ast.TaskDef]] = {}
    for t in p.tasks.values():
        required, optional = KEYS[t.kind]
        for key in required:
            if getattr(t, key) is None:
                why = " (a task with an engine runs on a pool's devices)" if key == "pool" else ""
                d.add("AF325", t.loc, task=t.name, kind=t.kind, key=key, why=why)
        for key in REF_KEYS + SCHED_KEYS:
            if getattr(t, key) is not None and key not in required + optional:
                why = ""
                if key in SCHED_KEYS:
                    owners = " and ".join(sched_owners(key))
                    why = f" (a scheduling key of {owners} tasks)"
                elif key in ("engine", "model"):
                    why = " (only rollout, logprob, value and train tasks run a model on an engine)"
                elif key in ("fn", "estimator", "loss", "env"):
                    owner = {"fn": "reward, filter and custom", "estimator": "advantage",
                             "loss": "train", "env": "rollout"}[key]
                    why = f" (only {owner} tasks take one)"
                d.add("AF326", _at(t, key), task=t.name, key=key, kind=t.kind, why=why)
        if t.engine is not None and "engine" in required:
            if t.engine not in engines:
                d.add("AF323", _at(t, "engine"), did_you_mean(t.engine, engines), name=t.engine,
                      known=", ".join(engines))
            elif not _caps(t.engine).runs_kind(t.kind):
                d.add("AF324", _at(t, "engine"), engine=t.engine, kind=t.kind,
                      kinds=", ".join(_caps(t.engine).runs) + " tasks")
        if t.model is not None and t.model not in p.models:
            d.add("AF310", _at(t, "model"), did_you_mean(t.model, p.models), name=t.model)
        if t.pool is not None:
            pool = p.pools.get(t.pool)
            if pool is None:
                d.add("AF320", _at(t, "pool"), did_you_mean(t.pool, p.pools), name=t.pool)
            elif pool.devices is not None and t.replicas * t.devices_per_replica > pool.devices:
                key = "replicas" if "replicas" in t.locs else "devices_per_replica"
                d.add("AF321", t.locs.get(key, _at(t, "pool")), task=t.name,
                      need=t.replicas * t.devices_per_replica, replicas=t.replicas,
                      dpr=t.devices_per_replica, pool=t.pool, devices=pool.devices)
        rules_of(t.kind).check_task(p, t, d, unsplittable)
        for key in ("fn", "env"):
            if getattr(t, key) is not None and key in required + optional:
                check_ref(p, getattr(t, key), key, _at(t, key), d)
        if rules_of(t.kind).trains and t.model in p.models:
            trainers.setdefault(t.model, []).append(t)
    used_pools = {t.pool for t in p.tasks.values()}
    for pool in p.pools.values():
        if pool.name not in used_pools:
            d.add("AF322", pool.loc, pool=pool.name)
    if not any(rules_of(t.kind).trains for t in p.tasks.values()):
        d.add("AF363", p.locs.get("tasks", p.loc))
    _trainers(p, trainers, LOSSES, d)


def _trainers(p: ast.Pipeline, trainers: dict, losses: dict, d: Diagnostics) -> None:
    critics = {t.model for t in p.tasks.values() if rules_of(t.kind).critic}
    for model, ts in trainers.items():
        if p.models[model].frozen:
            for t in ts:
                d.add("AF314", _at(t, "model"), "remove `frozen: true`, or train another model",
                      task=t.name, model=model)
        for t in ts[1:]:
            d.add("AF315", _at(t, "model"), model=model, first=ts[0].name, second=t.name)
        for t in ts:
            info = losses.get(t.loss)
            if info is None:
                continue
            if info.critic and model not in critics:
                d.add("AF333", _at(t, "loss"), task=t.name, loss=t.loss, model=model,
                      problem="but no value task uses that model (this loss trains a critic)")
            elif not info.critic and model in critics:
                d.add("AF333", _at(t, "loss"), task=t.name, loss=t.loss, model=model,
                      problem="which a value task uses as its critic: train a critic with loss 'value'")


# -- 5. weight sync -------------------------------------------------------------------------------
def _sync(p: ast.Pipeline, d: Diagnostics) -> None:
    seen: set[tuple[str, str]] = set()
    synced: set[tuple[str, str]] = set()  # (trainer, task) pairs with a sync edge
    for s in p.sync:
        ok = True
        for key, name in (("src", s.src), ("dst", s.dst)):
            if name not in p.tasks:
                d.add("AF350", _at(s, key), did_you_mean(name, p.tasks), name=name)
                ok = False
        if not ok:
            continue
        if (s.src, s.dst) in seen:
            d.add("AF353", s.loc, src=s.src, dst=s.dst)
            continue
        seen.add((s.src, s.dst))
        src, dst = p.tasks[s.src], p.tasks[s.dst]
        if not rules_of(src.kind).trains:
            d.add("AF351", _at(s, "src"), task=src.name, kind=src.kind)
            continue
        synced.add((src.name, dst.name))
        dmodel = p.models.get(dst.model) if dst.model else None
        if dst.name == src.name:
            d.add("AF352", _at(s, "dst"), dst=dst.name,
                  problem="a train task already holds the weights it updates")
        elif dst.model is None:
            d.add("AF352", _at(s, "dst"), dst=dst.name, problem=f"it is of kind {dst.kind} and runs no model")
        elif dmodel is not None and dmodel.frozen:
            d.add("AF355", _at(s, "dst"), dst=dst.name, model=dst.model)
        elif dst.model != src.model:
            d.add("AF352", _at(s, "dst"), dst=dst.name,
                  problem=f"it uses model '{dst.model}', not '{src.model}' that '{src.name}' trains")
    trainer = {}
    for t in p.tasks.values():
        if rules_of(t.kind).trains and t.model in p.models and not p.models[t.model].frozen:
            trainer.setdefault(t.model, t.name)
    # (trainer's model, receiving task) pairs that a sync edge connects: one pass, not one per task
    synced_models = {(p.tasks[a].model, b) for a, b in synced
                     if a in p.tasks and rules_of(p.tasks[a].kind).trains}
    for t in p.tasks.values():
        tr = trainer.get(t.model)
        if tr is None or rules_of(t.kind).trains or "model" not in KEYS[t.kind][0]:
            continue
        if (t.model, t.name) not in synced_models:
            d.add("AF354", _at(t, "model"),
                  f"add `- {{from: {tr}, to: {t.name}, max_staleness: 0}}` under sync: "
                  "(0 = on-policy; 1 or more lets it run ahead)",
                  task=t.name, model=t.model, trainer=tr)


def _unsplittable(p: ast.Pipeline) -> str | None:
    """Why a data-parallel trainer's steps cannot be split between its replicas in advance
    (lower rule 8), if they cannot: a step's rows are chosen as they become ready."""
    return next((why for u in p.tasks.values() if (why := rules_of(u.kind).unsplittable(u))),
                None)


# -- 7. scheduling keys ---------------------------------------------------------------------------
def _scheduling(p: ast.Pipeline, d: Diagnostics) -> None:
    """What a scheduling key written in the source does here: the ones that can do nothing are
    warned about (AF380-AF383), and so is a first_ready buffer the rollout's ``on_update:
    finish`` defeats (AF329). Keys on a kind that does not take them are rule 3's AF326."""
    trained = trained_models(p)
    synced = {s.dst for s in p.sync if s.src in p.tasks and rules_of(p.tasks[s.src].kind).trains}
    alpha: dict[str, int] = {}  # train task -> the largest max_staleness of its sync edges
    for s in p.sync:
        alpha[s.src] = max(alpha.get(s.src, 0), s.max_staleness)
    facts = SyncFacts(frozenset(trained), frozenset(synced), alpha, p.step.samples_per_step,
                      first_ready_feeds(p),
                      frozenset(t for t in p.tasks if launches_ahead(p, t, trained)))
    for t in p.tasks.values():
        rules_of(t.kind).check_scheduling(t, facts, d)


__all__ = ["validate"]


# -- 8. evaluation -------------------------------------------------------------------------------
def _eval(p: ast.Pipeline, d: Diagnostics) -> None:
    """The ``eval:`` section (:mod:`asyncflow.compiler.passes.evalplan`, rules 1-5)."""
    from asyncflow.compiler.passes.evalplan import resolve

    e = p.eval
    if e is None:
        return
    if e.data not in p.data:
        d.add("AF384", _at(e, "data"), did_you_mean(e.data, p.data), source=e.data,
              known=", ".join(p.data) or "none")
    for code, key, fmt in resolve(p).problems:
        d.add(code, _at(e, key) if key else e.loc, **fmt)
    if e.fn is not None:
        check_ref(p, e.fn, "fn", _at(e, "fn"), d)
    if e.every is not None and e.every > p.step.steps:
        d.add("AF388", _at(e, "every"), every=e.every, steps=p.step.steps)
    if e.greedy and e.temperature is not None:
        d.add("AF389", _at(e, "temperature"), key="temperature",
              why="say `greedy: false` to sample at this temperature")
    if e.greedy and e.samples_per_prompt > 1:
        d.add("AF389", _at(e, "samples_per_prompt"), key="samples_per_prompt",
              why="every greedy sample of a prompt is the same; say `greedy: false`")
