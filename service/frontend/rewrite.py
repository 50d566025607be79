"""Lexicon rewriting: jieba-equivalent segmentation (HMM off) and homophone substitution so each word reads as listed."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

from service.frontend.homophones import HomophoneTable
from service.frontend.lexicon import MAX_WORD_CHARS, LexiconSnapshot
from service.frontend.segment import Segmenter


@dataclass(frozen=True)
class Rewrite:
    """One lexicon word found in the normalized text and what was put in its place."""

    word: str
    pinyin: str
    replacement: str
    start: int  # character offset in the normalized text
    complete: bool  # False when some syllable has no single-reading GB2312 character (that character is kept)


def _lexicon_pieces(token: str, entries: Mapping[str, str]) -> list[str]:
    """Split one segmenter token around the lexicon words inside it (leftmost-longest), e.g. 重庆市 -> 重庆|市."""
    if token in entries or len(token) < 3:
        return [token]
    pieces: list[str] = []
    start = plain = 0
    while start < len(token):
        for end in range(min(len(token), start + MAX_WORD_CHARS), start + 1, -1):
            if token[start:end] in entries:
                pieces += [token[plain:start], token[start:end]] if start > plain else [token[start:end]]
                start = plain = end
                break
        else:
            start += 1
    if plain < len(token):
        pieces.append(token[plain:])
    return pieces


class LexiconRewriter:
    """Owns a private Segmenter (jieba's dictionary) kept in step with the lexicon; thread-safe."""

    def __init__(self, table: HomophoneTable, segmenter: Segmenter) -> None:
        self._table = table
        self._syllables = table.syllables  # computed over every character: once
        self._segmenter = segmenter
        self._lock = threading.Lock()
        self._version: str | None = None
        self._added: dict[str, int] = {}  # lexicon word -> dictionary frequency it had before we added it

    @classmethod
    def create(cls) -> LexiconRewriter:
        """A private Segmenter on jieba's bundled dictionary, and a homophone table ranked by its frequencies."""
        segmenter = Segmenter.load()
        return cls(HomophoneTable.build(segmenter.char_frequencies()), segmenter)

    @property
    def syllables(self) -> frozenset[str]:
        """Every syllable the pinyin data knows (lexicon entries and [pinyin] markup are checked against it)."""
        return self._syllables

    def readings(self, ch: str) -> tuple[str, ...]:
        """The tone-numbered readings of one Han character (empty for any other character)."""
        return tuple(self._table.readings.get(ch, ()))

    def rewrite(self, text: str, lexicon: LexiconSnapshot) -> tuple[str, list[Rewrite]]:
        """Replace every lexicon word the segmenter cuts out of `text` (as jieba would); the text keeps its length."""
        if not lexicon.entries:
            return text, []
        with self._lock:
            self._sync(lexicon)
            words = self._segmenter.cut(text)
        out: list[str] = []
        rewrites: list[Rewrite] = []
        pos = 0
        for token in words:
            for word in _lexicon_pieces(token, lexicon.entries):
                pinyin = lexicon.entries.get(word)
                if pinyin is not None:
                    replacement, complete = self.spell(word, pinyin)
                    if replacement != word or not complete:
                        rewrites.append(Rewrite(word, pinyin, replacement, pos, complete))
                    word = replacement
                out.append(word)
                pos += len(word)
        return "".join(out), rewrites

    def spell(self, word: str, pinyin: str) -> tuple[str, bool]:
        """`word` written with single-reading characters for `pinyin`; second item False if a syllable had none."""
        chars: list[str] = []
        complete = True
        for ch, syllable in zip(word, pinyin.split(), strict=True):
            choice, exact = self._table.spell(ch, syllable)
            complete = complete and exact
            chars.append(choice)
        return "".join(chars), complete

    def _sync(self, lexicon: LexiconSnapshot) -> None:
        """Make the segmenter's dictionary hold exactly the lexicon's words (restoring what they had before)."""
        if lexicon.version == self._version:
            return
        for word in [w for w in self._added if w not in lexicon.entries]:
            self._segmenter.add_word(word, self._added.pop(word))
        for word in lexicon.entries:
            if word not in self._added:
                self._added[word] = self._segmenter.frequency(word)
                self._segmenter.add_word(word)
        self._version = lexicon.version
