"""English inside Chinese text: which sentences and runs are English, so that their numbers are read in English.

A sentence without Chinese characters that holds a Latin word of two letters or more is English (the pipeline
routes it). Inside a Chinese sentence, a run of Latin-script text (ASCII, Latin letters and symbols, blanks; no
Chinese character and no full-width punctuation) is English when two Latin words follow each other with only
blanks between them (`It is 10:30`, `the park`); product names and codes (`iPhone 15 Pro`, `COVID-19`,
`CosyVoice 2.0`, `A4`) keep the Chinese reading of their numbers, as a Chinese speaker reads them.
"""

from __future__ import annotations

import regex

ENGLISH_SLOT = "\ue003"  # private use: input never holds one; stands for an English run while Chinese rules run
_LATIN_RUN = regex.compile(r"[\x20-\x7e\u00a0-\u024f\u2018\u2019\u2013\u20ac]++")
_TWO_WORDS = regex.compile(r"(?<![A-Za-z'’])[A-Za-z]++(?:['’-][A-Za-z]++)*+ ++[A-Za-z]")
_LATIN_WORD = regex.compile(r"[A-Za-z]{2}")


def is_english_sentence(text: str) -> bool:
    """Whether a sentence with no Chinese character reads as English (holds a Latin word of 2+ letters)."""
    return _LATIN_WORD.search(text) is not None


def english_runs(text: str) -> list[tuple[int, int]]:
    """(start, end) of each English run inside a Chinese sentence, outer blanks excluded."""
    runs: list[tuple[int, int]] = []
    for m in _LATIN_RUN.finditer(text):
        run = m.group()
        if _TWO_WORDS.search(run) is None:
            continue
        start = m.start() + len(run) - len(run.lstrip())
        runs.append((start, m.start() + len(run.rstrip())))
    return runs


def protect(text: str) -> tuple[str, list[str]]:
    """`text` with each English run replaced by ENGLISH_SLOT, and the runs in order."""
    runs = english_runs(text)
    out: list[str] = []
    pos = 0
    for start, end in runs:
        out += [text[pos:start], ENGLISH_SLOT]
        pos = end
    out.append(text[pos:])
    return "".join(out), [text[s:e] for s, e in runs]


def restore(text: str, readings: list[str]) -> str | None:
    """`text` with each ENGLISH_SLOT replaced by its reading, in order; None when the slots no longer match."""
    parts = text.split(ENGLISH_SLOT)
    if len(parts) != len(readings) + 1:
        return None
    return "".join(p + r for p, r in zip(parts, [*readings, ""], strict=True))
