"""One normalization run: markup and pauses (enhanced), then each sentence read in its own language, split, capped."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import partial

from service.frontend.annotate import annotate, shown_text, spoken_text
from service.frontend.enhanced import EnhancedNormalizer
from service.frontend.lexicon import LexiconSnapshot
from service.frontend.markup import finish_blocks, strip_markdown
from service.frontend.mixed import is_english_sentence
from service.frontend.normalize import OfficialNormalizer
from service.frontend.pauses import Segment, mark_pauses, split_pauses
from service.frontend.pieces import PieceRules, ReadSentence, make_pieces
from service.frontend.rewrite import LexiconRewriter, Rewrite
from service.frontend.split import MIN_CAP_TOKENS, cap_tokens
from service.frontend.steps import contains_chinese, is_only_punctuation, zh_cleanup
from service.frontend.tokenizer import TextTokenizer
from service.frontend.units import cut_sentences

_SURROGATES = re.compile(r"[\ud800-\udfff]")
_LEADING_TAGS = re.compile(r"(?:<\|[^<>|]{0,32}\|>)+")  # `<|en|>` and the like at the start of a tagged text


@dataclass(frozen=True)
class Normalized:
    """What one run produced: the language path, the whole normalized text, and the sentence pieces.

    `shown` (one per piece) is the written text each piece was read from, markup removed. `pauses` (empty, or one
    per piece) holds the seconds of silence after each piece; `lead_pause_s` the silence before the first one (a
    pause marker before any text). `rate` is the speed factor SSML `<prosody rate>` asked for.
    """

    language: str  # "zh", "en" or "bypass"
    joined: str
    pieces: tuple[str, ...]
    rules: tuple[str, ...] = ()
    rewrites: tuple[Rewrite, ...] = ()
    pauses: tuple[float, ...] = ()
    lead_pause_s: float = 0.0
    shown: tuple[str, ...] = field(default=())
    rate: float = 1.0


@dataclass(frozen=True)
class _Reading:
    said: str
    rules: tuple[str, ...] = ()
    rewrites: tuple[Rewrite, ...] = ()


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

    def run(self, text: str, lexicon: LexiconSnapshot | None = None, captions: bool = False) -> Normalized:
        """Normalize `text`; lone surrogates (which no encoder accepts) are removed first. With `captions` no piece
        holds more than one sentence (enhanced mode; the official frontend splits as it does)."""
        text = _SURROGATES.sub("", text)
        if not text or is_bypass(text):
            pieces = self._bypass_pieces(text)
            return Normalized("bypass", text, pieces, shown=pieces)
        text = text.strip()
        if self._enhanced is None:
            return self._official_run(text, lexicon)
        marked, pauses = mark_pauses(self._enhanced.clean(text))
        annotated = annotate(marked, self._rewriter)
        stripped = strip_markdown(annotated.text)
        zh = contains_chinese(spoken_text(stripped))
        full_stop, comma = ("。", "，") if zh else (".", ", ")
        runs = [(finish_blocks(s.text, full_stop, comma).strip(), s) for s in split_pauses(stripped, pauses)]
        read = [(self._read_run(self._enhanced, t, zh, lexicon, captions), s) for t, s in runs]
        return replace(_combine(read, "" if zh else " "), rate=annotated.rate)

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

    def _rules(self, zh: bool, merge_sentences: bool = True) -> PieceRules:
        measure = len if zh else partial(_count, self._tokenizer)
        lang = "zh" if zh else "en"
        return PieceRules(measure, lang, self.count_tokens, self._max_tokens, merge_sentences)

    def _read_run(
        self, enhanced: EnhancedNormalizer, text: str, zh: bool, lexicon: LexiconSnapshot | None, captions: bool
    ) -> Normalized:
        """Each sentence of `text` read on its own (Chinese ones by the zh path, English ones by the en path), then
        split into pieces with the written text of each."""
        sentences: list[ReadSentence] = []
        rules: dict[str, None] = {}
        rewrites: list[Rewrite] = []
        joined = ""
        for written in cut_sentences(text):
            reading = self._read_sentence(enhanced, spoken_text(written).strip(), zh, lexicon)
            glue = _glue(written, joined, reading.said, zh) if joined and reading.said else ""
            rules |= dict.fromkeys(reading.rules)
            rewrites += [replace(r, start=r.start + len(joined) + len(glue)) for r in reading.rewrites]
            joined += glue + reading.said
            sentences.append(ReadSentence(glue, reading.said, shown_text(written)))
        pieces = make_pieces(sentences, self._rules(zh, merge_sentences=not captions))
        said, shown = tuple(p.said for p in pieces), tuple(p.shown for p in pieces)
        return Normalized("zh" if zh else "en", joined, said, tuple(rules), tuple(rewrites), shown=shown)

    def _read_sentence(self, enhanced: EnhancedNormalizer, text: str, zh_run: bool, lexicon: LexiconSnapshot | None) -> _Reading:
        """One sentence: Chinese rules when it holds Chinese (or nothing English, in Chinese text), else English."""
        if is_only_punctuation(text):
            return _Reading(zh_cleanup(text) if zh_run else text)
        if not zh_run or (not contains_chinese(text) and is_english_sentence(text)):
            said, fired = enhanced.en(text)
            return _Reading(said, tuple(fired))
        said, fired = enhanced.zh(text)
        if self._rewriter is None or lexicon is None:
            return _Reading(said, tuple(fired))
        said, rewrites = self._rewriter.rewrite(said, lexicon)
        return _Reading(said, tuple(fired), tuple(rewrites))

    def _official_run(self, text: str, lexicon: LexiconSnapshot | None) -> Normalized:
        """The official frontend: the whole text by one path, split as the official code splits it."""
        zh = contains_chinese(text)
        joined = self._official.zh(text) if zh else self._official.en(text)
        rewrites: list[Rewrite] = []
        if zh and self._rewriter is not None and lexicon is not None:
            joined, rewrites = self._rewriter.rewrite(joined, lexicon)
        pieces = make_pieces([ReadSentence("", joined, text)], self._rules(zh, merge_sentences=False))
        said, shown = tuple(p.said for p in pieces), tuple(p.shown for p in pieces)
        return Normalized("zh" if zh else "en", joined, said, (), tuple(rewrites), shown=shown)


def _glue(written: str, before: str, said: str, zh: bool) -> str:
    """The blank between two readings: as written in English; in Chinese only a single space between two ASCII
    characters, as the official clean-up keeps it (line breaks are dropped there)."""
    blank = written[: len(written) - len(written.lstrip())]
    if not zh:
        return blank
    return blank if blank == " " and _ascii_word_char(before[-1]) and _ascii_word_char(said[0]) else ""


def _ascii_word_char(ch: str) -> bool:
    return ch.isascii() and not ch.isspace()


def _combine(runs: list[tuple[Normalized, Segment]], glue: str) -> Normalized:
    """One result from the runs between pause markers; a pause after a run without pieces moves back a piece."""
    if len(runs) == 1 and runs[0][1].pause_after_s == 0.0:
        return runs[0][0]
    pieces: list[str] = []
    shown: list[str] = []
    pauses: list[float] = []
    lead = 0.0
    rules: dict[str, None] = {}
    rewrites: list[Rewrite] = []
    offset = 0
    for normalized, segment in runs:
        pieces += normalized.pieces
        shown += normalized.shown
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
    return Normalized(language, joined, tuple(pieces), tuple(rules), tuple(rewrites), tuple(pauses), lead, tuple(shown))


def _count(tokenizer: TextTokenizer, text: str) -> int:
    return len(tokenizer.encode(text))
