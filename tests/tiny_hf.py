"""Build, offline, what a user brings: a tiny Qwen2 checkpoint directory with a BPE tokenizer
(trained here with `tokenizers`), special tokens and a chat template; a Hugging Face cache that
serves it under a hub id. Shared by test_model_source.py and test_chat_prompts.py."""
from __future__ import annotations

import shutil
from pathlib import Path

# writes its own BOS, as Llama-style templates do: encoding the rendered text must not add another
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|system|>", "<|assistant|>", "<|end|>"]
TEXTS = ["What is 2+3? 5", "What is 4+4? 8", "Answer with a number.", "hello world"] * 20


def bpe_tokenizer(chat_template: str | None = CHAT_TEMPLATE, texts=TEXTS, full_alphabet: bool = True):
    """A byte-level BPE tokenizer whose post-processor prepends <s> (the tokenizer's own rule).
    ``full_alphabet=False`` trains it on ``texts`` alone, so a character they lack cannot be
    encoded at all (a user's mistake the round-trip checks, AF348/AF655, catch)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if full_alphabet else []
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=alphabet))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    if chat_template:
        fast.chat_template = chat_template
    return fast


def model_dir(path: Path, chat_template: str | None = CHAT_TEMPLATE, dtype: str = "float32",
              **tokenizer) -> Path:
    """A Hugging Face checkpoint directory: a tiny Qwen2 (asyncflow.models.tiny_decoder sized to
    the tokenizer) and the tokenizer, saved with save_pretrained."""
    import torch

    from asyncflow.models import tiny_decoder

    tok = bpe_tokenizer(chat_template, **tokenizer)
    model, _ = tiny_decoder(layers=1, hidden=32, heads=2, vocab=len(tok), max_len=256)
    model.config.bos_token_id = tok.bos_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.to(getattr(torch, dtype))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def hub_cache(cache: Path, repo: str, src: Path, sha: str = "0123456789abcdef0123456789abcdef01234567",
              refs=("main",)) -> Path:
    """Serve directory ``src`` as hub model ``repo`` from the cache at ``cache`` (the layout
    huggingface_hub reads: models--org--name/snapshots/<sha>/..., refs/<name> = sha)."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / sha
    shutil.copytree(src, snap)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    for r in refs:
        (root / "refs" / r).write_text(sha)
    return snap
