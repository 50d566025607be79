"""The official CosyVoice text clean-up steps (zh regex steps, English number spell-out, punctuation test)."""

from __future__ import annotations

import re
from collections.abc import Callable

import inflect
import regex

_HAN = re.compile(r"[\u4e00-\u9fff]")
_TRAILING_COMMAS = re.compile(r"[，,、]+$")
_ONLY_PUNCT = regex.compile(r"[\p{P}\p{S}]*")


def contains_chinese(text: str) -> bool:
    """True if any CJK unified ideograph U+4E00..U+9FFF occurs (the official zh/en routing test)."""
    return _HAN.search(text) is not None


def replace_blank(text: str) -> str:
    """Drop every space unless both neighbours are non-space ASCII (keeps `GPU is`, drops `去 park`)."""
    out: list[str] = []
    last = len(text) - 1
    for i, ch in enumerate(text):
        if ch != " ":
            out.append(ch)
            continue
        # The official code reads text[i-1] / text[i+1]; at the edges (unreachable after strip) we drop the space.
        if 0 < i < last and _ascii_word_char(text[i - 1]) and _ascii_word_char(text[i + 1]):
            out.append(ch)
    return "".join(out)


def _ascii_word_char(ch: str) -> bool:
    return ch.isascii() and ch != " "


def replace_corner_mark(text: str) -> str:
    """`²` -> 平方, `³` -> 立方."""
    return text.replace("²", "平方").replace("³", "立方")


def remove_bracket(text: str) -> str:
    """Delete （ ） 【 】 and backticks; turn `——` into a space."""
    for mark in ("（", "）", "【", "】", "`"):
        text = text.replace(mark, "")
    return text.replace("——", " ")


def trailing_comma_to_period(text: str) -> str:
    """A run of `，` `,` `、` at the very end becomes `。`."""
    return _TRAILING_COMMAS.sub("。", text)


def zh_cleanup(text: str) -> str:
    """The official zh post-processing after wetext, in the official order."""
    text = text.replace("\n", "")
    text = replace_blank(text)
    text = replace_corner_mark(text)
    text = text.replace(".", "。")
    text = text.replace(" - ", "，")
    text = remove_bracket(text)
    return trailing_comma_to_period(text)


def spell_out_number(text: str, number_to_words: Callable[[str], str]) -> str:
    """Replace every maximal run of `str.isdigit()` characters by `number_to_words(run)`."""
    out: list[str] = []
    start: int | None = None
    for i, ch in enumerate(text):
        if ch.isdigit():
            if start is None:
                start = i
            continue
        if start is not None:
            out.append(number_to_words(text[start:i]))
            start = None
        out.append(ch)
    if start is not None:
        out.append(number_to_words(text[start:]))
    return "".join(out)


def inflect_number_words(engine: inflect.engine) -> Callable[[str], str]:
    """`inflect.number_to_words` with the default `andword`; runs too long for inflect are read digit by digit."""

    def words(run: str) -> str:
        try:
            return str(engine.number_to_words(run))
        except (inflect.NumOutOfRangeError, IndexError, ValueError):
            # The official code raises here; reading the digits one by one is the only sensible reading.
            return " ".join(str(engine.number_to_words(d)) for d in run)

    return words


def is_only_punctuation(text: str) -> bool:
    """True if `text` is empty or made only of Unicode punctuation (P*) and symbols (S*)."""
    return _ONLY_PUNCT.fullmatch(text) is not None
