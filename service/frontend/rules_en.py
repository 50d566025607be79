"""English (non-Chinese path) normalization fixes applied before wetext: addresses, phones, versions, money, decades,
grouped and large decimals, decimal percentages and ranges.

Phone numbers are read digit by digit in groups, zero as "oh" (555-0123 -> five five five, oh one two three):
(555) 123-4567, 555-123-4567, 555.123.4567 and +1 555 123 4567, other international numbers (+44 20 7946 0958:
7 to 15 digits after the +), and a bare 555-0123 when its first digit is 2-9 (so 100-1000 stays a range; 4-digit
pairs like 1990-1995 are never phones).
"""

from __future__ import annotations

from collections.abc import Callable

import regex

from service.frontend.abbreviations import ABBREVIATION_RULES
from service.frontend.arithmetic import en_arithmetic_rules
from service.frontend.readings import en_decade, en_digits
from service.frontend.roman import en_roman_rules
from service.frontend.rules import Rule, rule

_SYMBOLS_EN = {
    ".": "dot", "/": "slash", "-": "dash", "_": "underscore", "@": "at", ":": "colon", "?": "question mark",
    "=": "equals", "&": "and", "#": "hash", "%": "percent", "+": "plus", "~": "tilde",
}  # fmt: skip
# symbol -> (unit, unit plural, minor unit, minor plural); the yen has no minor unit in use (a fraction is read as
# a decimal). "¥" is read "yen" as wetext reads it in English (in Chinese text, rules_zh reads it 元).
_CURRENCY_EN = {
    "$": ("dollar", "dollars", "cent", "cents"),
    "€": ("euro", "euros", "cent", "cents"),
    "£": ("pound", "pounds", "penny", "pence"),
    "¥": ("yen", "yen", "", ""),
}
_CURRENCY_SYMBOLS = "$€£¥"
# End of a number rule: no digit or decimal part follows; then maybe a unit (a short word: km, mg, °C, km/h), but
# not a plural "s" (1,000s = thousands, not seconds).
_UNIT = r"(?![\d,]|\.\d)(?:(?P<gap> ?+)(?P<unit>(?!s(?![\w°/]))[A-Za-z°µ][A-Za-z°µ/²³]{0,7}+)(?![\w°/]))?+"
_MAGNITUDE_EN = {"k": "thousand", "K": "thousand", "M": "million", "B": "billion"}
_URL_TAIL = ".,;:!?)]'\""  # sentence punctuation right after an address is not part of it


def read_address_en(address: str) -> str:
    """Spoken form of a URL or e-mail: scheme dropped, letter runs kept, digits one by one, symbols named."""
    address = regex.sub(r"^(?i:https?|ftp)://", "", address)
    words = regex.findall(r"[A-Za-z]+|\d|[^A-Za-z\d]", address)
    spoken = [_SYMBOLS_EN.get(w, en_digits(w) if w.isdigit() else w if w.isalpha() else "") for w in words]
    return " ".join(w for w in spoken if w)


def _address(m: regex.Match[str]) -> str:
    text = m.group()
    cut = len(text.rstrip(_URL_TAIL))
    return str(read_address_en(text[:cut]) + text[cut:])


def _version(words: Callable[[str], str]) -> Callable[[regex.Match[str]], str]:
    def read(m: regex.Match[str]) -> str:
        parts = m.group("num").split(".")
        is_ip = not m.group("v") and len(parts) == 4 and all(int(p) <= 255 for p in parts)
        spoken = [en_digits(p) if (len(p) > 1 and p[0] == "0") else words(p) for p in parts]
        prefix = f"{m.group('v')} " if m.group("v") else ""
        return prefix + (" dot " if is_ip else " point ").join(spoken)

    return read


def en_decimal(words: Callable[[str], str], number: str) -> str:
    """`1,234.5` -> one thousand, two hundred and thirty-four point five: the whole part in words (grouping commas
    dropped), the fraction digit by digit. wetext misreads these (`1234.5` -> "thousand two hundred ... point five",
    `1,234.5` read as 1,234 then ".5" -> "thirty-four.five")."""
    whole, _, frac = number.replace(",", "").partition(".")
    spoken = words(whole or "0")
    return f"{spoken} point {en_digits(frac)}" if frac else spoken


def _money(words: Callable[[str], str]) -> Callable[[regex.Match[str]], str]:
    def read(m: regex.Match[str]) -> str:
        one, many, minor_one, minor_many = _CURRENCY_EN[m.group("cur")]
        whole = m.group("whole").replace(",", "")
        frac = m.group("frac") or ""
        magnitude = _MAGNITUDE_EN.get(m.group("mag") or "", m.group("mag") or "")
        if magnitude or (frac and (len(frac) != 2 or not minor_one)):
            amount = en_decimal(words, f"{whole}.{frac.rstrip('0')}" if frac.rstrip("0") else whole)
            return " ".join(w for w in (amount, magnitude, many) if w)
        cents = int(frac or "0")
        parts = []
        if int(whole) or not cents:
            parts.append(f"{words(whole)} {one if int(whole) == 1 else many}")
        if cents:
            parts.append(f"{words(str(cents))} {minor_one if cents == 1 else minor_many}")
        return " and ".join(parts)

    return read


def _number(words: Callable[[str], str], unit_words: Callable[[str], str]) -> Callable[[regex.Match[str]], str]:
    """A grouped or large number in words; a unit right after it (`1,234.5 km`) is read as wetext reads units, since
    wetext no longer sees a number before it. `unit_words` gets the unit with the blank before it, if any."""

    def read(m: regex.Match[str]) -> str:
        spoken = en_decimal(words, m.group("num"))
        unit = (m.group("gap") or "") + (m.group("unit") or "")
        read_unit = unit_words(unit) if unit else unit
        return f"{spoken} {read_unit}" if read_unit != unit else spoken + unit

    return read


def _number_range(m: regex.Match[str]) -> str:
    """`1.5-2.5`, `1,000-2,000` -> "... to ..."; a hyphen between plain integers is left to wetext (3-5, 1990-1995)."""
    a, b = m.group("a"), m.group("b")
    return f"{a} to {b}" if any(c in a + b for c in ".,") else str(m.group())


_PHONE_DIGITS = ("oh", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def _phone(m: regex.Match[str]) -> str:
    area = m.group("area") or m.groupdict().get("area2")
    groups = [g for g in (area, m.group("exchange"), m.group("line")) if g]
    spoken = [" ".join(_PHONE_DIGITS[int(d)] for d in g) for g in groups]
    country = m.group("cc")
    if country:
        spoken.insert(0, "plus " + " ".join(_PHONE_DIGITS[int(d)] for d in country))
    return ", ".join(spoken)


def _international(m: regex.Match[str]) -> str:
    """+44 20 7946 0958 -> plus four four, two oh, seven nine four six, oh nine five eight (7 to 15 digits)."""
    groups = regex.findall(r"\d++", m.group())
    if not 7 <= sum(map(len, groups)) <= 15:
        return str(m.group())
    spoken = [" ".join(_PHONE_DIGITS[int(d)] for d in g) for g in groups]
    return "plus " + ", ".join(spoken)


def _decade(m: regex.Match[str]) -> str:
    return en_decade(m.group("num"))


def en_rules(words: Callable[[str], str], unit_words: Callable[[str], str] = str) -> tuple[Rule, ...]:
    """The English rules in order; `words` spells an ASCII digit string (a thread-safe inflect wrapper), `unit_words`
    reads what follows a number put in words (` km` -> kilometers; anything that is no unit unchanged)."""
    return (
        rule("email", r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63}){1,8}", _address),
        rule("url", r"(?<![A-Za-z0-9])(?i:(?:https?|ftp)://|www\.)[A-Za-z0-9\-._~/?#\[\]@!$&'*+,;=%:]{1,2000}+", _address),
        *ABBREVIATION_RULES,
        rule(
            "phone",
            r"(?<![\w+.-])(?:\+(?P<cc>\d{1,3}+)[ .-]?+)?+(?:\((?P<area>\d{3})\)[ .]?+|(?P<area2>\d{3})(?P<sep>[ .-]))"
            r"(?P<exchange>\d{3})(?(sep)(?P=sep)|[ .-])(?P<line>\d{4})(?![\w]|[.-]\d)",
            _phone,
        ),
        rule("phone_local", r"(?<![\w+.-])(?P<cc>)(?P<area>)(?P<exchange>[2-9]\d{2})-(?P<line>\d{4})(?![\w]|[.-]\d)", _phone),
        rule(
            "phone_international",
            r"(?<![\w+.-])\+\d{1,3}+(?:[ .-]\(?+\d{1,5}+\)?+){1,6}+(?![\w]|[.-]\d)",
            _international,
        ),
        *en_arithmetic_rules(words),
        *en_roman_rules(words),
        rule("long_digits", r"(?<![\d.])\d{12,}+(?!\.\d)", lambda m: en_digits(m.group())),
        rule("version", r"(?<![0-9A-Za-z.])(?P<v>[vV])?(?P<num>\d{1,4}(?:\.\d{1,4}){2,6})(?![0-9A-Za-z]|\.\d)", _version(words)),
        rule(
            "money_range",
            rf"(?P<a>[{_CURRENCY_SYMBOLS}]\s*+\d[\d,]*+(?:\.\d++)?+(?:\s*+[kKMB](?![A-Za-z]))?+)\s*+[-—–~]\s*+"
            rf"(?=[{_CURRENCY_SYMBOLS}]?\s*+\d)",
            r"\g<a> to ",
        ),
        rule(
            "money",
            rf"(?P<cur>[{_CURRENCY_SYMBOLS}])\s*+(?P<whole>\d++(?:,\d{{3}})*+)(?:\.(?P<frac>\d++))?+"
            r"(?:\s*+(?P<mag>[kKMB](?![A-Za-z])|thousand|million|billion|trillion))?+",
            _money(words),
        ),
        rule(
            "percent_range",
            r"(?<![\d.])(?P<a>\d++(?:\.\d++)?+)%?+\s*+[-—–~]\s*+(?P<b>\d++(?:\.\d++)?+)%",
            r"\g<a>% to \g<b>%",
        ),
        rule("dash_range", r"(?<=\d)\s*+[—–~]\s*+(?=\d)", " to "),
        rule(
            "number_range",
            r"(?<![\w.,-])(?P<a>\d[\d,]*+(?:\.\d++)?+)\s*+-\s*+(?P<b>\d[\d,]*+(?:\.\d++)?+)(?![\w-]|[.,]\d)",
            _number_range,
        ),
        rule(
            "decimal_percent",
            r"(?<![\w.,])(?P<num>\d[\d,]*+\.\d++)\s?+%",
            lambda m: en_decimal(words, m.group("num")) + " percent",
        ),
        rule(
            "thousands_separator", rf"(?<![\d.,])(?P<num>\d{{1,3}}(?:,\d{{3}})++(?:\.\d++)?+){_UNIT}", _number(words, unit_words)
        ),
        rule("large_decimal", rf"(?<![\w.,])(?P<num>\d{{4,}}+\.\d++){_UNIT}", _number(words, unit_words)),
        rule("decade", r"(?<![\w.])['’]?(?P<num>(?:1\d|20)\d0|[2-9]0)s(?![\w'’])", _decade),
        rule("plus_suffix", r"(?<=\d)\+(?!\d)", " plus"),
    )
