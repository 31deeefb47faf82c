"""The located tree: what both front ends produce and ``--set`` edits.

A tree is made of three node kinds, each carrying the :class:`SourceLoc` of its value:

=========  ==========================================================================
node       meaning
=========  ==========================================================================
Scalar     a str, int, float, bool or None value
Seq        an ordered list of nodes
Map        ordered ``key -> (key location, node)`` entries; keys are strings
=========  ==========================================================================
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from asyncflow.dsl.loc import SourceLoc


@dataclass
class Scalar:
    value: Any
    loc: SourceLoc


@dataclass
class Seq:
    items: list["Node"]
    loc: SourceLoc
    flow: bool = False  # written inline ([a, b]) in the source


@dataclass
class Entry:
    key_loc: SourceLoc
    value: "Node"


@dataclass
class Map:
    entries: dict[str, Entry]
    loc: SourceLoc
    flow: bool = False  # written inline ({a: 1}) in the source

    def get(self, key: str) -> "Node | None":
        e = self.entries.get(key)
        return e.value if e else None


Node = Union[Scalar, Seq, Map]


def plain(node: Node) -> Any:
    """The tree as plain Python data (dicts, lists, scalars), without locations."""
    if isinstance(node, Scalar):
        return node.value
    if isinstance(node, Seq):
        return [plain(n) for n in node.items]
    return {k: plain(e.value) for k, e in node.entries.items()}


def from_plain(value: Any, loc: SourceLoc) -> Node:
    """Plain Python data as a tree whose every node sits at ``loc``."""
    if isinstance(value, dict):
        return Map({str(k): Entry(loc, from_plain(v, loc)) for k, v in value.items()}, loc, flow=True)
    if isinstance(value, (list, tuple)):
        return Seq([from_plain(v, loc) for v in value], loc, flow=True)
    return Scalar(value, loc)


def type_name(node: Node) -> str:
    if isinstance(node, Map):
        return "a mapping"
    if isinstance(node, Seq):
        return "a list"
    v = node.value
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    return "a string"


__all__ = ["Scalar", "Seq", "Map", "Entry", "Node", "plain", "from_plain", "type_name", "field"]
