""".af text DSL source -> located tree (the same shape the YAML front end gives).

The grammar is ``asyncflow.lark`` (LALR(1), contextual lexer); the reference is ``README.md``.
One :class:`ToTree` method per grammar rule turns Lark's parse tree into the located tree of
:mod:`asyncflow.dsl.tree`; every node keeps the ``line:col`` span Lark gives its tokens. Syntax
errors become coded diagnostics (AF110-AF121, see :mod:`asyncflow.diagnostics.syntax`); no input
makes :func:`parse_af` raise.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from lark import Lark, Token, Transformer, UnexpectedCharacters, UnexpectedInput, UnexpectedToken
from lark import v_args

from asyncflow.diagnostics import Diagnostics, did_you_mean
from asyncflow.dsl.loc import SourceLoc
from asyncflow.dsl.tree import Entry, Map, Node, Scalar, Seq

# statements and the YAML section each one fills
STATEMENTS = ("pipeline", "seed", "model", "data", "pool", "step", "task", "sync", "eval")
SECTION = {"model": "models", "data": "data", "pool": "pools", "task": "tasks"}
TOP_ORDER = ("pipeline", "description", "seed", "models", "data", "pools", "step", "tasks", "eval",
             "sync")
# how each statement is written, for the hint of a malformed one
FORMS = {
    "pipeline": 'pipeline NAME "description"',
    "seed": "seed 0",
    "model": "model NAME = module:factory(key=value, ...) [frozen] { key=value ... }"
             '  or  model NAME = "path/or/org-name" [frozen] { key=value ... }'
             "  or  model NAME = copy(OTHER) [frozen]",
    "data": "data NAME = module:factory(key=value, ...) -> field, field { key=value ... }",
    "pool": "pool NAME(devices=N) { key=value ... }",
    "step": "step prompts_per_step=N samples_per_prompt=N steps=N",
    "task": "task NAME: KIND(input, ...) -> output, ... { key=value ... }",
    "sync": "sync FROM -> TO max_staleness=N",
    "eval": "eval { data=SOURCE every=N key=value ... }",
}
MAX_DEPTH = 64  # nesting of [ ( { beyond this is refused (AF120) before parsing

_OPEN = {"(": ")", "[": "]", "{": "}"}
_CLOSE = {v: k for k, v in _OPEN.items()}
_INT_RE = re.compile(r"^[+-]?\d+(_\d+)*$")
_PUNCT = {"EQUAL": "=", "COLON": ":", "COMMA": ",", "LPAR": "(", "RPAR": ")", "LSQB": "[",
          "RSQB": "]", "LBRACE": "{", "RBRACE": "}", "ARROW": "->"}
_STMT_TYPES = {s.upper() for s in STATEMENTS}

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
            self.d.add("AF115", self.tok(t), what="string", text=_short(t.value),
                       problem=_json_problem(exc))
            return t.value[1:-1]
        if any("\ud800" <= ch <= "\udfff" for ch in s):
            self.d.add("AF115", self.tok(t), what="string", text=_short(t.value),
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
                self.d.add("AF115", self.tok(t), what="number", text=_short(text),
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
        diags.add("AF120", _pos_loc(path, text, scan.too_deep), depth=MAX_DEPTH)
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


# -- syntax errors ---------------------------------------------------------------------------
@dataclass
class BracketScan:
    unclosed: list[tuple[str, int]]  # open brackets left at the end: (char, offset)
    unmatched: dict[int, str]  # offset of a closer -> the opener it needed
    too_deep: int | None  # offset of the first bracket nested deeper than MAX_DEPTH


def scan_brackets(text: str) -> BracketScan:
    """Brackets outside strings and comments: which stay open, which close nothing."""
    stack: list[tuple[str, int]] = []
    unmatched: dict[int, str] = {}
    too_deep = None
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        if ch == '"':
            i += 1
            while i < n and text[i] not in '"\n':
                i += 2 if text[i] == "\\" and i + 1 < n and text[i + 1] != "\n" else 1
        elif ch in _OPEN:
            stack.append((ch, i))
            if len(stack) > MAX_DEPTH and too_deep is None:
                too_deep = i
        elif ch in _CLOSE:
            if stack and stack[-1][0] == _CLOSE[ch]:
                stack.pop()
            else:
                unmatched[i] = _CLOSE[ch]
                if stack and any(o == _CLOSE[ch] for o, _ in stack):
                    stack.pop()  # a closer of the wrong kind: the inner opener is the culprit
        i += 1
    return BracketScan(stack, unmatched, too_deep)


def report(exc: UnexpectedInput, text: str, path: str, scan: BracketScan, d: Diagnostics) -> None:
    """One coded diagnostic for Lark's first syntax error."""
    stmt = _current_statement(exc)
    hint = f"write it as: {FORMS[stmt]}" if stmt else None
    if isinstance(exc, UnexpectedCharacters):
        loc = _pos_loc(path, text, exc.pos_in_stream, 1)
        ch = exc.char
        if ch == '"':
            d.add("AF114", _pos_loc(path, text, exc.pos_in_stream, _line_len(text, exc.pos_in_stream)))
            return
        char_hint = {"'": 'strings are written in double quotes: "text"',
                     ":": "use '=' between a key and its value: key=value"}.get(ch, hint)
        char_hint = _unquoted_path_hint(stmt, text, exc.pos_in_stream) or char_hint
        d.add("AF110", loc, char_hint, char=_show_char(ch))
        return
    if not isinstance(exc, UnexpectedToken):  # UnexpectedEOF: Earley only, kept for safety
        d.add("AF111", SourceLoc(path, 1, 1), got="the end of the file", expected="more text")
        return
    tok: Token = exc.token
    accepts = set(exc.accepts or exc.expected or ())
    expected = describe_expected(accepts)
    if tok.type == "$END":
        if scan.unclosed:
            ch, off = scan.unclosed[-1]
            d.add("AF112", _pos_loc(path, text, off, 1), open=ch, close=_OPEN[ch])
            return
        last = _last_token(exc)
        loc = _tok_loc(path, last) if last is not None else SourceLoc(path, 1, 1)
        d.add("AF121", loc, hint, after=_show_tok(last) if last is not None else "the start",
              expected=expected)
        return
    loc = _tok_loc(path, tok)
    if tok.type in ("RPAR", "RSQB", "RBRACE") and tok.start_pos in scan.unmatched:
        d.add("AF113", loc, close=tok.value, open=scan.unmatched[tok.start_pos])
        return
    if tok.type == "COLON" and "EQUAL" in accepts:
        d.add("AF117", loc)
        return
    if accepts & _STMT_TYPES and tok.type in ("WORD", "REF", "STRING", "NUMBER"):
        word = tok.value
        sugg = did_you_mean(word, STATEMENTS) if tok.type == "WORD" else None
        if sugg is None and stmt in ("model", "data", "pool", "task") and "LBRACE" in accepts:
            sugg = f"the keys of a {stmt} go inside braces: {{ {word}=... }}"
        d.add("AF116", loc, sugg, word=_short(word))
        return
    if accepts >= {"EQUAL", "LBRACE"}:
        last = _last_token(exc)
        d.add("AF118", loc, got=_show_tok(tok), key=_short(last.value) if last is not None else "")
        return
    if accepts >= {"STRING", "NUMBER", "WORD", "LSQB", "LBRACE"}:
        d.add("AF119", loc, got=_show_tok(tok))
        return
    d.add("AF111", loc, hint, got=_show_tok(tok), expected=expected)


def describe_expected(accepts: set[str]) -> str:
    words: list[str] = []
    if accepts & _STMT_TYPES:
        words.append("a statement (" + ", ".join(s for s in STATEMENTS if s.upper() in accepts) + ")")
    if accepts >= {"STRING", "NUMBER", "WORD", "LSQB"}:
        words.append("a value")
    else:
        if "WORD" in accepts:
            words.append("a name")
        if "STRING" in accepts:
            words.append("a string")
        if "NUMBER" in accepts:
            words.append("a number")
    for t in ("COPY", "FROZEN"):
        if t in accepts:
            words.append(f"'{t.lower()}'")
    for t, p in _PUNCT.items():
        if t in accepts:
            words.append(f"'{p}'")
    if "$END" in accepts:
        words.append("the end of the file")
    if not words:
        return "something else"
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


_UNQUOTED = re.compile(r"^(\s*(model|data)\s+\w+\s*=\s*)([^\s\"{}()]+)(.*)$")


def _unquoted_path_hint(stmt: str | None, text: str, offset: int) -> str | None:
    """The quoted form of an unquoted path or hub id after ``model NAME =`` / ``data NAME =``
    (``model actor = ckpt/tiny-chat`` -> ``model actor = "ckpt/tiny-chat"``), or None."""
    if stmt not in ("model", "data"):
        return None
    start = text.rfind("\n", 0, offset) + 1
    end = text.find("\n", offset)
    m = _UNQUOTED.match(text[start:len(text) if end < 0 else end])
    if m is None or ":" in m.group(3):
        return None
    what = "a path or hub id" if stmt == "model" else "a path"
    return (f'{what} is a string, written in double quotes: '
            f'{m.group(1).strip()} "{m.group(3)}"{m.group(4).rstrip()}')


def _current_statement(exc: UnexpectedInput) -> str | None:
    """The statement the error is in: the first keyword token still on the parser's stack."""
    ip = getattr(exc, "interactive_parser", None)
    try:
        stack = ip.parser_state.value_stack if ip is not None else []
    except AttributeError:
        return None
    for v in stack:
        if isinstance(v, Token) and v.type in _STMT_TYPES:
            return v.value
    return None


def _last_token(exc: UnexpectedInput) -> Token | None:
    ip = getattr(exc, "interactive_parser", None)
    try:
        stack = ip.parser_state.value_stack if ip is not None else []
    except AttributeError:
        return None
    for v in reversed(stack):
        while not isinstance(v, Token):
            kids = [k for k in getattr(v, "children", ()) if k is not None]
            if not kids:
                break
            v = kids[-1]
        if isinstance(v, Token):
            return v
    return None


def _tok_loc(path: str, t: Token) -> SourceLoc:
    line, col = getattr(t, "line", None) or 1, getattr(t, "column", None) or 1
    end_line, end_col = getattr(t, "end_line", None) or line, getattr(t, "end_column", None) or col + 1
    return SourceLoc(path, line, col, end_line, end_col)


def _pos_loc(path: str, text: str, offset: int, width: int = 1) -> SourceLoc:
    line = text.count("\n", 0, offset) + 1
    col = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return SourceLoc(path, line, col, line, col + max(1, width))


def _line_len(text: str, offset: int) -> int:
    j = text.find("\n", offset)
    return (len(text) if j < 0 else j) - offset


def _show_tok(t: Token | None) -> str:
    if t is None or t.type == "$END":
        return "the end of the file"
    if t.type == "STRING":
        return f"the string {_short(t.value)}"
    if t.type == "NUMBER":
        return f"the number {_short(t.value)}"
    if t.type in _PUNCT:
        return f"'{t.value}'"
    return f"'{_short(t.value)}'"


def _show_char(ch: str) -> str:
    return ch if ch.isprintable() and not ch.isspace() else repr(ch)[1:-1] or "?"


def _short(s: str, n: int = 40) -> str:
    s = str(s)
    return s if len(s) <= n else s[: n - 3] + "..."


def _json_problem(exc: ValueError) -> str:
    msg = getattr(exc, "msg", str(exc))
    return {"Invalid \\escape": "unknown escape (use \\\\, \\\", \\n, \\t or \\uXXXX)",
            "Invalid control character at": "a control character must be escaped"}.get(msg, msg)
