"""Text that remembers its tokens: what a rollout writes into a ``response`` column."""
from __future__ import annotations


class Text(str):
    """A ``str`` (reward functions read it as text) carrying ``ids`` (the response's token ids)
    and ``prompt_ids`` (the prompt's), so scorers and trainers never re-tokenize.

    ``mask`` is one 0/1 per response id: 1 for a token the policy generated (it counts in
    losses, token counts, KL and entropy), 0 for one it only reads (a multi-turn environment's
    observation, see :mod:`asyncflow.engines.multiturn`). Without a mask every token counts;
    ``masked`` says whether a mask with a 0 was given. The ``str`` value never depends on it.

    ``prompt_text`` is the text the model saw before the response (a chat prompt after its chat
    template), set by the rollout engines for logging (``samples.jsonl``); None when unknown."""

    __slots__ = ("ids", "prompt_ids", "_mask", "prompt_text")

    def __new__(cls, text: str, ids=(), prompt_ids=(), mask=None, prompt_text=None):
        obj = super().__new__(cls, text)
        obj.ids = tuple(ids)
        obj.prompt_ids = tuple(prompt_ids)
        obj.prompt_text = None if prompt_text is None else str(prompt_text)
        if mask is not None:
            mask = tuple(int(m) for m in mask)
            if len(mask) != len(obj.ids):
                raise ValueError(f"mask has {len(mask)} entries for {len(obj.ids)} ids")
            if any(m not in (0, 1) for m in mask):
                raise ValueError("mask entries must be 0 or 1")
            if all(mask):
                mask = None  # all ones: the default, stored as None
        obj._mask = mask
        return obj

    @property
    def mask(self) -> tuple[int, ...]:
        """One 0/1 per id (all ones when none was given)."""
        return self._mask if self._mask is not None else (1,) * len(self.ids)

    @property
    def masked(self) -> bool:
        """True when some id has mask 0."""
        return self._mask is not None

    def __reduce__(self):
        return (Text, (str(self), self.ids, self.prompt_ids, self._mask, self.prompt_text))
