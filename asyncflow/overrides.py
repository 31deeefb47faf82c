"""``--set key.path=value`` overrides: :mod:`asyncflow.dsl.overrides` (they edit the located
tree, so they live with the front ends), re-exported under their old name."""
from asyncflow.dsl.overrides import NAMED_SECTIONS, apply, typed

__all__ = ["NAMED_SECTIONS", "apply", "typed"]
