"""Read a pipeline: source text -> located tree -> ``--set`` overrides -> typed AST."""
from __future__ import annotations

from pathlib import Path

from asyncflow.diagnostics import Diagnostics
from asyncflow.dsl import ast
from asyncflow.dsl.loc import SourceLoc
from asyncflow.dsl.tree import Node

SUFFIXES = (".yaml", ".yml", ".af")
MAX_SOURCE_BYTES = 1 << 20  # a pipeline file (the shipped ones are about 2 KB)


def parse_tree(text: str, path: str, diags: Diagnostics) -> Node | None:
    """The located tree of ``text``; the front end is chosen by ``path``'s suffix. ``text`` is
    added to ``diags.sources`` (diagnostics quote their lines from it)."""
    diags.sources.add(path, text)
    suffix = Path(path).suffix.lower()
    if suffix == ".af":
        from asyncflow.dsl.af_front import parse_af

        return parse_af(text, path, diags)
    if suffix in (".yaml", ".yml", ""):
        from asyncflow.dsl.yaml_front import parse_yaml

        return parse_yaml(text, path, diags)
    diags.add("AF106", SourceLoc(path, 1, 1), suffix=suffix)
    return None


def load_text(text: str, path: str, sets=(), diags: Diagnostics | None = None) -> ast.Pipeline | None:
    """The AST of ``text``; problems go to ``diags`` (raised as one UserError when not given)."""
    from asyncflow.dsl.build import build
    from asyncflow.dsl.overrides import apply

    own = diags is None
    diags = diags if diags is not None else Diagnostics()
    tree = parse_tree(text, path, diags)
    result = None
    if tree is not None:
        apply(tree, list(sets), diags)
        result = build(tree, path, diags)
    if own:
        diags.raise_if_errors()
    return result


def read_source(path: str | Path, diags: Diagnostics) -> str | None:
    p = Path(path)
    try:
        size = p.stat().st_size if p.is_file() else 0
        if size > MAX_SOURCE_BYTES:  # refused before it is read
            diags.add("AF109", SourceLoc(str(path), 1, 1), path=str(path), size=size,
                      limit=MAX_SOURCE_BYTES)  # bytes of a file, characters of an override
            return None
        raw = p.read_bytes()
    except OSError as exc:
        diags.add("AF100", SourceLoc(str(path), 1, 1), path=str(path), reason=exc.strerror or str(exc))
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        diags.add("AF100", SourceLoc(str(path), 1, 1), path=str(path),
                  reason=f"not UTF-8 text (byte {exc.start})")
        return None


def load_file(path: str | Path, sets=(), diags: Diagnostics | None = None) -> ast.Pipeline | None:
    own = diags is None
    diags = diags if diags is not None else Diagnostics()
    text = read_source(path, diags)
    result = load_text(text, str(path), sets, diags) if text is not None else None
    if own:
        diags.raise_if_errors()
    return result
