"""``--set key.path=value`` overrides, applied to the located tree before it is checked.

Each override is its own source (``--set[1]``, ``--set[2]``, ...) so that any diagnostic about the
value it sets -- wrong type, unknown key, bad reference -- points into the override's text.
Values are typed: integers, floats (``3e-5`` too), ``true``/``false``, ``null``, ``[lists]`` and
``{maps}`` in YAML flow syntax; anything else is a string (quote it to force a string).
"""
from __future__ import annotations

import re

import yaml

from asyncflow.diagnostics import Diagnostics, did_you_mean
from asyncflow.dsl.loc import SourceLoc
from asyncflow.dsl.tree import Entry, Map, Node, Seq, from_plain, type_name

NAMED_SECTIONS = ("models", "data", "pools", "tasks")
_INT = re.compile(r"^[-+]?\d+$")
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^[-+]?(inf|nan)$", re.I)


def typed(text: str):
    """The value an override's text stands for."""
    s = text.strip()
    if _INT.match(s):
        return int(s)
    if _FLOAT.match(s):
        return float(s)
    low = s.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none", "~"):
        return None
    if s[:1] in "[{\"'":
        from asyncflow.dsl.yaml_front import check_aliases, check_bounds

        if len(s) > MAX_VALUE_CHARS:
            raise TooLong(len(s))
        check_bounds(s)
        node = yaml.compose(s, Loader=yaml.SafeLoader)
        if node is not None:
            check_aliases(node, MAX_VALUE_NODES)
        return yaml.safe_load(s)
    return s


MAX_VALUE_CHARS = 100_000  # an override's value text
MAX_VALUE_NODES = 10_000  # values in it after expanding aliases


class TooLong(Exception):
    def __init__(self, size: int):
        super().__init__(size)
        self.size = size


def apply(root: Node, sets: list[str] | tuple[str, ...], diags: Diagnostics) -> Node:
    """``root`` with every override applied; bad overrides are reported and skipped. Each
    override's text is added to ``diags.sources`` as ``--set[i]``."""
    for i, text in enumerate(sets, 1):
        src = f"--set[{i}]"
        diags.sources.add(src, text)
        _apply_one(root, text, src, diags)
    return root


def _apply_one(root: Node, text: str, src: str, diags: Diagnostics) -> None:
    whole = SourceLoc(src, 1, 1, 1, len(text) + 1)
    path, eq, raw = text.partition("=")
    if not eq or not path.strip():
        diags.add("AF501", whole, text=text)
        return
    segs = path.split(".")
    if any(not s.strip() for s in segs):
        diags.add("AF501", whole, text=text)
        return
    vcol = len(path) + 2
    vloc = SourceLoc(src, 1, vcol, 1, len(text) + 1)
    from asyncflow.dsl.yaml_front import TooBig

    try:
        value = typed(raw)
    except yaml.YAMLError:
        diags.add("AF505", vloc, value=raw)
        return
    except TooBig as exc:
        at = vcol + len(raw) - len(raw.lstrip()) + (exc.mark.index if exc.mark else 0)
        diags.add(exc.code, SourceLoc(src, 1, at), **exc.fmt)
        return
    except TooLong as exc:
        diags.add("AF109", vloc, path=src, size=exc.size, limit=MAX_VALUE_CHARS)
        return
    except RecursionError:
        diags.add("AF107", vloc, depth=64)
        return
    node: Node = root
    col = 1
    for depth, seg in enumerate(segs):
        sloc = SourceLoc(src, 1, col, 1, col + len(seg))
        last = depth == len(segs) - 1
        prefix = ".".join(segs[:depth]) or "the pipeline"
        if isinstance(node, Seq):
            if not _INT.match(seg):
                diags.add("AF504", sloc, prefix=prefix, seg=seg, got="a list (use an index)")
                return
            idx = int(seg)
            if not 0 <= idx < len(node.items):
                diags.add("AF503", sloc, prefix=prefix, index=idx, size=len(node.items))
                return
            if last:
                node.items[idx] = from_plain(value, vloc)
                return
            node = node.items[idx]
        elif isinstance(node, Map):
            if seg not in node.entries:
                if depth == 1 and segs[0] in NAMED_SECTIONS:
                    diags.add("AF502", sloc, did_you_mean(seg, node.entries), seg=seg, prefix=prefix)
                    return
                if last:
                    node.entries[seg] = Entry(sloc, from_plain(value, vloc))
                    return
                node.entries[seg] = Entry(sloc, Map({}, sloc, flow=True))
            if last:
                node.entries[seg] = Entry(node.entries[seg].key_loc, from_plain(value, vloc))
                return
            node = node.entries[seg].value
        else:
            diags.add("AF504", sloc, prefix=prefix, seg=seg, got=type_name(node))
            return
        col += len(seg) + 1
