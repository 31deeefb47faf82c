"""YAML source -> located tree (every map, list and scalar keeps its line:col).

Input is bounded before it can cost anything: nesting deeper than :data:`MAX_DEPTH` (AF107, found
by a bracket scan and a streaming event scan that stop at the first level too deep), and
anchors/aliases that would expand into more than :data:`MAX_NODES` values, or refer to a node
that contains them (AF108), are refused in well under a second. File size is bounded where the
file is read (:mod:`asyncflow.dsl.load`).
"""
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


MAX_DEPTH = 64  # nesting of maps and lists
MAX_NODES = 100_000  # values after expanding aliases (a pipeline has a few hundred)


class TooBig(Exception):
    """The YAML is nested too deep or expands into too many values."""

    def __init__(self, code: str, mark, **fmt):
        super().__init__(code)
        self.code, self.mark, self.fmt = code, mark, fmt


def _flow_depth(text: str) -> int | None:
    """Offset of the first ``[`` / ``{`` nested deeper than MAX_DEPTH (quoted strings and
    comments skipped), or None. Cheap: PyYAML's scanner is slow on deep flow nesting."""
    depth, i, n = 0, 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "'\"":
            j = text.find(ch, i + 1)
            i = n if j < 0 else j + 1
            continue
        if ch == "#" and (i == 0 or text[i - 1] in " \t\n"):
            j = text.find("\n", i)
            i = n if j < 0 else j + 1
            continue
        if ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return i
        elif ch in "]}":
            depth = max(0, depth - 1)
        i += 1
    return None


def check_bounds(text: str) -> None:
    """Raise :class:`TooBig` when ``text`` nests deeper than MAX_DEPTH (streaming: stops at the
    first level too deep). Syntax errors are left to the parser."""
    at = _flow_depth(text)
    if at is not None:
        raise TooBig("AF107", yaml.Mark("", at, text.count("\n", 0, at),
                                        at - text.rfind("\n", 0, at) - 1, None, None), depth=MAX_DEPTH)
    depth = 0
    try:
        for ev in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(ev, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    raise TooBig("AF107", ev.start_mark, depth=MAX_DEPTH)
            elif isinstance(ev, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    except yaml.YAMLError:
        return


def check_aliases(root: yaml.Node, limit: int = MAX_NODES) -> None:
    """Raise :class:`TooBig` when expanding ``root``'s aliases gives more than ``limit`` values or
    a node contains itself. Counts with memoised subtree sizes, so a billion-value bomb costs
    as much as its few lines."""
    size: dict[int, int] = {}
    on_path: set[int] = set()

    def count(node: yaml.Node) -> int:
        k = id(node)
        if k in size:
            return size[k]
        if k in on_path:
            raise TooBig("AF108", node.start_mark, problem="an alias refers to a node that contains it")
        on_path.add(k)
        kids = node.value if isinstance(node, yaml.SequenceNode) else (
            [x for kv in node.value for x in kv] if isinstance(node, yaml.MappingNode) else [])
        total = 1
        for child in kids:
            total += count(child)
            if total > limit:
                raise TooBig("AF108", child.start_mark,
                             problem=f"its aliases expand into more than {limit:,} values")
        on_path.discard(k)
        size[k] = total
        return total

    count(root)


def parse_yaml(text: str, path: str, diags: Diagnostics) -> Node | None:
    """Parse ``text``; syntax errors are added to ``diags`` and give ``None``."""
    try:
        check_bounds(text)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None:
            check_aliases(root)
    except TooBig as exc:
        diags.add(exc.code, _mark_loc(path, exc.mark), **exc.fmt)
        return None
    except RecursionError:  # a last line of defence: the scans above should have said why
        diags.add("AF107", SourceLoc(path, 1, 1), depth=MAX_DEPTH)
        return None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        loc = _mark_loc(path, mark) if mark else SourceLoc(path, 1, 1)
        problem = (exc.problem or exc.context or "invalid YAML").strip()
        diags.add("AF101", loc, problem=problem)
        return None
    except yaml.YAMLError as exc:  # reader errors: bad bytes, control characters
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
