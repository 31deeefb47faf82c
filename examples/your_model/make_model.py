"""Build, offline, what a user brings to asyncflow: a Hugging Face model directory with a trained
BPE tokenizer and a chat template, and a chat-form data set.

    python make_model.py            # writes ckpt/tiny-chat/, data/train.jsonl, data/test.jsonl

Everything lands beside this file (the pipeline refers to it by relative paths). The model is a
randomly initialised two-layer Qwen2 -- stand in your own checkpoint directory (or a hub id)
for it in ``pipeline.yaml``. The task: small additions asked in a chat turn, e.g.
``[{"role": "user", "content": "What is 3+4?"}]`` with ``gold: "7"``.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QUESTIONS = ("What is {a}+{b}?", "Add {a} and {b}.", "{a} plus {b} equals?")


def problems(n: int, seed: int, max_operand: int = 4) -> list[dict]:
    """``n`` rows ``{"messages": [{role, content}, ...], "gold": str}``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        q = rng.choice(QUESTIONS).format(a=a, b=b)
        rows.append({"messages": [{"role": "system", "content": "Answer with the number only."},
                                  {"role": "user", "content": q}],
                     "gold": str(a + b)})
    return rows


def train_tokenizer(corpus: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on ``corpus`` (as Qwen2's and GPT-2's are; digits kept
    one per token), wrapped as a transformers tokenizer with the chat template and special tokens
    of a chat model. Its alphabet is the bytes the corpus uses, not all 256, so the vocabulary
    stays small and a model from scratch finds its first rewards sooner.

    transformers 5 loads a tokenizer by the model's type (``Qwen2Tokenizer`` here), which keeps
    the vocabulary and merges but applies Qwen2's own pre-tokenizer (byte-level, one digit a
    token): a byte-level BPE trained this way is what it expects."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE), help="where ckpt/ and data/ go (default: here)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    out = Path(a.out)

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    train, test = problems(5000, seed=1), problems(64, seed=2)
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        with open(data / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    tok = train_tokenizer([tok_text(r) for r in train], a.vocab)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=4 * a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(a.seed)
    model = Qwen2ForCausalLM(config)
    ckpt = out / "ckpt" / "tiny-chat"
    model.save_pretrained(ckpt, safe_serialization=True)
    model.generation_config.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {ckpt} ({n:,} parameters, vocabulary {len(tok)}), "
          f"{data / 'train.jsonl'} ({len(train)} rows), {data / 'test.jsonl'} ({len(test)} rows)")


def tok_text(row: dict) -> str:
    """The text a row becomes in a chat: what the tokenizer is trained on."""
    turns = "".join(f"{m['role']}\n{m['content']}\n" for m in row["messages"])
    return turns + f"assistant\n{row['gold']}\n"


if __name__ == "__main__":
    main()
