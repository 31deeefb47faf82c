"""The grader the pipeline's reward task calls, kept beside the pipeline (asyncflow finds it
there, for ``check`` and ``run`` alike).

A reward function receives the task's inputs in the order the pipeline lists them: here the
chat messages exactly as the data file has them, the gold answer, and the completion as text
(special tokens removed)."""
from __future__ import annotations


def grade(messages: list[dict], gold: str, completion: str) -> float:
    """1.0 when the completion starts with the gold number (``"7"``, ``"7."``, ``"7 apples"``;
    not ``"71"``), else 0.0. ``messages`` is the question as asked (unused here: a grader may
    read it, e.g. to check the answer's units)."""
    text = completion.strip()
    if not text.startswith(gold):
        return 0.0
    return 0.0 if text[len(gold):][:1].isdigit() else 1.0
