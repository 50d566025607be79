"""The CosyVoice2 text tokenizer as one `tokenizer.json`: the checkpoint's Qwen2 BPE plus CosyVoice2's special tokens
(export/qwen_tokenizer.py builds it)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from export import qwen_tokenizer
from export.qwen_tokenizer import dashscope_ranks, source_files, usable, write_tokenizer

__all__ = ["COSYVOICE2_SPECIAL", "build_tokenizer", "dashscope_ranks", "source_files", "usable", "write_tokenizer"]

# CosyVoice2Tokenizer's special tokens (cosyvoice/tokenizer/tokenizer.py), added in this order after the checkpoint's.
COSYVOICE2_SPECIAL = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endofprompt|>",
    "[breath]",
    "<strong>",
    "</strong>",
    "[noise]",
    "[laughter]",
    "[cough]",
    "[clucking]",
    "[accent]",
    "[quick_breath]",
    "<laughter>",
    "</laughter>",
    "[hissing]",
    "[sigh]",
    "[vocalized-noise]",
    "[lipsmack]",
    "[mn]",
)


def build_tokenizer(source: Path) -> Tokenizer:
    """The official CosyVoice2 tokenizer from `source` (export.qwen_tokenizer.build_tokenizer) with COSYVOICE2_SPECIAL."""
    return qwen_tokenizer.build_tokenizer(source, COSYVOICE2_SPECIAL)
