"""One normalization run: route zh/en, normalize (official or enhanced), rewrite lexicon words, split, cap."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

from service.frontend.enhanced import EnhancedNormalizer
from service.frontend.lexicon import LexiconSnapshot
from service.frontend.normalize import OfficialNormalizer
from service.frontend.rewrite import LexiconRewriter, Rewrite
from service.frontend.split import cap_tokens, split_paragraph
from service.frontend.steps import contains_chinese, is_only_punctuation
from service.frontend.tokenizer import WhisperTokenizer

_SURROGATES = re.compile(r"[\ud800-\udfff]")


@dataclass(frozen=True)
class Normalized:
    """What one run produced: the language path, the whole normalized text, and the sentence pieces."""

    language: str  # "zh", "en" or "bypass"
    joined: str
    pieces: tuple[str, ...]
    rules: tuple[str, ...] = ()
    rewrites: tuple[Rewrite, ...] = ()


def is_bypass(text: str) -> bool:
    """Text holding both `<|` and `|>` (language tags, SSML-like markup) skips normalization and splitting."""
    return "<|" in text and "|>" in text


class Pipeline:
    """Stateless apart from the (thread-safe) components it holds."""

    def __init__(
        self,
        tokenizer: WhisperTokenizer,
        official: OfficialNormalizer,
        enhanced: EnhancedNormalizer | None = None,
        rewriter: LexiconRewriter | None = None,
        max_sentence_tokens: int | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._official = official
        self._enhanced = enhanced
        self._rewriter = rewriter
        self._max_tokens = max_sentence_tokens

    def run(self, text: str, lexicon: LexiconSnapshot | None = None) -> Normalized:
        """Normalize `text`; lone surrogates (which no encoder accepts) are removed first."""
        text = _SURROGATES.sub("", text)
        if not text or is_bypass(text):
            return Normalized("bypass", text, (text,))
        text = text.strip()
        if self._enhanced is not None:
            text = self._enhanced.clean(text).strip()
        if contains_chinese(text):
            return self._zh(text, lexicon)
        return self._en(text)

    def count_tokens(self, text: str) -> int:
        return len(self._tokenizer.encode(text))

    def _zh(self, text: str, lexicon: LexiconSnapshot | None) -> Normalized:
        rules: list[str] = []
        rewrites: list[Rewrite] = []
        if self._enhanced is None:
            joined = self._official.zh(text)
        else:
            joined, rules = self._enhanced.zh(text)
        if self._rewriter is not None and lexicon is not None:
            joined, rewrites = self._rewriter.rewrite(joined, lexicon)
        pieces = self._finish(split_paragraph(joined, len, "zh"))
        return Normalized("zh", joined, pieces, tuple(rules), tuple(rewrites))

    def _en(self, text: str) -> Normalized:
        rules: list[str] = []
        if self._enhanced is None:
            joined = self._official.en(text)
        else:
            joined, rules = self._enhanced.en(text)
        pieces = self._finish(split_paragraph(joined, partial(_count, self._tokenizer), "en"))
        return Normalized("en", joined, pieces, tuple(rules))

    def _finish(self, pieces: list[str]) -> tuple[str, ...]:
        """Drop punctuation-only pieces; with a cap, cut over-long ones (commas, then blanks, then anywhere)."""
        kept = [p for p in pieces if not is_only_punctuation(p)]
        if self._max_tokens is None:
            return tuple(kept)
        capped = [c for p in kept for c in cap_tokens(p, self._max_tokens, self.count_tokens)]
        return tuple(c for c in capped if not is_only_punctuation(c))


def _count(tokenizer: WhisperTokenizer, text: str) -> int:
    return len(tokenizer.encode(text))
