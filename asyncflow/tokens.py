"""Text that remembers its tokens: what a rollout writes into a ``response`` column."""
from __future__ import annotations


class Text(str):
    """A ``str`` (reward functions read it as text) carrying ``ids`` (the response's token ids)
    and ``prompt_ids`` (the prompt's), so scorers and trainers never re-tokenize."""

    __slots__ = ("ids", "prompt_ids")

    def __new__(cls, text: str, ids=(), prompt_ids=()):
        obj = super().__new__(cls, text)
        obj.ids = tuple(ids)
        obj.prompt_ids = tuple(prompt_ids)
        return obj

    def __reduce__(self):
        return (Text, (str(self), self.ids, self.prompt_ids))
