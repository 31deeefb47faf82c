"""Model factories: a tiny Qwen2-style decoder built from a config in code, and a character
tokenizer, so that real RL training runs on a CPU without downloading anything.

A model factory (the ``init: module:factory`` of a pipeline's ``models:``) returns a
:class:`Loaded` ``(model, tokenizer)`` pair. The tokenizer protocol every engine relies on:

================  ==========================================================
member            meaning
================  ==========================================================
``encode(text)``  ``list[int]``, no special tokens added
``decode(ids)``   ``str``, special tokens (pad/bos/eos) dropped
``pad_id``        id used to pad batches (never a real token of a sample)
``bos_id``        id prepended to every prompt, or ``None``
``eos_id``        id that ends a response
``vocab_size``    number of ids
================  ==========================================================

torch and transformers are imported inside functions only: ``asyncflow check`` resolves
``asyncflow.models:tiny_decoder`` without importing torch.
"""
from __future__ import annotations

import threading

import json
import os
import string
from typing import Any, NamedTuple, Sequence

TOKENIZER_FILE = "asyncflow_tokenizer.json"


class Loaded(NamedTuple):
    """What a model factory returns; unpacks as ``model, tokenizer = tiny_decoder()``."""

    model: Any  # a transformers causal LM (torch.nn.Module), fp32, on CPU
    tokenizer: Any  # follows the tokenizer protocol in the module docstring


class CharTokenizer:
    """One id per character. Ids 0..3 are ``<pad> <bos> <eos> <unk>``; then digits, the
    operators ``+-*/=%^``, lower- and upper-case ASCII letters, space, newline and some
    punctuation. Unknown characters encode to ``unk_id`` (and decode to ``?``).

    The vocabulary is fixed, so ``CharTokenizer.VOCAB_SIZE`` is known without an instance."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
    CHARS = (string.digits + "+-*/=%^" + string.ascii_lowercase + string.ascii_uppercase
             + " \n.,:;?!'\"()[]{}<>_#$&|\\~`@")
    VOCAB_SIZE = len(SPECIALS) + len(CHARS)

    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

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

    def save(self, directory: str) -> None:
        with open(os.path.join(directory, TOKENIZER_FILE), "w") as f:
            json.dump({"class": "CharTokenizer", "chars": self.CHARS}, f)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


class HFTokenizer:
    """Adapts a ``transformers`` tokenizer to the tokenizer protocol."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_id = tok.eos_token_id
        self.bos_id = tok.bos_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.vocab_size = len(tok)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def save(self, directory: str) -> None:
        self.tok.save_pretrained(directory)


_BUILD_LOCK = threading.RLock()  # one model build at a time per process (tiny_decoder)

def tiny_decoder(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int | None = None,
                 max_len: int = 128, seed: int = 0, intermediate: int | None = None,
                 kv_heads: int | None = None, attn: str = "sdpa", **kw) -> Loaded:
    """A randomly initialised Qwen2-style decoder (fp32, CPU) and a :class:`CharTokenizer`.

    ``layers``/``hidden``/``heads`` size it; ``intermediate`` is the MLP width (default
    ``4 * hidden``); ``vocab`` defaults to the tokenizer's size; ``max_len`` is the longest
    prompt + response; ``seed`` makes the initial weights reproducible (the global torch RNG is
    left untouched). Extra ``kw`` go to ``Qwen2Config``. Embeddings are tied.
    layers=2, hidden=128 has about 0.55M parameters.

    Thread-safe: engines of one process (``--backend local``) are built concurrently, and both
    transformers' lazy imports and the seeded draws from torch's process-wide generator must not
    interleave (they did: different initial weights per run, and ImportErrors at start-up)."""
    with _BUILD_LOCK:
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


def from_directory(path: str) -> Loaded:
    """A local HF directory (``config.json`` + weights): never downloads. Its tokenizer is a
    :class:`CharTokenizer` where ``asyncflow_tokenizer.json`` is present, else the directory's
    own ``transformers`` tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    model.eval()
    if os.path.exists(os.path.join(path, TOKENIZER_FILE)):
        tok = CharTokenizer()
    else:
        tok = HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
    return Loaded(model, tok)


def load(init: str, args: dict | None = None, paths: Sequence[str] = ()) -> Loaded:
    """Resolve a pipeline's ``models.<name>.init``: an existing directory (a local HF model or an
    asyncflow checkpoint written by an engine's ``save``) or ``module:factory`` called with
    ``args``. The factory's module is imported from ``paths`` first (the run's search path,
    :func:`asyncflow.refs.search_path`, which engines get as ``spec.extra["search_path"]``)."""
    from asyncflow.refs import resolve

    args = dict(args or {})
    if os.path.isdir(init):
        return from_directory(init)
    _, sep, _ = init.partition(":")
    if not sep:
        raise ValueError(f"model init {init!r} is neither a directory nor 'module:factory'")
    factory = resolve(init, paths)
    out = factory(**args)
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError(f"model factory {init!r} must return a (model, tokenizer) pair")
    return Loaded(*out)


def save(loaded: Loaded, directory: str) -> None:
    """Write ``loaded`` as a local HF directory that :func:`from_directory` reads back."""
    model, tokenizer = loaded
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save(directory)
