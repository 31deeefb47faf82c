""".af text DSL source -> located tree (the same shape the YAML front end gives).

The grammar is ``asyncflow.lark`` (LALR(1), contextual lexer); the reference is ``README.md``.
One :class:`ToTree` method per grammar rule turns Lark's parse tree into the located tree of
:mod:`asyncflow.dsl.tree`; every node keeps the ``line:col`` span Lark gives its tokens. Syntax
errors become coded diagnostics (AF110-AF121, see :mod:`asyncflow.diagnostics.syntax`; made by
:mod:`asyncflow.dsl.af_errors`); no input makes :func:`parse_af` raise.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from lark import Lark, Token, Transformer, UnexpectedInput
from lark import v_args

from asyncflow.diagnostics import Diagnostics
from asyncflow.dsl.af_errors import MAX_DEPTH, pos_loc, report, scan_brackets, short
from asyncflow.dsl.loc import SourceLoc
from asyncflow.dsl.tree import Entry, Map, Node, Scalar, Seq

# the YAML section each statement fills
SECTION = {"model": "models", "data": "data", "pool": "pools", "task": "tasks"}
TOP_ORDER = ("pipeline", "description", "seed", "models", "data", "pools", "step", "tasks", "eval",
             "sync")
_INT_RE = re.compile(r"^[+-]?\d+(_\d+)*$")

_PARSER: Lark | None = None


def parser() -> Lark:
    """The LALR parser, built once from the grammar shipped inside the package."""
    global _PARSER
    if _PARSER is None:
        grammar = resources.files("asyncflow.dsl").joinpath("asyncflow.lark").read_text("utf-8")
        _PARSER = Lark(grammar, parser="lalr", lexer="contextual", propagate_positions=True,
                       maybe_placeholders=False)
    return _PARSER


# -- the transformer -------------------------------------------------------------------------
@dataclass
class Stmt:
    """One statement: its keyword, its name (for named sections) and the keys it sets."""

    kind: str
    kw_loc: SourceLoc
    loc: SourceLoc
    name: str | None = None
    name_loc: SourceLoc | None = None
    body: Map | None = None  # model/data/pool/task/step/sync: the section entry's mapping
    node: Node | None = None  # seed: the value
    description: Scalar | None = None  # pipeline


@dataclass
class Call:
    value: Node
    args: Map | None


@dataclass
class Copy:
    key_loc: SourceLoc
    name: Scalar


@dataclass
class Pair:
    key: str
    key_loc: SourceLoc
    value: Node


class Args(Map):
    """``(k=v, ...)`` after a factory or a pool name."""


class Names(Seq):
    """``a, b`` after ``->``, or ``(a, b)`` after a task's kind."""


@v_args(meta=True)
class ToTree(Transformer):
    """Lark parse tree -> located tree; duplicate keys and bad literals go to ``diags``."""

    def __init__(self, path: str, diags: Diagnostics):
        super().__init__()
        self.path = path
        self.d = diags

    # -- locations ----------------------------------------------------------------------
    def tok(self, t: Token) -> SourceLoc:
        return SourceLoc(self.path, t.line, t.column, t.end_line, t.end_column)

    def span(self, meta) -> SourceLoc:
        if getattr(meta, "empty", True):
            return SourceLoc(self.path, 1, 1)
        return SourceLoc(self.path, meta.line, meta.column, meta.end_line, meta.end_column)

    def put(self, m: Map, key: str, key_loc: SourceLoc, value: Node) -> None:
        """Add ``key`` to ``m``, reporting a duplicate (AF103) at the second one."""
        if key in m.entries:
            self.d.add("AF103", key_loc, key=key, first=m.entries[key].key_loc.line)
            return
        m.entries[key] = Entry(key_loc, value)

    def merge(self, into: Map, other: Map | None) -> None:
        if other is not None:
            for k, e in other.entries.items():
                self.put(into, k, e.key_loc, e.value)

    # -- values -------------------------------------------------------------------------
    def text_of(self, t: Token) -> str:
        """A key or a name: a word, a keyword used as a word, or a quoted string."""
        return self.decode(t) if t.type == "STRING" else str(t)

    def decode(self, t: Token) -> str:
        try:
            s = json.loads(t.value)
        except ValueError as exc:
            self.d.add("AF115", self.tok(t), what="string", text=short(t.value),
                       problem=_json_problem(exc))
            return t.value[1:-1]
        if any("\ud800" <= ch <= "\udfff" for ch in s):
            self.d.add("AF115", self.tok(t), what="string", text=short(t.value),
                       problem="\\ud800-\\udfff are not characters")
            return t.value[1:-1]
        return s

    def string(self, meta, c):
        return Scalar(self.decode(c[0]), self.tok(c[0]))

    def number(self, meta, c):
        t: Token = c[0]
        return Scalar(self.number_value(t), self.tok(t))

    def number_value(self, t: Token) -> Any:
        text = str(t)
        if _INT_RE.match(text):
            try:
                return int(text.replace("_", ""))
            except ValueError:  # more digits than Python converts
                self.d.add("AF115", self.tok(t), what="number", text=short(text),
                           problem="too many digits")
                return 0
        low = text.lower()
        if low.lstrip("+-") in (".inf", ".nan"):
            return float(low.replace(".", ""))
        return float(text.replace("_", ""))

    def true(self, meta, c):
        return Scalar(True, self.tok(c[0]))

    def false(self, meta, c):
        return Scalar(False, self.tok(c[0]))

    def null(self, meta, c):
        return Scalar(None, self.tok(c[0]))

    def bare(self, meta, c):
        return Scalar(str(c[0]), self.tok(c[0]))

    def list(self, meta, c):
        return Seq(list(c), self.span(meta), flow=True)

    def pair(self, meta, c):
        key, value = c
        return Pair(self.text_of(key), self.tok(key), value)

    def map(self, meta, c):
        m = Map({}, self.span(meta), flow=True)
        for p in c:
            self.put(m, p.key, p.key_loc, p.value)
        return m

    def args(self, meta, c):
        m = Args({}, self.span(meta), flow=True)
        for p in c:
            self.put(m, p.key, p.key_loc, p.value)
        return m

    def top_items(self, meta, c):
        return list(c)

    def names(self, meta, c):
        return Names([self.bare(None, [t]) for t in c], self.span(meta), flow=True)

    inputs = names

    def call(self, meta, c):
        return Call(c[0], c[1] if len(c) > 1 else None)

    def copy(self, meta, c):
        return Copy(self.tok(c[0]), self.bare(None, [c[1]]))

    # -- statements ---------------------------------------------------------------------
    def stmt(self, meta, kw: Token, name: Token | None = None) -> Stmt:
        s = Stmt(kw.value, self.tok(kw), self.span(meta))
        if name is not None:
            s.name, s.name_loc = self.text_of(name), self.tok(name)
        s.body = Map({}, s.loc)
        return s

    def pipeline_stmt(self, meta, c):
        s = self.stmt(meta, c[0])
        s.node = self.string(None, [c[1]]) if c[1].type == "STRING" else self.bare(None, [c[1]])
        if len(c) > 2:
            s.description = self.string(None, [c[2]])
        return s

    def seed_stmt(self, meta, c):
        s = self.stmt(meta, c[0])
        s.node = c[1]
        return s

    def model_stmt(self, meta, c):
        s = self.stmt(meta, c[0], c[1])
        for part in c[2:]:
            if isinstance(part, Copy):
                self.put(s.body, "copy_of", part.key_loc, part.name)
            elif isinstance(part, Call):
                self.put(s.body, "init", part.value.loc, part.value)
                if part.args is not None:
                    self.put(s.body, "args", part.args.loc, Map(part.args.entries, part.args.loc, True))
            elif isinstance(part, Token):  # FROZEN
                self.put(s.body, "frozen", self.tok(part), Scalar(True, self.tok(part)))
            else:
                self.merge(s.body, part)
        return s

    def data_stmt(self, meta, c):
        s = self.stmt(meta, c[0], c[1])
        for part in c[2:]:
            if isinstance(part, Call):
                self.put(s.body, "source", part.value.loc, part.value)
                if part.args is not None:
                    self.put(s.body, "args", part.args.loc, Map(part.args.entries, part.args.loc, True))
            elif isinstance(part, Names):
                self.put(s.body, "fields", part.loc, Seq(part.items, part.loc, True))
            elif isinstance(part, Map):
                self.merge(s.body, part)
        return s

    def pool_stmt(self, meta, c):
        s = self.stmt(meta, c[0], c[1])
        for part in c[2:]:
            self.merge(s.body, part)
        return s

    def absorb(self, body: Map, parts) -> None:
        """Fold a statement's settings into its body: ``{ k=v }`` maps and loose ``k=v`` pairs."""
        for part in parts:
            if isinstance(part, Map):
                self.merge(body, part)
            else:
                for p in part:
                    self.put(body, p.key, p.key_loc, p.value)

    def step_stmt(self, meta, c):
        s = self.stmt(meta, c[0])
        self.absorb(s.body, c[1:])
        return s

    def task_stmt(self, meta, c):
        s = self.stmt(meta, c[0], c[1])
        names = [p for p in c[2:] if isinstance(p, Names)]
        kind = [p for p in c[2:] if isinstance(p, Token) and p.type == "WORD"]
        if kind:
            self.put(s.body, "kind", self.tok(kind[0]), self.bare(None, kind))
        for key, n in zip(("inputs", "outputs"), names):
            self.put(s.body, key, n.loc, Seq(n.items, n.loc, True))
        for part in c[2:]:
            if isinstance(part, Map) and not isinstance(part, (Names,)):
                self.merge(s.body, part)
        return s

    def sync_stmt(self, meta, c):
        s = self.stmt(meta, c[0])
        src, dst = c[1], c[3]
        self.put(s.body, "from", self.tok(src), self.bare(None, [src]))
        self.put(s.body, "to", self.tok(dst), self.bare(None, [dst]))
        self.absorb(s.body, c[4:])
        return s

    def eval_stmt(self, meta, c):
        s = self.stmt(meta, c[0])
        self.absorb(s.body, c[1:])
        return s

    def start(self, meta, stmts):
        return stmts


def assemble(stmts: list[Stmt], path: str, diags: Diagnostics) -> Map:
    """The statements as the top-level mapping, keys in the order of docs/language.md."""
    top: dict[str, Entry] = {}

    def put(key: str, key_loc: SourceLoc, value: Node) -> bool:
        if key in top:
            diags.add("AF103", key_loc, key=key, first=top[key].key_loc.line)
            return False
        top[key] = Entry(key_loc, value)
        return True

    for s in stmts:
        if s.kind == "pipeline":
            if put("pipeline", s.kw_loc, s.node) and s.description is not None:
                put("description", s.description.loc, s.description)
        elif s.kind == "seed":
            put("seed", s.kw_loc, s.node)
        elif s.kind in ("step", "eval"):
            put(s.kind, s.kw_loc, s.body)
        elif s.kind == "sync":
            seq = top.setdefault("sync", Entry(s.kw_loc, Seq([], s.loc))).value
            seq.items.append(s.body)
        else:
            section = top.setdefault(SECTION[s.kind], Entry(s.kw_loc, Map({}, s.loc))).value
            if s.name in section.entries:
                diags.add("AF103", s.name_loc, key=s.name,
                          first=section.entries[s.name].key_loc.line)
            else:
                section.entries[s.name] = Entry(s.name_loc, s.body)
    order = {k: i for i, k in enumerate(TOP_ORDER)}
    entries = dict(sorted(top.items(), key=lambda kv: order[kv[0]]))
    return Map(entries, SourceLoc(path, 1, 1))


# -- the entry point ------------------------------------------------------------------------
def parse_af(text: str, path: str, diags: Diagnostics) -> Node | None:
    """Parse ``text``; syntax errors are added to ``diags`` and give ``None``."""
    before = len(diags.errors)
    scan = scan_brackets(text)
    if scan.too_deep is not None:
        diags.add("AF120", pos_loc(path, text, scan.too_deep), depth=MAX_DEPTH)
        return None
    try:
        tree = parser().parse(text)
    except UnexpectedInput as exc:
        report(exc, text, path, scan, diags)
        return None
    stmts = ToTree(path, diags).transform(tree)
    if not stmts:
        diags.add("AF102", SourceLoc(path, 1, 1))
        return None
    root = assemble(stmts, path, diags)
    # bad literals make the file unusable; duplicates were dropped, as in YAML
    if any(d.code in ("AF115",) for d in diags.errors[before:]):
        return None
    return root


def _json_problem(exc: ValueError) -> str:
    msg = getattr(exc, "msg", str(exc))
    return {"Invalid \\escape": "unknown escape (use \\\\, \\\", \\n, \\t or \\uXXXX)",
            "Invalid control character at": "a control character must be escaped"}.get(msg, msg)
