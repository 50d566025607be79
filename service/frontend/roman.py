"""Roman numerals read as numbers: Unicode numeral characters (U+2160..U+217F) and ASCII numerals in context.

Chinese text: every Unicode numeral run (Ⅲ号线 -> 三号线), and ASCII numerals after 第 or before 章/卷/部/集/季/
期/型/代/世/号 (第IV章 -> 第四章). English text: after a keyword (Chapter, Part, Volume, Act, Phase, War, ...)
the cardinal (Chapter IV -> Chapter four, World War II -> World War two); after a monarch's or pope's given
name the regnal ordinal (Henry VIII -> Henry the eighth); other Unicode numerals read as cardinals. A single
`I` is read only after a keyword (Part I), never after a name (the pronoun); single `L`, `C`, `D`, `M` and
numerals holding `D` or `M` are never read (Vitamin C, MIX); single `X` never after a name (Malcolm X).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

import regex

from service.frontend.readings import en_ordinal, zh_cardinal
from service.frontend.rules import Rule, rule

_VALID = regex.compile(r"M{0,3}+(?:CM|CD|D?+C{0,3}+)(?:XC|XL|L?+X{0,3}+)(?:IX|IV|V?+I{0,3}+)")
_VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
_KEYWORDS = (
    "Chapter|Chapters|Part|Parts|Volume|Vol\\.|Book|Act|Scene|Phase|Stage|Section|Article|Appendix|Level|Type|"
    "Class|Grade|Round|Season|Episode|Title|Psalm|Unit|Tier|Category|Bowl|War|Series|Canto|Lesson|Step"
)
_NAMES = (
    "Henry|Edward|Richard|George|William|Charles|James|Louis|Elizabeth|Mary|Anne|John|Philip|Frederick|Pius|"
    "Benedict|Gregory|Leo|Innocent|Clement|Urban|Alexander|Boniface|Peter|Ivan|Nicholas|Catherine|Victor|"
    "Constantine|Ramesses|Ptolemy|Alfonso|Ferdinand|Isabella|Juan|Carlos|Felipe|Gustav|Olaf|Harald|Haakon|"
    "Christian|Wilhelm|Otto|Rudolf|Ludwig|Francis|Joseph|Leopold|Umberto|Paul|Stephen|Pedro|Manuel|Robert|"
    "David|Malcolm|Edmund|Harold|Napoleon|Rama|Sixtus|Martin|Felix|Honorius|Adrian|Hadrian|Julius|Lothair"
)
_NAME_SET = frozenset(_NAMES.split("|"))
_UNICODE_NUMERALS = r"[\u2160-\u217f]++"


def roman_value(numeral: str) -> int | None:
    """Value of a well-formed Roman numeral (ASCII or Unicode numeral characters), else None."""
    ascii_form = unicodedata.normalize("NFKC", numeral).upper()
    if not ascii_form or _VALID.fullmatch(ascii_form) is None:
        return None
    total = 0
    for ch, nxt in zip(ascii_form, [*ascii_form[1:], ""], strict=True):
        value = _VALUES[ch]
        total += -value if nxt and _VALUES[nxt] > value else value
    return total


def _zh(m: regex.Match[str]) -> str:
    value = roman_value(m.group())
    return m.group() if value is None else zh_cardinal(str(value))


def _en(words: Callable[[str], str]) -> Callable[[regex.Match[str]], str]:
    def read(m: regex.Match[str]) -> str:
        numeral, word = m.group("num"), m.group("word")
        value = roman_value(numeral)
        regnal = word in _NAME_SET
        if value is None or not _allowed(numeral, regnal):
            return str(m.group())
        spoken = words(str(value))
        return f"{word}{m.group('gap')}{'the ' + en_ordinal(spoken) if regnal else spoken}"

    return read


def _allowed(numeral: str, after_name: bool) -> bool:
    if len(numeral) > 1 or not numeral.isascii():
        return True
    return numeral == "V" or (numeral in "IX" and not after_name)


def _en_unicode(words: Callable[[str], str]) -> Callable[[regex.Match[str]], str]:
    def read(m: regex.Match[str]) -> str:
        value = roman_value(m.group())
        return m.group() if value is None else words(str(value))

    return read


ZH_ROMAN_RULES: tuple[Rule, ...] = (
    rule("roman_unicode", _UNICODE_NUMERALS, _zh),
    rule("roman_ordinal", r"(?<=第)[IVXLC]{1,8}+(?=\p{Han})|(?<![A-Za-z])[IVX]{1,6}+(?=[章卷部集季期型代世号])", _zh),
)


def en_roman_rules(words: Callable[[str], str]) -> tuple[Rule, ...]:
    """Roman numeral rules for the English path; `words` spells an ASCII digit string."""
    return (
        rule(
            "roman_in_context",
            rf"\b(?P<word>{_KEYWORDS}|{_NAMES})(?P<gap>[ \t]++)(?P<num>[IVXLC]{{1,8}}+|{_UNICODE_NUMERALS})(?![A-Za-z0-9])",
            _en(words),
        ),
        rule("roman_unicode", _UNICODE_NUMERALS, _en_unicode(words)),
    )
