""".af syntax errors: Lark's first error on a ``.af`` text as one coded diagnostic (AF110-AF121,
see :mod:`asyncflow.diagnostics.syntax`), located and with a hint, and the scan of its brackets
that finds what stays open or closes nothing (and nesting too deep to parse, AF120).
:mod:`asyncflow.dsl.af_front` parses; this says what went wrong.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from lark import Token, UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from asyncflow.diagnostics import Diagnostics, did_you_mean
from asyncflow.dsl.loc import SourceLoc

STATEMENTS = ("pipeline", "seed", "model", "data", "pool", "step", "task", "sync", "eval")
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
_PUNCT = {"EQUAL": "=", "COLON": ":", "COMMA": ",", "LPAR": "(", "RPAR": ")", "LSQB": "[",
          "RSQB": "]", "LBRACE": "{", "RBRACE": "}", "ARROW": "->"}
_STMT_TYPES = {s.upper() for s in STATEMENTS}


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
        loc = pos_loc(path, text, exc.pos_in_stream, 1)
        ch = exc.char
        if ch == '"':
            d.add("AF114", pos_loc(path, text, exc.pos_in_stream, _line_len(text, exc.pos_in_stream)))
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
            d.add("AF112", pos_loc(path, text, off, 1), open=ch, close=_OPEN[ch])
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
        d.add("AF116", loc, sugg, word=short(word))
        return
    if accepts >= {"EQUAL", "LBRACE"}:
        last = _last_token(exc)
        d.add("AF118", loc, got=_show_tok(tok), key=short(last.value) if last is not None else "")
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


def pos_loc(path: str, text: str, offset: int, width: int = 1) -> SourceLoc:
    """The location of ``width`` characters at ``offset`` of ``text``."""
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
        return f"the string {short(t.value)}"
    if t.type == "NUMBER":
        return f"the number {short(t.value)}"
    if t.type in _PUNCT:
        return f"'{t.value}'"
    return f"'{short(t.value)}'"


def _show_char(ch: str) -> str:
    return ch if ch.isprintable() and not ch.isspace() else repr(ch)[1:-1] or "?"


def short(s: str, n: int = 40) -> str:
    """``s``, cut to ``n`` characters with ``...`` where longer."""
    s = str(s)
    return s if len(s) <= n else s[: n - 3] + "..."
