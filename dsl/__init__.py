"""asyncflow.dsl: source text (YAML or the .af text DSL) -> AST.

Both front ends first build a *located tree* (:mod:`asyncflow.dsl.tree`: maps, lists and
scalars, each with a :class:`SourceLoc`); one schema-driven builder
(:mod:`asyncflow.dsl.build`) then turns that tree into the typed AST
(:mod:`asyncflow.dsl.ast`). Command-line ``--set`` overrides edit the located tree, so an error
in an override points at the override.
"""
from asyncflow.dsl.loc import SourceLoc


def __getattr__(name):  # lazy: asyncflow.diagnostics imports asyncflow.dsl.loc
    if name in ("load_file", "load_text", "parse_tree"):
        from asyncflow.dsl import load

        return getattr(load, name)
    raise AttributeError(name)


__all__ = ["SourceLoc", "load_file", "load_text", "parse_tree"]
