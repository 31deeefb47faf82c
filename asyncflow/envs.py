"""Text environments for multi-turn (agentic) rollouts (pure Python).

An environment factory (``module:factory``) returns a fresh environment per sample:

- ``reset(prompt, *context) -> str``: start an episode; called with the rollout task's inputs in
  their declared order (the prompt first); returns the first observation;
- ``step(action) -> (observation, reward, done)``: the agent's text for this turn; the next
  observation is appended to the dialogue when not ``done``.

The episode's return is the sum of its step rewards. Environments are deterministic: any
randomness is seeded from the row itself (never from Python's salted ``hash``).

A rollout task names the factory as ``env:``; the factory is called with those of the task's
``args`` it accepts as keywords (``max_turns``, ``max_operand``, ``stop_on_error`` here; the
engine's own args such as ``max_new_tokens`` are left out). :mod:`asyncflow.engines.multiturn`
runs the episodes.
"""
from __future__ import annotations

import random
import zlib

from asyncflow.rewards import digits_match


class DigitsDialogue:
    """A running-sum dialogue over a digits problem (``reset("3+4=", "7")``: prompt, answer).

    Turn 1 asks the row's prompt. Each later turn asks to add one more number to the previous
    *correct* total (``" +5="``), so the agent must use the dialogue history. A right answer
    earns ``1 / max_turns``; a wrong one ends the episode (``stop_on_error``) or is corrected
    in the next observation (``" no, 7. +5="``). The episode ends after ``max_turns`` turns."""

    def __init__(self, max_turns: int = 3, max_operand: int = 9, stop_on_error: bool = True):
        self.max_turns = max_turns
        self.max_operand = max_operand
        self.stop_on_error = stop_on_error
        self.turn = 0
        self.total = 0
        self._rng = random.Random(0)

    def reset(self, prompt: str, answer: str) -> str:
        prompt, answer = str(prompt), str(answer)
        self._rng = random.Random(zlib.crc32(f"{prompt}\x00{answer}".encode()))
        self.turn, self.total = 0, int(answer)
        return prompt

    def step(self, action: str) -> tuple[str, float, bool]:
        if self.turn >= self.max_turns:
            raise RuntimeError("step() after the episode ended; call reset()")
        self.turn += 1
        right = digits_match("", str(self.total), action, partial=False) == 1.0
        reward = 1.0 / self.max_turns if right else 0.0
        if self.turn >= self.max_turns or (not right and self.stop_on_error):
            return "", reward, True
        k = self._rng.randint(0, self.max_operand)
        hint = "" if right else f" no, {self.total}."
        self.total += k
        return f"{hint} +{k}=", reward, False


def digits_dialogue(max_turns: int = 3, max_operand: int = 9,
                    stop_on_error: bool = True) -> DigitsDialogue:
    """A fresh :class:`DigitsDialogue` (the factory a pipeline names)."""
    return DigitsDialogue(max_turns=max_turns, max_operand=max_operand,
                          stop_on_error=stop_on_error)
