"""asyncflow.dsl: source text (YAML or the .af text DSL) -> AST.

Both front ends first build a *located tree* (:mod:`asyncflow.dsl.tree`: maps, lists and
scalars, each with a :class:`SourceLoc`); one schema-driven builder
(:mod:`asyncflow.dsl.build`) then turns that tree into the typed AST
(:mod:`asyncflow.dsl.ast`). Command-line ``--set`` overrides edit the located tree, so an error
in an override points at the override.
"""
from asyncflow.dsl.loc import SourceLoc
from asyncflow.dsl.load import load_file, load_text, parse_tree

__all__ = ["SourceLoc", "load_file", "load_text", "parse_tree"]
