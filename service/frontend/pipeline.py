"""One normalization run: route zh/en, strip markup and cut at pauses (enhanced), normalize, rewrite, split, cap."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import partial

from service.frontend.enhanced import EnhancedNormalizer
from service.frontend.lexicon import LexiconSnapshot
from service.frontend.markup import finish_blocks, strip_markdown
from service.frontend.normalize import OfficialNormalizer
from service.frontend.pauses import Segment, mark_pauses, split_pauses
from service.frontend.rewrite import LexiconRewriter, Rewrite
from service.frontend.split import MIN_CAP_TOKENS, cap_tokens, split_paragraph
from service.frontend.steps import contains_chinese, is_only_punctuation
from service.frontend.tokenizer import TextTokenizer

_SURROGATES = re.compile(r"[\ud800-\udfff]")
_LEADING_TAGS = re.compile(r"(?:<\|[^<>|]{0,32}\|>)+")  # `<|en|>` and the like at the start of a tagged text


@dataclass(frozen=True)
class Normalized:
    """What one run produced: the language path, the whole normalized text, and the sentence pieces.

    `pauses` (empty, or one per piece) holds the seconds of silence after each piece; `lead_pause_s` the
    silence before the first one (a pause marker before any text).
    """

    language: str  # "zh", "en" or "bypass"
    joined: str
    pieces: tuple[str, ...]
    rules: tuple[str, ...] = ()
    rewrites: tuple[Rewrite, ...] = ()
    pauses: tuple[float, ...] = ()
    lead_pause_s: float = 0.0


def is_bypass(text: str) -> bool:
    """Text holding both `<|` and `|>` (language tags, SSML-like markup) skips normalization and splitting."""
    return "<|" in text and "|>" in text


class Pipeline:
    """Stateless apart from the (thread-safe) components it holds."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
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
            return Normalized("bypass", text, self._bypass_pieces(text))
        text = text.strip()
        if self._enhanced is None:
            return self._zh(text, lexicon) if contains_chinese(text) else self._en(text)
        marked, pauses = mark_pauses(self._enhanced.clean(text))
        stripped = strip_markdown(marked)
        zh = contains_chinese(stripped)
        full_stop, comma = ("。", "，") if zh else (".", ", ")
        runs = [(finish_blocks(s.text, full_stop, comma).strip(), s) for s in split_pauses(stripped, pauses)]
        return _combine([(self._zh(t, lexicon) if zh else self._en(t), s) for t, s in runs], "" if zh else " ")

    def count_tokens(self, text: str) -> int:
        return len(self._tokenizer.encode(text))

    def _bypass_pieces(self, text: str) -> tuple[str, ...]:
        """Tagged text in one piece, as the official frontend sends it; over the cap it is cut like any over-long
        sentence (commas, blanks, anywhere), each piece keeping the text's leading `<|tag|>`s (the language the LLM is
        told), so no sentence exceeds the cap."""
        if self._max_tokens is None or not text or self.count_tokens(text) <= self._max_tokens:
            return (text,)
        found = _LEADING_TAGS.match(text)
        tags = found.group(0) if found else ""
        room = self._max_tokens - self.count_tokens(tags)
        if room < MIN_CAP_TOKENS:  # tags too long to repeat: cut the text as it is
            tags, room = "", self._max_tokens
        return tuple(tags + piece for piece in cap_tokens(text[len(tags) :], room, self.count_tokens))

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


def _combine(runs: list[tuple[Normalized, Segment]], glue: str) -> Normalized:
    """One result from the runs between pause markers; a pause after a run without pieces moves back a piece."""
    if len(runs) == 1 and runs[0][1].pause_after_s == 0.0:
        return runs[0][0]
    pieces: list[str] = []
    pauses: list[float] = []
    lead = 0.0
    rules: dict[str, None] = {}
    rewrites: list[Rewrite] = []
    offset = 0
    for normalized, segment in runs:
        pieces += normalized.pieces
        pauses += [0.0] * len(normalized.pieces)
        if pauses:
            pauses[-1] += segment.pause_after_s
        else:
            lead += segment.pause_after_s
        rules |= dict.fromkeys(normalized.rules)
        rewrites += [replace(r, start=r.start + offset) for r in normalized.rewrites]
        if normalized.joined:
            offset += len(normalized.joined) + len(glue)
    joined = glue.join(n.joined for n, _ in runs if n.joined)
    language = runs[0][0].language
    return Normalized(language, joined, tuple(pieces), tuple(rules), tuple(rewrites), tuple(pauses), lead)


def _count(tokenizer: TextTokenizer, text: str) -> int:
    return len(tokenizer.encode(text))
