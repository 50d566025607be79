"""Qwen2's byte-level BPE files (vocab.json, merges.txt, tokenizer_config.json) rebuilt from the tiktoken ranks.

The `dashscope` wheel on PyPI ships `qwen.tiktoken` (151,643 ranks). Qwen2's Hugging Face files are the same
vocabulary in GPT-2's byte-to-unicode spelling; each merge is the last step of the rank-limited BPE of its token.
Written this way, vocab.json and merges.txt are byte-identical to the files published with the Qwen2 models
(sha256 in QWEN2_FILE_SHA256, as listed in public model manifests).
"""

from __future__ import annotations

import base64
import json
import zipfile
from pathlib import Path

DASHSCOPE_MEMBER = "dashscope/resources/qwen.tiktoken"
QWEN2_FILE_SHA256 = {
    "vocab.json": "ca10d7e9fb3ed18575dd1e277a2579c16d108e32f27439684afa0e10b1440910",
    "merges.txt": "8831e4f1a044471340f7c0a83d7bd71306a5b867e95fd870f74d0c5308a904d5",
}
ENDOFTEXT_ID = 151643
# The Qwen2 base tokenizer's own added tokens; CosyVoice2Tokenizer adds its 17 others after these (<|endofprompt|> = 151646).
BASE_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def load_ranks(source: Path) -> dict[bytes, int]:
    """Token bytes -> rank, from `qwen.tiktoken` or from the dashscope wheel that contains it."""
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as wheel:
            text = wheel.read(DASHSCOPE_MEMBER)
    else:
        text = source.read_bytes()
    ranks = {}
    for line in text.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what byte-level BPE vocab files spell tokens in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {byte: chr(code) for byte, code in zip(printable, codes, strict=True)}


def _bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's BPE of `token` using only merges ranked below `max_rank`."""
    parts = [bytes([b]) for b in token]
    while True:
        best: tuple[int, int] | None = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < max_rank and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            return parts
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[str, str]:
    """The text of vocab.json and merges.txt for these ranks (one merge per multi-byte token, in rank order)."""
    spell = byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(spell[b] for b in token)

    merges = ["#version: 0.2"]
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            left, right = _bpe_parts(ranks, token, rank)
            merges.append(f"{text(left)} {text(right)}")
    vocab = json.dumps({text(token): rank for token, rank in ranks.items()}, ensure_ascii=False, separators=(",", ":"))
    return vocab, "\n".join(merges) + "\n"


def tokenizer_config() -> dict[str, object]:
    """tokenizer_config.json of a Qwen2 base model: three added tokens, no BOS, EOS = PAD = <|endoftext|>."""
    added = {
        str(ENDOFTEXT_ID + i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(BASE_SPECIAL_TOKENS)
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(BASE_SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer_files(ranks_source: Path, out_dir: Path) -> None:
    """Write vocab.json, merges.txt and tokenizer_config.json into `out_dir` (a CosyVoice-BlankEN folder)."""
    vocab, merges = vocab_and_merges(load_ranks(ranks_source))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(vocab, encoding="utf-8")
    (out_dir / "merges.txt").write_text(merges, encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")
