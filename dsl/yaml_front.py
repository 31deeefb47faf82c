"""YAML source -> located tree (every map, list and scalar keeps its line:col)."""
from __future__ import annotations

import datetime

import yaml

from asyncflow.diagnostics import Diagnostics
from asyncflow.dsl.loc import SourceLoc
from asyncflow.dsl.tree import Entry, Map, Node, Scalar, Seq


def _loc(path: str, node: yaml.Node) -> SourceLoc:
    s, e = node.start_mark, node.end_mark
    return SourceLoc(path, s.line + 1, s.column + 1, e.line + 1, e.column + 1)


def _mark_loc(path: str, mark) -> SourceLoc:
    return SourceLoc(path, mark.line + 1, mark.column + 1)


def parse_yaml(text: str, path: str, diags: Diagnostics) -> Node | None:
    """Parse ``text``; syntax errors are added to ``diags`` and give ``None``."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        loc = _mark_loc(path, mark) if mark else SourceLoc(path, 1, 1)
        problem = (exc.problem or exc.context or "invalid YAML").strip()
        diags.add("AF101", loc, problem=problem)
        return None
    except yaml.YAMLError as exc:  # reader errors: bad bytes, control characters
        mark = getattr(exc, "position", None)
        diags.add("AF101", SourceLoc(path, 1, 1), problem=str(exc).splitlines()[0][:200])
        return None
    if root is None:
        diags.add("AF102", SourceLoc(path, 1, 1))
        return None
    constructor = yaml.SafeLoader("")
    return _convert(root, path, constructor, diags)


def _convert(node: yaml.Node, path: str, c: yaml.SafeLoader, diags: Diagnostics) -> Node:
    loc = _loc(path, node)
    if isinstance(node, yaml.MappingNode):
        entries: dict[str, Entry] = {}
        for knode, vnode in node.value:
            kloc = _loc(path, knode)
            if not isinstance(knode, yaml.ScalarNode):
                diags.add("AF104", kloc)
                continue
            key = knode.value  # the written text: `on:` stays "on", `1:` stays "1"
            if key == "<<":
                diags.add("AF105", kloc)
                continue
            if key in entries:
                diags.add("AF103", kloc, key=key, first=entries[key].key_loc.line)
                continue
            entries[key] = Entry(kloc, _convert(vnode, path, c, diags))
        return Map(entries, loc, flow=bool(node.flow_style))
    if isinstance(node, yaml.SequenceNode):
        return Seq([_convert(n, path, c, diags) for n in node.value], loc, flow=bool(node.flow_style))
    try:
        value = c.construct_object(node, deep=True)
    except yaml.YAMLError:
        value = node.value
    if isinstance(value, (datetime.date, datetime.datetime)):
        value = node.value
    elif isinstance(value, bytes):
        value = node.value
    elif not isinstance(value, (str, int, float, bool, type(None))):
        value = node.value
    return Scalar(value, loc)
