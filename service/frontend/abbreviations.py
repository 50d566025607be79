"""English abbreviations spelled out before wetext, so their periods neither get read nor end a sentence.

Titles before a capitalized name: Dr. Doctor, Mr. Mister, Mrs. Missus, Ms. Miz, Prof. Professor, St. Saint,
Mt. Mount. After a capitalized word (a street name): St. Street, Dr. Drive, Ave. Avenue, Rd. Road, Blvd.
Boulevard; a street form wins after a house number (221 Baker St. London). Elsewhere: Dr. Doctor, Jr. Junior,
Sr. Senior, e.g. "for example", i.e. "that is", etc. "et cetera", vs. versus, No. before a digit "number",
and dotted capitals read as letters (U.S. -> U S, U.K. -> U K). Where the period may also end the sentence
(etc., Jr., Sr., initials, street forms), it is kept when a line or the text ends there or a capitalized
word follows.
"""

from __future__ import annotations

from collections.abc import Callable

import regex

from service.frontend.rules import Rule, rule

_TITLES = {"Dr": "Doctor", "Mr": "Mister", "Mrs": "Missus", "Ms": "Miz", "Prof": "Professor", "St": "Saint", "Mt": "Mount"}
_STREETS = {"St": "Street", "Dr": "Drive", "Ave": "Avenue", "Rd": "Road", "Blvd": "Boulevard"}
_PLAIN = {"Dr": "Doctor", "Jr": "Junior", "Sr": "Senior", "e.g": "for example", "i.e": "that is", "etc": "et cetera",
          "vs": "versus", "Ave": "Avenue", "Mr": "Mister", "Mrs": "Missus", "Ms": "Miz", "Prof": "Professor"}  # fmt: skip
_MAY_END = frozenset({"Jr", "Sr", "etc"})


def _ends_sentence(m: regex.Match[str]) -> bool:
    """The text or line ends right after the match, or a blank and a capital letter follow."""
    tail = m.string[m.end() : m.end() + 2]
    return not tail or tail[0] == "\n" or (tail[0] in " \t" and len(tail) == 2 and tail[1].isupper())


def _spoken(table: dict[str, str], keep_period: Callable[[regex.Match[str]], bool]) -> Callable[[regex.Match[str]], str]:
    def read(m: regex.Match[str]) -> str:
        abbr = m.group("abbr")
        return str(m.group("before") + table[abbr] + ("." if keep_period(m) else ""))

    return read


def _initials(m: regex.Match[str]) -> str:
    return " ".join(m.group().replace(".", "")) + ("." if _ends_sentence(m) else "")


def _may_end(m: regex.Match[str]) -> bool:
    return m.group("abbr") in _MAY_END and _ends_sentence(m)


ABBREVIATION_RULES: tuple[Rule, ...] = (
    rule(
        "street_after_number",
        r"(?P<before>\b\d{1,6}+[ \t]++(?:[A-Z][a-z]{1,30}+[ \t]++){1,3}+)(?P<abbr>St|Dr|Ave|Rd|Blvd)\.",
        _spoken(_STREETS, _ends_sentence),
    ),
    rule("title", r"(?P<before>)\b(?P<abbr>Dr|Mrs|Mr|Ms|Prof|St|Mt)\.(?=[ \t]*+[A-Z])", _spoken(_TITLES, lambda m: False)),
    rule(
        "street",
        r"(?P<before>\b[A-Z][a-z]{1,30}+[ \t]++)(?P<abbr>St|Dr|Ave|Rd|Blvd)\.",
        _spoken(_STREETS, _ends_sentence),
    ),
    rule(
        "abbreviation",
        r"(?P<before>)(?<![\w.])(?P<abbr>Dr|Jr|Sr|e\.g|i\.e|etc|vs|Ave|Mrs|Mr|Ms|Prof)\.(?![\w])",
        _spoken(_PLAIN, _may_end),
    ),
    rule("number_sign", r"\bNo\.[ \t]*+(?=\d)", "number "),
    rule("initials", r"(?<![\w.])(?:[A-Z]\.){2,6}+(?![\w])", _initials),
)
