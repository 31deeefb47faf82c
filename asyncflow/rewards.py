"""Verifiable rewards (pure Python): ``fn(prompt, answer, response) -> float``, one sample per
call. ``response`` is a ``str`` (a :class:`asyncflow.tokens.Text` from a rollout).
"""
from __future__ import annotations

import re
from fractions import Fraction

_LEADING_DIGITS = re.compile(r"\d*")


def digits_match(prompt: str, answer: str, response: str, partial: bool = False) -> float:
    """1.0 when the response, after stripping whitespace, starts with ``answer`` and the answer
    is not merely the prefix of a longer number (``"19"`` and ``"19 ok"`` match ``19``;
    ``"190"`` does not).

    With ``partial`` (off by default) a wrong response still earns shaped credit. With ``lead`` the
    response's leading run of digits: ``0.1`` if it is not empty, plus
    ``0.4 * (characters equal at the same position) / max(len(answer), len(lead))``; at most
    0.5, so always below an exact match, and a too-long number is penalised. (Measured: from
    scratch, GRPO learns the digits task faster *without* it; the shaped credit rewards
    strings of digits, a local optimum.)"""
    answer = str(answer).strip()
    text = str(response).strip()
    if text.startswith(answer):
        rest = text[len(answer):]
        if not (rest[:1].isdigit() and answer[-1:].isdigit()):
            return 1.0
    if not partial or not answer:
        return 0.0
    lead = _LEADING_DIGITS.match(text).group(0)
    if not lead:
        return 0.0
    right = sum(1 for a, b in zip(answer, lead) if a == b)
    return 0.1 + 0.4 * right / max(len(answer), len(lead))


def math_answer_match(prompt: str, answer: str, response: str) -> float:
    """1.0 when the response's final answer equals ``answer`` as a number (or, for non-numbers,
    as text after normalising spaces and case), else 0.0.

    The final answer is, in order: the last ``\\boxed{...}``; the text after the last
    "answer is" / "answer:" / "####"; the last number in the response. Numbers are normalised:
    ``1,000`` = ``1000``, ``$5`` = ``5``, ``0.50`` = ``1/2``, ``50%`` = ``50``."""
    got = extract_answer(str(response))
    if got is None:
        return 0.0
    a, b = _as_number(got), _as_number(str(answer))
    if a is not None and b is not None:
        return 1.0 if a == b else 0.0
    return 1.0 if _norm_text(got) == _norm_text(str(answer)) else 0.0


def extract_answer(text: str) -> str | None:
    """The final answer of a free-form solution (see :func:`math_answer_match`), or None."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    m = None
    for m in re.finditer(r"(?:answer is|answer:|####)\s*(.+)", text, flags=re.IGNORECASE):
        pass
    if m is not None:
        tail = m.group(1).strip()
        num = _NUMBER.search(tail)
        return num.group(0) if num else tail.rstrip(".").strip()
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?(?:/\d+)?%?|-?\$?\.\d+")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None  # unbalanced: no answer


def _as_number(s: str) -> Fraction | None:
    s = s.strip().rstrip(".").replace(",", "").replace("$", "").replace(" ", "")
    s = s.removesuffix("%")
    m = re.fullmatch(r"\\frac\{(-?\d+)\}\{(\d+)\}", s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _norm_text(s: str) -> str:
    return " ".join(s.strip().rstrip(".").lower().split())
