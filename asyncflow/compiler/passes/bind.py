"""bind: every field's role and type from its producer; every consumer's inputs bound by role.

A field's name is the user's label (docs/language.md, "Field names are the user's"). The meaning
comes from :mod:`asyncflow.kinds`. The rules (the tests cite them by number):

0. A name may be anything but one that starts with ``_``: those are the sample store's own
   columns (``_row``, ``_group``, ``_version``), AF376.
1. A data source's fields have role ``data``. A task's outputs take, by position, the roles of
   its signature's outputs (a rollout: response, logprobs, and with ``env`` the episode's
   reward; a logprob task: ``ref_logprobs``, or ``prox_logprobs`` when its model is trained;
   an estimator: advantages, returns); further outputs take ``more_outputs`` (a reward's
   ``info``, a filter's ``keep``, a custom task's ``custom``), else AF375.
2. A task whose inputs go to a user function (reward, filter, custom) binds them by position:
   input i is the function's i-th positional parameter (read from the function's source without
   importing it); a count that cannot fit the parameters is AF374.
3. Any other task binds each slot of its signature, in order, to the inputs whose producer role
   the slot accepts: one input binds; two or more are ambiguous (AF371) unless the slot takes
   ``many``. A rollout's prompt is its first input; the rest are its environment's context.
4. A required slot left empty takes the one remaining ``custom`` input (a user function's
   output has no role of its own); with two or more, AF371.
5. A required slot still empty is AF372 when an input is left over (its type does not fit),
   else AF370 (AF332 for an estimator's values); an input left over with every slot filled is
   AF373.

The result is annotation: node meta ``bind_in`` / ``bind_out`` (lists of ``[field, role]``) and
the graph's ``fields`` table (field -> role, type, producer); the lower pass copies them into the
plan, and the runtime renames columns by them (it never looks a column up by a fixed name).
"""
from __future__ import annotations

from asyncflow import kinds
from asyncflow.compiler.kinds import rules_of
from asyncflow.compiler.passes import annotated_copy, train_tasks_of
from asyncflow.compiler.runner import Context
from asyncflow.ir import Graph
from asyncflow.refs import arity_problem, function_params, search_path



def _at(defn, key: str):
    return defn.locs.get(key, defn.loc)


def _what(field: str, info: dict) -> str:
    return (f"'{field}' ({kinds.describe_type(info['type'])}: the {info['role']} of "
            f"'{info['producer']}')")


def output_roles(defn, trained: bool) -> tuple[list[tuple[str, str]], list[int]]:
    """Rule 1: ``[(field, role)]`` of a task's outputs, and the positions that have no role."""
    sig = kinds.signature(defn.kind, defn.estimator, defn.loss, env=bool(defn.env), trained=trained)
    if sig is None:
        return [], []
    out, extra = [], []
    for i, f in enumerate(defn.outputs):
        role = sig.outputs[i] if i < len(sig.outputs) else sig.more_outputs
        if role is None:
            extra.append(i)
            role = "custom"
        out.append((f, role))
    return out, extra


def bind(graph: Graph, ctx: Context) -> Graph:
    g = annotated_copy(graph)
    p = g.pipeline
    trained = train_tasks_of(g)
    paths = search_path(p.path or ctx.source_file or None)
    fields: dict[str, dict] = {}
    for src in p.data.values():  # rule 1
        for i, f in enumerate(src.fields):
            fields[f] = {"role": "data", "type": "data", "producer": src.name}
            _reserved(f, _at(src, f"fields.{i}"), ctx)
    for t in g.tasks():
        d = t.defn
        outs, extra = output_roles(d, d.model in trained)
        for i in extra:
            sig = kinds.signature(d.kind, d.estimator, d.loss, env=bool(d.env))
            roles = ", ".join(sig.outputs) if sig and sig.outputs else "nothing"
            hint = rules_of(d.kind).outputs_hint(d)
            ctx.diags.add("AF375", _at(d, f"outputs.{i}"), hint, task=d.name, n=len(d.outputs),
                          kind=_kind_name(d), most=len(sig.outputs) if sig else 0, roles=roles)
        for i, (f, role) in enumerate(outs):
            fields[f] = {"role": role, "type": kinds.ROLES[role].type, "producer": d.name}
            _reserved(f, _at(d, f"outputs.{i}"), ctx)
        g.meta(d.name)["bind_out"] = [[f, r] for f, r in outs]
    for t in g.tasks():
        d = t.defn
        sig = kinds.signature(d.kind, d.estimator, d.loss, env=bool(d.env))
        if sig is None:
            continue
        if sig.inputs is None:
            bound = _bind_fn(d, paths, ctx)
        else:
            bound = _bind_slots(d, sig.inputs, fields, ctx)
        g.meta(d.name)["bind_in"] = bound
    g.g.graph = dict(g.g.graph, fields=fields)
    return g


def _reserved(field: str, loc, ctx: Context) -> None:
    """Rule 0: names that start with ``_`` are the store's own columns (``_row``, ...)."""
    if field.startswith("_"):
        ctx.diags.add("AF376", loc, field=field)


def _kind_name(d) -> str:
    return rules_of(d.kind).display_name(d)


def _bind_fn(d, paths: list[str], ctx: Context) -> list[list[str]]:
    """Rule 2: positional, named by the function's parameters where its source says them."""
    params = function_params(d.fn, paths) if d.fn else None
    if params is not None:
        reserved = rules_of(d.kind).fn_keywords
        problem = arity_problem(params, len(d.inputs), list(d.args or {}), reserved)
        if problem:
            ctx.diags.add("AF374", _at(d, "inputs"), "the function is called with the task's "
                          "inputs in the declared order", fn=d.fn, task=d.name, problem=problem)
        names = [n for n in params.positional
                 if n not in (d.args or {}) and n not in reserved]
    else:
        names = []
    return [[f, names[i] if i < len(names) else f"arg{i}"] for i, f in enumerate(d.inputs)]


def _bind_slots(d, slots, fields: dict, ctx: Context) -> list[list[str]]:
    """Rules 3-5."""
    inputs = [f for f in d.inputs if f in fields]
    role = {f: fields[f]["role"] for f in inputs}
    bound: dict[str, str] = {}
    filled: dict[str, list[str]] = {}
    rules = rules_of(d.kind)
    for slot in slots:  # rule 3
        cands = rules.slot_candidates(slot, inputs, role, bound)
        if cands is None:
            cands = [f for f in inputs if f not in bound and role[f] in slot.accepts]
        if slot.many:
            take = cands
        elif len(cands) > 1:
            second = cands[1]
            ctx.diags.add("AF371", _at(d, f"inputs.{d.inputs.index(second)}"),
                          "keep one, or give the other to a task that reads it",
                          a=cands[0], b=second, task=d.name, role=slot.role,
                          type=kinds.describe_type(slot.type))
            take = cands  # reported once: the others are not "unused" too
        else:
            take = cands
        for f in take:
            bound[f] = slot.role
        if take:
            filled[slot.role] = take
    for slot in slots:  # rule 4
        if slot.optional or slot.role in filled:
            continue
        cands = [f for f in inputs if f not in bound and role[f] == "custom"]
        if len(cands) == 1:
            bound[cands[0]] = slot.role
            filled[slot.role] = cands
        elif len(cands) > 1:
            ctx.diags.add("AF371", _at(d, f"inputs.{d.inputs.index(cands[1])}"), None,
                          a=cands[0], b=cands[1], task=d.name, role=slot.role,
                          type=kinds.describe_type(slot.type))
    left = [f for f in inputs if f not in bound]
    missing = [s for s in slots if not s.optional and s.role not in filled]
    reads = ", ".join(s.role + ("?" if s.optional else "") for s in slots if s.role != "keep")
    for s in missing:  # rule 5
        if left:
            f = left.pop(0)
            ctx.diags.add("AF372", _at(d, f"inputs.{d.inputs.index(f)}"),
                          f"it reads: {reads}", field=_what(f, fields[f]), task=d.name,
                          kind=_kind_name(d), role=s.role, type=kinds.describe_type(s.type))
        elif not rules.report_missing(d, s, _producers_hint(s, fields), ctx.diags):
            ctx.diags.add("AF370", _at(d, "inputs"), _producers_hint(s, fields),
                          task=d.name, kind=_kind_name(d), role=s.role,
                          type=kinds.describe_type(s.type))
    for f in left:
        ctx.diags.add("AF373", _at(d, f"inputs.{d.inputs.index(f)}"), f"it reads: {reads}",
                      field=_what(f, fields[f]), task=d.name, kind=_kind_name(d))
    return [[f, bound[f]] for f in d.inputs if f in bound]


def _producers_hint(slot, fields: dict) -> str | None:
    have = [f for f, i in fields.items() if i["role"] in slot.accepts]
    if have:
        return "add " + " or ".join(f"'{f}'" for f in have[:3]) + " to its inputs"
    makers = {"values": "a value task", "ref_logprobs": "a logprob task on a frozen model",
              "prox_logprobs": "a logprob task on the trained model", "returns": "a gae advantage task",
              "advantages": "an advantage task", "reward": "a reward task",
              "logprobs": "the rollout's second output", "response": "a rollout"}
    return f"it comes from {makers[slot.role]}" if slot.role in makers else None


__all__ = ["bind", "output_roles"]
