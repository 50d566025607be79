"""Dictionary word segmentation that cuts exactly as jieba's `Tokenizer.cut(text, HMM=False)`, in ~6 MB instead of ~60 MB."""

from __future__ import annotations

import importlib.util
import math
import mmap
import re
from array import array
from pathlib import Path
from typing import Any

import numpy as np

# jieba's block rules: runs of these characters are cut with the dictionary; anything else is split into whitespace
# runs and single characters.
_DICT_BLOCK = re.compile("([\u4e00-\u9fd5a-zA-Z0-9+#&._%\\-]+)")
_WHITESPACE = re.compile(r"(\r\n|\s)")


def _key(word: str) -> int:
    """64-bit dictionary key of `word` (stable within this process only).

    str hashes cover the raw code units, so "BP" (1 byte per char) and "偂" (2 bytes per char) hash alike;
    such strings always differ in length, and mixing the length in separates them.
    """
    return hash(word) ^ len(word)


def jieba_dictionary() -> Path:
    """jieba's bundled `dict.txt` (located without importing jieba, whose import loads its HMM tables)."""
    spec = importlib.util.find_spec("jieba")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("jieba is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "dict.txt"


def _anonymous(n: int, dtype: type[np.generic]) -> np.ndarray[Any, Any]:
    """A zeroed array in its own private anonymous mapping, outside the malloc heap.

    Allocated by numpy (malloc), the table lands between the build's temporaries on the heap and keeps pages of
    them resident after they are freed; in a mapping of its own it does not (docs/perf-log.md).
    """
    size = n * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE), dtype=dtype, count=n)


class Segmenter:
    """jieba's dictionary as sorted 64-bit keys of every word and word prefix, with int32 frequencies.

    `cut`, `add_word` and `frequency` behave as the same calls on a `jieba.Tokenizer()` (with HMM off).
    Words added later live in a small overlay dict. Not thread-safe: callers serialize access.
    """

    def __init__(self, keys: np.ndarray[Any, Any], freqs: np.ndarray[Any, Any], total: int, chars: dict[str, int]) -> None:
        self._keys = keys  # sorted int64 `_key` of every word and word prefix
        self._freqs = freqs  # int32 frequency per key; 0 for a prefix that is not a word itself
        self._total = total  # sum of all frequencies ever given, as jieba keeps it
        self._chars = chars  # single-character entries and their frequencies
        self._added: dict[str, int] = {}  # add_word entries (and the new prefixes they bring); override the table

    @classmethod
    def load(cls, dictionary: str | Path | None = None) -> Segmenter:
        """Read a jieba-format dictionary (`word freq [tag]` lines, UTF-8); jieba's bundled one when None (~0.7 s)."""
        words, freqs, prefixes, total, chars = _read_dictionary(Path(dictionary) if dictionary else jieba_dictionary())
        keys, table_freqs = _build_table(words, freqs, prefixes)
        return cls(keys, table_freqs, total, chars)

    @property
    def nbytes(self) -> int:
        """Bytes held by the dictionary table (not counting the added words)."""
        return int(self._keys.nbytes + self._freqs.nbytes)

    def frequency(self, word: str) -> int:
        """The word's dictionary frequency; 0 if it is not a word (or only a prefix of one)."""
        return max(self._lookup([word])[0], 0)

    def char_frequencies(self) -> dict[str, int]:
        """Frequency of every single-character entry (0 for a character that only starts longer words)."""
        added = {w: f for w, f in self._added.items() if len(w) == 1}
        return {**self._chars, **added}

    def add_word(self, word: str, freq: int | None = None) -> None:
        """Add or re-weight `word`; without `freq`, jieba's suggestion that makes `cut` keep it whole.

        Frequency 0 leaves the word only as a prefix (jieba's `del_word`).
        """
        freq = self._suggest_freq(word) if freq is None else int(freq)
        self._added[word] = freq
        self._total += freq
        prefixes = [word[:i] for i in range(1, len(word))]
        for prefix, known in zip(prefixes, self._lookup(prefixes), strict=True):
            if known < 0:
                self._added[prefix] = 0

    def cut(self, text: str) -> list[str]:
        """Words of `text` in order; their concatenation is `text`."""
        pieces = _DICT_BLOCK.split(text)  # odd items are the dictionary blocks
        routes = iter(self._routes(pieces[1::2]))
        words: list[str] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                words += _route_words(piece, next(routes))
            else:
                for j, part in enumerate(_WHITESPACE.split(piece)):
                    words += [part] if j % 2 else list(part)
        return words

    def _lookup(self, words: list[str]) -> list[int]:
        """Frequency of each word, 0 for a prefix only, -1 when absent."""
        if not words:
            return []
        wanted = np.fromiter((_key(w) for w in words), dtype=np.int64, count=len(words))
        pos = np.minimum(np.searchsorted(self._keys, wanted), len(self._keys) - 1)
        found: list[int] = np.where(self._keys[pos] == wanted, self._freqs[pos], -1).tolist()
        if self._added:
            found = [self._added.get(w, f) for w, f in zip(words, found, strict=True)]
        return found

    def _suggest_freq(self, word: str) -> int:
        """jieba's `suggest_freq(word)`: just above what the word's current pieces score together."""
        score: float = 1
        for piece in self.cut(word):
            known = self._lookup([piece])[0]
            score *= (1 if known < 0 else known) / float(self._total)
        known = self._lookup([word])[0]
        return max(int(score * self._total) + 1, 1 if known < 0 else known)

    def _edges(self, text: str, ends: list[int]) -> list[list[tuple[int, int]]]:
        """For each position of `text`: (end, frequency) of every dictionary word starting there.

        `ends[k]` is where the block holding position k ends; words never cross it. Extends all candidate
        starts by one character per round, so each round is one vectorized lookup.
        """
        edges: list[list[tuple[int, int]]] = [[] for _ in text]
        active = list(range(len(text)))
        length = 1
        while active:
            found = self._lookup([text[k : k + length] for k in active])
            still: list[int] = []
            for k, freq in zip(active, found, strict=True):
                if freq > 0:
                    edges[k].append((k + length, freq))
                if freq >= 0 and k + length < ends[k]:
                    still.append(k)
            active, length = still, length + 1
        return edges

    def _routes(self, blocks: list[str]) -> list[list[int]]:
        """Per block, the most probable segmentation as `next[i]` = end of the word starting at i."""
        ends = [end for start, end in _spans(blocks) for _ in range(start, end)]
        edges = self._edges("".join(blocks), ends)
        log_total = math.log(self._total)
        routes: list[list[int]] = []
        for start, end in _spans(blocks):
            score = [0.0] * (end - start + 1)
            nxt = [0] * (end - start)
            for i in range(end - 1, start - 1, -1):
                options = edges[i] or [(i + 1, 1)]
                # Same float expression and tie-break (longer word) as jieba, so equal routes are chosen alike.
                best, last = max((math.log(f) - log_total + score[e - start], e - 1) for e, f in options)
                score[i - start], nxt[i - start] = best, last + 1 - start
            routes.append(nxt)
        return routes


def _spans(blocks: list[str]) -> list[tuple[int, int]]:
    """(start, end) of each block in their concatenation."""
    spans: list[tuple[int, int]] = []
    start = 0
    for block in blocks:
        spans.append((start, start + len(block)))
        start += len(block)
    return spans


def _route_words(block: str, nxt: list[int]) -> list[str]:
    """Follow the route through `block`, joining runs of single ASCII letters/digits (as jieba does)."""
    words: list[str] = []
    run = ""
    i = 0
    while i < len(block):
        word = block[i : nxt[i]]
        if len(word) == 1 and word.isascii() and word.isalnum():
            run += word
        else:
            if run:
                words.append(run)
                run = ""
            words.append(word)
        i = nxt[i]
    if run:
        words.append(run)
    return words


def _read_dictionary(path: Path) -> tuple[array[int], array[int], array[int], int, dict[str, int]]:
    """Keys and frequencies of the listed words (file order), keys of their proper prefixes, the frequency total,
    and the single-character entries. Parsed as jieba does; a later line for the same word wins."""
    words, freqs, prefixes = array("q"), array("q"), array("q")
    chars: dict[str, int] = {}
    total = 0
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            try:
                word, count = line.strip().decode("utf-8").split(" ")[:2]
                freq = int(count)
            except ValueError as e:
                raise ValueError(f"invalid dictionary entry in {path} at line {lineno}: {line!r}") from e
            total += freq
            words.append(_key(word))
            freqs.append(freq)
            prefixes.extend(_key(word[:i]) for i in range(1, len(word)))
            if len(word) == 1:
                chars[word] = freq
            else:
                chars.setdefault(word[0], 0)
    return words, freqs, prefixes, total, chars


def _build_table(words: array[int], freqs: array[int], prefixes: array[int]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Sorted unique keys of words and prefixes, and each key's frequency (the last listed one; 0 for prefixes).

    Both results live in `_anonymous` mappings; the temporaries (~40 MB at peak) all go back when freed.
    """
    every = np.empty(len(words) + len(prefixes), dtype=np.int64)
    every[: len(words)] = np.frombuffer(words, dtype=np.int64)
    every[len(words) :] = np.frombuffer(prefixes, dtype=np.int64)
    every.sort()
    first = np.empty(len(every), dtype=bool)
    first[:1] = True
    np.not_equal(every[1:], every[:-1], out=first[1:])
    keys = _anonymous(int(np.count_nonzero(first)), np.int64)
    np.compress(first, every, out=keys)
    word_freqs = np.frombuffer(freqs, dtype=np.int64)
    if word_freqs.size and (word_freqs.min() < 0 or word_freqs.max() > np.iinfo(np.int32).max):
        raise ValueError("dictionary frequencies must fit in 0..2**31-1")
    # Reversed, so that np.unique's first occurrence is the word's last line.
    slots, last = np.unique(np.searchsorted(keys, np.frombuffer(words, dtype=np.int64))[::-1], return_index=True)
    table_freqs = _anonymous(len(keys), np.int32)
    table_freqs[slots] = word_freqs[::-1][last]
    return keys, table_freqs
