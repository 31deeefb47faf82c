"""What a prompt becomes, checked: spelled back through its tokenizer (characters it cannot
encode: AF655 at start-up, AF348 at ``check``) and held to the length the model takes (AF657,
or its last tokens with ``prompt_overflow: left``). :mod:`asyncflow.models` encodes prompts
(:func:`~asyncflow.models.encode_prompt`, :func:`~asyncflow.models.model_prompt`) and calls
these, and :class:`PromptError` and :func:`located` are the errors they raise; torch and
transformers are not imported here."""
from __future__ import annotations

from typing import Any

from asyncflow.modelsrc import SourceError


class PromptError(ValueError):
    """A prompt the model cannot take: ``code`` (AF651, AF652, AF655-AF657) and the message's
    fields."""

    def __init__(self, code: str, **fields: Any):
        self.code, self.fields = code, fields
        super().__init__(f"{code} {fields}")


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def located(spec, e: SourceError | PromptError):
    """A :class:`~asyncflow.errors.TaskError` for an engine's model or prompt error,
    located at the model's ``init`` (AF650, AF651, AF655, AF656, AF658) or the task (AF652,
    AF657)."""
    from types import SimpleNamespace

    from asyncflow.errors import TaskError

    model = getattr(spec, "model", None) or {}
    extra = getattr(spec, "extra", None) or {}
    loc = (model.get("loc") if e.code not in ("AF652", "AF657") else None) \
        or extra.get("task_loc") or ""
    at = SimpleNamespace(name=getattr(spec, "task", "?"), loc=loc)
    return TaskError(e.code, at, model=model.get("name", "?"), **e.fields)


def lost_spans(text: str, back: str) -> list[tuple[str, str]]:
    """``(was, became)`` for each span of ``text`` that ``back`` (its ids spelled back) lost or
    changed; a change of white space only is not a loss (tokenizers normalise spaces), nor is
    Unicode compatibility normalisation (NFKC: a tokenizer that reads "ｱ" as "ア" keeps it)."""
    import difflib
    import unicodedata

    text, back = (unicodedata.normalize("NFKC", x) for x in (text, back))
    ops = difflib.SequenceMatcher(None, text, back, autojunk=False).get_opcodes()
    return [(text[i1:i2], back[j1:j2]) for op, i1, i2, j1, j2 in ops
            if op in ("delete", "replace") and text[i1:i2].strip()]


def round_trip_error(text: str, back: str) -> PromptError | None:
    """AF655 when spelling a prompt's ids back (``back``) loses characters of ``text``."""
    spans = lost_spans(text, back)
    if not spans:
        return None
    chars = sorted({c for was, _ in spans for c in was if not c.isspace()})
    return PromptError("AF655", chars=", ".join(repr(c) for c in chars[:12])
                       + (f" (+{len(chars) - 12} more)" if len(chars) > 12 else ""),
                       text=_show(text), back=_show(back))


def check_round_trip(tokenizer, ids, text: str) -> None:
    """Raise AF655 when ``ids`` (``text`` encoded) do not spell ``text`` back: characters the
    tokenizer cannot encode. A tokenizer without ``spell`` is not checked."""
    spell = getattr(tokenizer, "spell", None)
    if spell is not None:
        e = round_trip_error(text, spell(list(ids)))
        if e is not None:
            raise e


def positions(config) -> int | None:
    """The longest sequence a model's config says it takes (``max_position_embeddings``, or
    GPT-2's ``n_positions``), or None."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def prompt_limit(engine) -> tuple[int | None, str]:
    """The most tokens a prompt of ``engine`` (a rollout) may have, and why: its
    ``max_prompt_tokens`` arg, else the model's positions (``engine.max_positions``) less the
    longest response ``max_new_tokens`` allows (a number, or a distribution's ``max``);
    None when neither is known."""
    args = getattr(engine, "args", None) or {}
    if args.get("max_prompt_tokens"):
        return int(args["max_prompt_tokens"]), "max_prompt_tokens"
    total = getattr(engine, "max_positions", None)
    dist = getattr(engine, "length_dist", None)
    longest = None
    if dist is not None:
        longest = (dist.params.get("value") if dist.dist == "constant"
                   else dist.params.get("max"))
    if not total or longest is None:
        return None, ""
    return max(0, total - int(round(longest))), (
        f"the model's {total} positions less max_new_tokens {int(round(longest))}")


def embedding_rows(model) -> int | None:
    """How many token ids the model's input embedding has rows for, or None."""
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, TypeError, ValueError):
        return None


def fit_prompt(engine, ids: list[int], text: str) -> tuple[list[int], str]:
    """A prompt within :func:`prompt_limit`: as it is; longer, its last tokens with
    ``prompt_overflow: left`` (TRL's truncation; the text is what they spell), else AF657
    located at the task -- not an index error deep in the model's position embeddings, nor
    a response the model generates past its context. A token id the model's embedding has no
    row for (a token added to the tokenizer, the embeddings never resized) is AF658."""
    rows = getattr(engine, "vocab_rows", None)
    top = max(ids, default=-1)
    if rows and top >= rows:  # tokens added to the tokenizer, the embeddings never resized
        spell = getattr(engine.tokenizer, "spell", None)
        raise located(engine.spec, PromptError(
            "AF658", id=top, token=repr(spell([top])) if spell is not None else "?", rows=rows,
            got=_show(text)))
    limit, why = prompt_limit(engine)
    if limit is None or len(ids) <= limit:
        return ids, text
    args = getattr(engine, "args", None) or {}
    if args.get("prompt_overflow") == "left" and limit > 0:
        ids = list(ids[-limit:])
        spell = getattr(engine.tokenizer, "spell", None)
        return ids, spell(ids) if spell is not None else engine.tokenizer.decode(ids)
    raise located(engine.spec, PromptError("AF657", n=len(ids), limit=limit, why=why,
                                           got=_show(text)))
