"""Models and tokenizers: loading a pipeline's model (where the plan says it comes from, in its
dtype), a tiny Qwen2-style decoder built from a config in code, a character tokenizer, and how a
prompt becomes token ids.

A model factory (the ``init: module:factory`` of a pipeline's ``models:``) returns a
:class:`Loaded` ``(model, tokenizer)`` pair. The tokenizer protocol every engine relies on:

=====================  ==========================================================================
member                 meaning
=====================  ==========================================================================
``encode(text)``       ``list[int]``, no special tokens added
``decode(ids)``        ``str``, special tokens (pad/bos/eos) dropped
``encode_prompt(p)``   ``(ids, text)``: a prompt value as the model sees it (:func:`encode_prompt`)
``chat_template``      the Jinja chat template, or ``None``
``pad_id``             id used to pad batches (never a real token of a sample)
``bos_id``             the beginning-of-sequence id, or ``None``
``eos_id``             id that ends a response
``stop_ids``           optional: every id that ends a response, ``eos_id`` first (:func:`stop_ids`)
``vocab_size``         number of ids
``save(dir)``          writes files ``transformers.AutoTokenizer.from_pretrained(dir)`` loads
``spell(ids)``         optional: ``str`` the ids spell, special tokens kept (the round trip below)
=====================  ==========================================================================

Prompts (as TRL treats conversational data): a list of ``{role, content}`` messages is rendered
with the tokenizer's chat template and the generation prompt, then encoded without adding
special tokens again (the template writes its own BOS: never a doubled one); any other value is
a string used as is, encoded with the tokenizer's own special-token rules (the character
tokenizer prepends ``<bos>``). Responses end at ``eos`` and are decoded without special tokens.
A chat prompt for a tokenizer without a template is AF651, one its template refuses (its
``raise_exception``: "System role not supported") AF656. A prompt whose characters the
tokenizer cannot encode (a byte-level BPE trained without the full byte alphabet, a vocabulary
without ``[``) is AF655: :func:`asyncflow.prompts.check_round_trip` spells the ids back and
names what was lost, where the silent alternative is a model that reads ``use`` for ``[user]``.

Loading is serialized process-wide (:data:`LOAD_LOCK`): colocated workers of one process build
or read models at once, and transformers' lazy imports and torch's seeded draws must not
interleave (they did: ``ImportError: cannot import name 'AutoModelForCausalLM'``).

torch and transformers are imported inside functions only: ``asyncflow check`` resolves
``asyncflow.models:tiny_decoder`` without importing torch.
"""
from __future__ import annotations

import json
import os
import string
import threading
from typing import Any, NamedTuple, Sequence

from asyncflow.modelsrc import DEFAULT_DTYPE, DTYPES, Source, SourceError, is_chat
from asyncflow.prompts import PromptError, _show, check_round_trip, fit_prompt, located
from asyncflow.tokens import Text

TOKENIZER_FILE = "asyncflow_tokenizer.json"

#: one model or tokenizer load at a time per process, whatever the path (factory, directory, hub)
LOAD_LOCK = threading.RLock()


class Loaded(NamedTuple):
    """What a model factory returns; unpacks as ``model, tokenizer = tiny_decoder()``."""

    model: Any  # a transformers causal LM (torch.nn.Module), on CPU, in the plan's dtype
    tokenizer: Any  # follows the tokenizer protocol in the module docstring


def encode_prompt(tokenizer, prompt) -> tuple[list[int], str]:
    """``(ids, text)`` of a prompt value: the ids the model reads and the text they spell (after
    the chat template). Uses the tokenizer's own ``encode_prompt`` when it has one; a plug-in
    tokenizer with only ``encode`` gets ``[bos] + encode(text)`` and no chat."""
    own = getattr(tokenizer, "encode_prompt", None)
    if own is not None:
        return own(prompt)
    if is_chat(prompt):
        raise PromptError("AF651", tokenizer=type(tokenizer).__name__)
    text = str(prompt)
    bos = getattr(tokenizer, "bos_id", None)
    return ([bos] if bos is not None else []) + list(tokenizer.encode(text)), text


def _check_prompt(prompt) -> None:
    """A prompt is a string or a chat; a list that is not a chat (a message without role or
    content) is AF652, not its Python repr tokenized."""
    if isinstance(prompt, (list, tuple, dict)) and not is_chat(prompt):
        raise PromptError("AF652", got=_show(prompt))


def _byte_chars() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (printable Latin-1 bytes are themselves;
    the others, space and newline among them, map to chr(256 + n) in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    out, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


_BYTE_CHAR = _byte_chars()


class CharTokenizer:
    """One id per character. Ids 0..3 are ``<pad> <bos> <eos> <unk>``; then digits, the
    operators ``+-*/=%^``, lower- and upper-case ASCII letters, space, newline and some
    punctuation. Unknown characters encode to ``unk_id`` (and decode to ``?``).

    The vocabulary is fixed, so ``CharTokenizer.VOCAB_SIZE`` is known without an instance. It has
    no chat template. :meth:`save` writes it as a transformers tokenizer (a word-level model over
    single characters) that gives the same ids."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
    CHARS = (string.digits + "+-*/=%^" + string.ascii_lowercase + string.ascii_uppercase
             + " \n.,:;?!'\"()[]{}<>_#$&|\\~`@")
    VOCAB_SIZE = len(SPECIALS) + len(CHARS)

    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3
    stop_ids = (2,)
    chat_template = None

    def __init__(self):
        self.vocab_size = self.VOCAB_SIZE
        self._to_id = {c: i + len(self.SPECIALS) for i, c in enumerate(self.CHARS)}
        self._to_char = {i: c for c, i in self._to_id.items()}

    def encode(self, text: str) -> list[int]:
        return [self._to_id.get(c, self.unk_id) for c in text]

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.unk_id:
                out.append("?")
            elif i >= len(self.SPECIALS):
                out.append(self._to_char[i])
        return "".join(out)

    spell = decode  # an unknown character spells "?": the round trip finds it

    def encode_prompt(self, prompt) -> tuple[list[int], str]:
        _check_prompt(prompt)
        if is_chat(prompt):
            raise PromptError("AF651", tokenizer="the character tokenizer (CharTokenizer)")
        text = str(prompt)
        return [self.bos_id] + self.encode(text), text

    def to_transformers(self):
        """This tokenizer as a ``transformers.PreTrainedTokenizerFast`` giving the same ids:
        ``encode(text, add_special_tokens=False) == self.encode(text)``, and with special tokens
        ``<bos>`` first, as :meth:`encode_prompt` does."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        # a byte-level BPE without merges: one token per character (every CHARS entry is one
        # ASCII byte). Byte-level, because transformers' AutoTokenizer rebuilds the tokenizer of
        # a Qwen2 checkpoint as a byte-level BPE from the saved vocabulary: it then gives these ids
        vocab = {s: i for i, s in enumerate(self.SPECIALS)}
        vocab.update({_BYTE_CHAR[ord(c)]: i for c, i in self._to_id.items()})
        tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", self.bos_id)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                       eos_token="<eos>", unk_token="<unk>",
                                       clean_up_tokenization_spaces=False)

    def save(self, directory: str) -> None:
        """A transformers tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ...) and the
        ``asyncflow_tokenizer.json`` marker :func:`from_directory` reads back as this class."""
        os.makedirs(directory, exist_ok=True)
        with LOAD_LOCK:
            self.to_transformers().save_pretrained(directory)
        with open(os.path.join(directory, TOKENIZER_FILE), "w") as f:
            json.dump({"class": "CharTokenizer", "chars": self.CHARS}, f)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


class HFTokenizer:
    """Adapts a ``transformers`` tokenizer to the tokenizer protocol."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_id = tok.eos_token_id
        self.stop_ids = (self.eos_id,)  # and the model's own end ids (with_stops)
        self.bos_id = tok.bos_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.vocab_size = len(tok)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tok, "chat_template", None) or None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def spell(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False,
                               clean_up_tokenization_spaces=False)

    def encode_prompt(self, prompt) -> tuple[list[int], str]:
        _check_prompt(prompt)
        if is_chat(prompt):
            if not self.chat_template:
                raise PromptError("AF651", tokenizer=f"{type(self.tok).__name__} "
                                  f"({getattr(self.tok, 'name_or_path', '') or 'no path'})")
            from jinja2 import TemplateError

            try:
                text = self.tok.apply_chat_template([dict(m) for m in prompt], tokenize=False,
                                                    add_generation_prompt=True)
            except TemplateError as e:  # the template's raise_exception, or its own bug
                raise PromptError("AF656", reason=f"{type(e).__name__}: {e}",
                                  got=_show(prompt)) from None
            return list(self.tok.encode(text, add_special_tokens=False)), text
        text = str(prompt)
        return list(self.tok.encode(text, add_special_tokens=True)), text

    def save(self, directory: str) -> None:
        self.tok.save_pretrained(directory)


def torch_dtype(name: str | None):
    """The torch dtype of a ``dtype:`` key's value (None: float32)."""
    import torch

    name = name or DEFAULT_DTYPE
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def tiny_decoder(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int | None = None,
                 max_len: int = 128, seed: int = 0, intermediate: int | None = None,
                 kv_heads: int | None = None, attn: str = "sdpa", **kw) -> Loaded:
    """A randomly initialised Qwen2-style decoder (fp32, CPU) and a :class:`CharTokenizer`.

    ``layers``/``hidden``/``heads`` size it; ``intermediate`` is the MLP width (default
    ``4 * hidden``); ``vocab`` defaults to the tokenizer's size; ``max_len`` is the longest
    prompt + response; ``seed`` makes the initial weights reproducible (the global torch RNG is
    left untouched). Extra ``kw`` go to ``Qwen2Config``. Embeddings are tied.
    layers=2, hidden=128 has about 0.55M parameters.

    Thread-safe (:data:`LOAD_LOCK`): both transformers' lazy imports and the seeded draws from
    torch's process-wide generator must not interleave."""
    with LOAD_LOCK:
        return _tiny_decoder(layers, hidden, heads, vocab, max_len, seed, intermediate, kv_heads,
                             attn, **kw)


def _tiny_decoder(layers, hidden, heads, vocab, max_len, seed, intermediate, kv_heads, attn,
                  **kw) -> Loaded:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = CharTokenizer()
    config = Qwen2Config(
        vocab_size=vocab or tok.vocab_size, hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_len, tie_word_embeddings=True,
        pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, **kw)
    config._attn_implementation = attn
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).float()
    model.eval()
    return Loaded(model, tok)


def from_directory(path: str, dtype: str | None = None, trust_remote_code: bool = False) -> Loaded:
    """A local HF directory (``config.json`` + weights) in ``dtype`` (default float32): never
    downloads. Its tokenizer is a :class:`CharTokenizer` where ``asyncflow_tokenizer.json`` is
    present, else the directory's own ``transformers`` tokenizer. ``trust_remote_code``: run
    the code the directory ships (its ``auto_map``), for the model and the tokenizer."""
    with LOAD_LOCK:
        import torch  # noqa: F401  (imported under the lock: transformers imports it)
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        # a worker's log is not a terminal: transformers' "Loading weights" bar would be one
        # line per load in every run's output (the run's own progress bar says what happens)
        hf_logging.disable_progress_bar()
        trust = {"trust_remote_code": True} if trust_remote_code else {}
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                     dtype=torch_dtype(dtype), **trust)
        model.eval()
        if os.path.exists(os.path.join(path, TOKENIZER_FILE)):
            tok = CharTokenizer()
        else:
            tok = HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True, **trust))
    return Loaded(model, tok)


def _factory(ref: str, args: dict | None, paths: Sequence[str]) -> Loaded:
    from asyncflow.refs import resolve

    with LOAD_LOCK:
        factory = resolve(ref, paths)
        out = factory(**dict(args or {}))
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError(f"model factory {ref!r} must return a (model, tokenizer) pair")
    return Loaded(*out)


def _in_dtype(loaded: Loaded, dtype: str | None) -> Loaded:
    if dtype and dtype != DEFAULT_DTYPE:
        with LOAD_LOCK:
            loaded.model.to(dtype=torch_dtype(dtype))
    return loaded


def load_source(src: Source, args: dict | None = None, paths: Sequence[str] = (),
                dtype: str | None = None, trust_remote_code: bool = False) -> Loaded:
    """The model a resolved source names (:mod:`asyncflow.modelsrc`), in ``dtype``, its
    tokenizer told the model's end ids (:func:`with_stops`)."""
    if src.kind == "factory":
        return with_stops(_in_dtype(_factory(src.ref, args, paths), dtype))
    from asyncflow.modelsrc import fetch

    return with_stops(from_directory(fetch(src), dtype, trust_remote_code))


def stop_ids(tokenizer) -> tuple[int, ...]:
    """The ids that end a response: the tokenizer's ``stop_ids``, else its ``eos_id``."""
    return tuple(getattr(tokenizer, "stop_ids", None) or (tokenizer.eos_id,))


def with_stops(loaded: Loaded) -> Loaded:
    """The tokenizer's ``stop_ids``: its ``eos_id`` and the ids the model's generation config
    ends on (``generation_config.json``'s ``eos_token_id``, one or a list). A chat model often
    ends a turn with a token that is not its tokenizer's EOS (Qwen2.5's ``<|im_end|>`` where
    the base tokenizer's is ``<|endoftext|>``, Llama 3's ``<|eot_id|>``); vLLM stops on them
    by default, and so do the engines here: a response ends at the first, which it keeps in
    its ids and leaves out of its text. A tokenizer that cannot take the attribute keeps
    ``eos_id`` alone."""
    model, tok = loaded
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    extra = [extra] if isinstance(extra, int) else list(extra or ())
    size = getattr(tok, "vocab_size", None)
    eos = getattr(tok, "eos_id", None)
    if eos is None:  # not the tokenizer protocol (a plug-in's own object): left as it is
        return loaded
    ids = [eos] + [int(i) for i in extra if isinstance(i, int) and (size is None or 0 <= i < size)]
    try:
        tok.stop_ids = tuple(dict.fromkeys(ids))
    except (AttributeError, TypeError):
        pass
    return loaded


def load(init: str, args: dict | None = None, paths: Sequence[str] = (),
         dtype: str | None = None) -> Loaded:
    """Resolve ``init`` now (:func:`asyncflow.modelsrc.locate` on ``paths``, the rule ``check``
    uses) and load it. Engines load from the plan instead (:func:`load_model`)."""
    from asyncflow.modelsrc import locate

    try:
        src = locate(init, list(paths))
    except SourceError as e:
        raise ValueError(f"model init {init!r}: {e.code} {e.fields}") from None
    return load_source(src, args, paths, dtype)


def load_model(model: dict, paths: Sequence[str] = ()) -> Loaded:
    """The model of an engine spec's ``model`` dict, from where the compiled plan says it comes
    (``source_kind``/``source``/``path``, resolved by the compiler) and in its ``dtype``; a plan
    without a source (an engine built by hand) resolves ``init`` as :func:`load` does.
    Raises :class:`asyncflow.modelsrc.SourceError` (AF650) when it cannot be had."""
    kind = model.get("source_kind")
    if not kind:
        return load(model["init"], model.get("args"), paths, model.get("dtype"))
    src = Source(kind, model.get("source") or model["init"], model.get("path") or "")
    try:
        return load_source(src, model.get("args"), paths, model.get("dtype"),
                           bool(model.get("trust_remote_code")))
    except SourceError:
        raise
    except (OSError, ValueError, ImportError, TypeError) as e:
        raise SourceError("AF650", init=model.get("init"),
                          reason=f"{e.__class__.__name__}: {e}") from None


def save(loaded: Loaded, directory: str) -> None:
    """Write ``loaded`` as a Hugging Face directory: ``config.json``, safetensors weights in the
    model's dtype, and the tokenizer (with its chat template) that
    ``transformers.AutoTokenizer.from_pretrained`` loads; :func:`from_directory` reads it back."""
    model, tokenizer = loaded
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save(directory)


# -- what engines call: errors located at the model's init or the task -----------------------------
def engine_load(spec) -> Loaded:
    """An engine's model and tokenizer (:func:`load_model` of ``spec.model``), AF650 located."""
    try:
        return load_model(spec.model, spec.extra.get("search_path", ()))
    except SourceError as e:
        raise located(spec, e) from None


def engine_prompt(spec, tokenizer, prompt, round_trip: bool = False) -> tuple[list[int], str]:
    """:func:`encode_prompt` for an engine: AF651/AF652 located; with ``round_trip`` (the
    start-up check of the data's first prompt) also AF655, characters the tokenizer loses."""
    try:
        ids, text = encode_prompt(tokenizer, prompt)
        if round_trip:
            check_round_trip(tokenizer, ids, text)
        return ids, text
    except PromptError as e:
        raise located(spec, e) from None


def model_prompt(engine, prompt) -> tuple[list[int], str]:
    """``(ids, text the model sees)`` of a prompt for ``engine`` (its ``spec`` and
    ``tokenizer``): a :class:`~asyncflow.tokens.Text` that carries its ids (an earlier turn's
    output) as it is, anything else through :func:`engine_prompt` (a chat through the chat
    template, a string as is) and :func:`asyncflow.prompts.fit_prompt` (its length)."""
    if isinstance(prompt, Text) and prompt.ids:
        return list(prompt.ids), str(prompt)
    return fit_prompt(engine, *engine_prompt(engine.spec, engine.tokenizer, prompt))
