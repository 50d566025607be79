"""Small byte-level BPE tokenizer.json files with Qwen2's pipeline, and random texts that stress a Qwen2 tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from service.layers.bpe import byte_symbols

REPO = Path(__file__).resolve().parents[1]
CASES = REPO / "tests" / "reference" / "tiny-cosyvoice2" / "tokenizer_cases.json"
# The official tokenizer's normalizer / pre-tokenizer / decoder, as recorded with the fixtures.
QWEN2 = json.loads(CASES.read_text(encoding="utf-8"))["tokenizer"]
SYMBOL = {b: c for c, b in byte_symbols().items()}
COSYVOICE2_TAGS = ("<|endofprompt|>", "[breath]", "[laughter]", "<strong>", "</strong>", "[quick_breath]", "<laughter>")


def spell(text: str) -> str:
    """`text`'s UTF-8 bytes in GPT-2's byte symbols (how byte-level vocabularies write tokens)."""
    return "".join(SYMBOL[b] for b in text.encode("utf-8"))


def added_token(content: str, token_id: int, *, normalized: bool = False, special: bool = True) -> dict[str, Any]:
    flags = {"single_word": False, "lstrip": False, "rstrip": False}
    return {"id": token_id, "content": content, **flags, "normalized": normalized, "special": special}


def tokenizer_json(
    merges: list[tuple[str, str]],
    *,
    ids: dict[str, int] | None = None,
    extra_vocab: tuple[str, ...] = (),
    added: tuple[tuple[str, bool], ...] = (),
) -> dict[str, Any]:
    """256 byte tokens (id = byte), then each merge's token and `extra_vocab` in order (or the `ids` given), then the
    `added` tokens as (content, normalized); merges and tokens are given as plain text."""
    vocab = {SYMBOL[b]: b for b in range(256)}
    for left, right in merges:
        vocab.setdefault(spell(left + right), len(vocab))
    for token in extra_vocab:
        vocab.setdefault(spell(token), len(vocab))
    for token, token_id in (ids or {}).items():
        vocab[spell(token)] = token_id
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None}
    model |= {"end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False}
    model |= {"vocab": vocab, "merges": [[spell(a), spell(b)] for a, b in merges]}
    first = max(vocab.values()) + 1
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added_token(c, first + i, normalized=n) for i, (c, n) in enumerate(added)],
        "normalizer": QWEN2["normalizer"],
        "pre_tokenizer": QWEN2["pre_tokenizer"],
        "post_processor": None,
        "decoder": QWEN2["decoder"],
        "model": model,
    }


def write(data: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


_POOLS = (
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天",
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789٣١½Ⅳ",
    " \t\n\r\u00a0\u3000\u2028\u0085\u200b",
    "!?.,;:'\"-—…，。！？、；：「」《》()[]{}<>|@#$%^&*_=+/\\~`",
    "😀🎉👍🏽👨‍👩‍👧‍👦🇨🇳❤️✨",
    "éèêëàâäôöûüçñßøåæœÅ",
    "e\u0301a\u0300o\u0308A\u030a\u0327\u0303",
    "こんにちはカタカナ한국어안녕하세요Привет мирمرحباשלוםनमस्ते",
    "ſKÅµǅ",
)
_PIECES = ("'s", "'S", "'t", "'re", "'ve", "'m", "'ll", "'d", "<|", "|>", "[breath", "<|endof", "\r\n", "\n\n", "    ")


def random_text(rng: random.Random, tags: tuple[str, ...] = COSYVOICE2_TAGS) -> str:
    """Up to 40 runs of Chinese, English, digits, emoji, whitespace, decomposed accents, contractions and tags."""
    out = []
    for _ in range(rng.randint(0, 40)):
        roll = rng.random()
        if roll < 0.08 and tags:
            out.append(rng.choice(tags))
        elif roll < 0.2:
            out.append(rng.choice(_PIECES))
        elif roll < 0.3:
            out.append(rng.choice(" \n\t") * rng.randint(1, 9))
        else:
            pool = rng.choice(_POOLS)
            out.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))))
    return "".join(out)
