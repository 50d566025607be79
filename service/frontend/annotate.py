"""Markup that makes what is read differ from what is written (enhanced frontend), and the speed it asks for.

- `<sub alias="世界贸易组织">WTO</sub>`: the alias is read, the content is what captions show.
- `[pinyin]` right after Chinese characters, one syllable per character, tone numbers or tone marks
  (`重[chong2]庆`, `重庆[chong2 qing4]`, `行[háng]`): the syllables go to the rightmost run of as many characters
  before the bracket that can each be read that way (`重庆[chong2]` sets 重, `银行[hang2]` sets 行), else (lower-case
  syllables only) to the last ones. The model reads those characters written with single-reading homophones (as the
  lexicon does); captions show them as written. A lower-case bracket of tone-numbered syllables that are no pinyin is
  refused (never read as numbers); capitals that fit no character (`表[A1]`, `[Q3]`) are text.
- `<prosody rate="…">`: x-slow 0.5, slow 0.64, medium or default 1, fast 1.55, x-fast 2 (Azure's values), `150%`,
  `+20%` / `-20%`, or a factor `1.2`; it multiplies the request's speed. One request is spoken at one speed, so the
  rate must cover all the speakable text; other prosody attributes (pitch, volume, contour, range, duration) and
  `<phoneme>` are refused: the models have no control for them.
Shown and read text travel together as ANNOTATION_START shown READ_AS read ANNOTATION_END until the text is cut into
sentences; `shown_text` and `spoken_text` keep one side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import regex

from service.errors import InvalidInputError
from service.frontend.homophones import tone3

ANNOTATION_START, READ_AS, ANNOTATION_END = "\ue004", "\ue005", "\ue006"  # private use: input never holds them
MAX_PINYIN_CHARS = 16
RATE_KEYWORDS = {"x-slow": 0.5, "slow": 0.64, "medium": 1.0, "default": 1.0, "fast": 1.55, "x-fast": 2.0}
MIN_RATE, MAX_RATE = 0.25, 4.0

_PHONEME = regex.compile(r"<phoneme\b", regex.IGNORECASE)
_SUB = regex.compile(r"<sub\b(?P<attrs>[^<>]{0,500}+)>(?P<body>[^<>\n\ue002]{0,1000}+)</sub\s*+>", regex.IGNORECASE)
_ALIAS = regex.compile(r"""\balias\s*+=\s*+(?P<q>["'])(?P<value>[^"'<>\n\ue002]{0,500}+)(?P=q)""", regex.IGNORECASE)
_PINYIN = regex.compile(rf"(?P<han>[\u4e00-\u9fff]{{1,{MAX_PINYIN_CHARS}}}+)\[(?P<py>[^\[\]\n]{{1,160}}+)\]")
_NUMBERED = regex.compile(r"[a-zü]{1,6}+[0-9]")
_PROSODY = regex.compile(r"<(?P<close>/)?+prosody\b(?P<attrs>[^<>]{0,500}+)>", regex.IGNORECASE)
_ATTR = regex.compile(r"""(?P<name>[A-Za-z][\w:-]{0,30}+)\s*+=\s*+(?P<q>["'])(?P<value>[^"'<>]{0,100}+)(?P=q)""")
_RATE = regex.compile(r"(?P<sign>[+-])?+(?P<n>\d{1,4}+(?:\.\d{1,4}+)?+)(?P<pct>%)?+")
_TAG = regex.compile(r"<[^<>]{0,500}+>")
_ANNOTATION = regex.compile(r"\ue004(?P<shown>[^\ue004-\ue006]*+)\ue005(?P<read>[^\ue004-\ue006]*+)\ue006")
_STRAY = regex.compile(r"[\ue004-\ue006]")


class Speller(Protocol):
    """The pinyin data markup needs (the lexicon rewriter has it)."""

    @property
    def syllables(self) -> frozenset[str]: ...

    def readings(self, ch: str) -> tuple[str, ...]: ...

    def spell(self, word: str, pinyin: str) -> tuple[str, bool]: ...


@dataclass(frozen=True)
class Annotated:
    text: str  # with annotations, prosody tags removed
    rate: float  # speed factor of <prosody rate>; 1.0 without


def annotate(text: str, speller: Speller | None) -> Annotated:
    """Apply the markup above; InvalidInputError (400) naming the element for what cannot be honoured."""
    if _PHONEME.search(text):
        raise InvalidInputError(
            "SSML <phoneme> is not supported: write the reading as [pinyin] after the characters (重[chong2]) "
            "or add a lexicon entry (/v1/lexicon)",
            param="text",
        )
    text = _SUB.sub(_sub, text)
    if speller is not None:
        text = _PINYIN.sub(lambda m: _pinyin(m, speller), text)
    return _prosody(text)


def shown_text(text: str) -> str:
    """What captions show: each annotation's written side."""
    return str(_STRAY.sub("", _ANNOTATION.sub(r"\g<shown>", text)))


def spoken_text(text: str) -> str:
    """What the model reads: each annotation's read side."""
    return str(_STRAY.sub("", _ANNOTATION.sub(r"\g<read>", text)))


def _annotation(shown: str, read: str) -> str:
    return f"{ANNOTATION_START}{shown}{READ_AS}{read}{ANNOTATION_END}"


def _sub(m: regex.Match[str]) -> str:
    alias = _ALIAS.search(m.group("attrs"))
    body = m.group("body")
    return _annotation(body, alias.group("value")) if alias is not None else body


def _pinyin(m: regex.Match[str], speller: Speller) -> str:
    """Characters before a bracket of pinyin written with homophones for that reading; other brackets unchanged."""
    han, tokens = str(m.group("han")), m.group("py").replace(",", " ").split()
    syllables = _syllables(tokens, speller)
    if syllables is None:
        return str(m.group())
    if len(syllables) > len(han):
        raise InvalidInputError(
            f"[{m.group('py')}] gives {len(syllables)} syllables but only {len(han)} Chinese characters come before it",
            param="text",
        )
    start = _reading_window(han, syllables, speller)
    if start is None and any(not t.islower() for t in tokens):
        return str(m.group())  # capitals that fit no character before them: a code or a citation ([A1], [Q3])
    start = len(han) - len(syllables) if start is None else start
    end = start + len(syllables)
    spelled, _ = speller.spell(han[start:end], " ".join(syllables))
    return han[:start] + _annotation(han[start:end], spelled) + han[end:]


def _syllables(tokens: list[str], speller: Speller) -> list[str] | None:
    """Tone-numbered syllables of a bracket, None when it is no pinyin markup; InvalidInputError for lower-case
    tone-numbered tokens that are no syllables (`chong9`, `xyz2`), so that digits inside markup are never read as
    numbers."""
    if not tokens or len(tokens) > MAX_PINYIN_CHARS:
        return None
    if all(_NUMBERED.fullmatch(t.lower()) for t in tokens):
        syllables = [tone3(t) for t in tokens]
        bad = [t for t, s in zip(tokens, syllables, strict=True) if t[-1] not in "12345" or s not in speller.syllables]
        if bad and all(t.islower() for t in tokens):
            raise InvalidInputError(f"not a pinyin syllable in [pinyin] markup: {', '.join(bad)}", param="text")
        return None if bad else syllables
    marked = [tone3(t) for t in tokens if t.isalpha() and not t.isascii()]
    if len(marked) == len(tokens) and all(s[-1] in "1234" and s in speller.syllables for s in marked):
        return marked
    return None


def _reading_window(han: str, syllables: list[str], speller: Speller) -> int | None:
    """Start of the rightmost run of len(syllables) characters that can each be read as their syllable (None if no
    run can)."""
    n = len(syllables)
    for start in range(len(han) - n, -1, -1):
        window = han[start : start + n]
        if all(s in speller.readings(ch) for ch, s in zip(window, syllables, strict=True)):
            return start
    return None


def _prosody(text: str) -> Annotated:
    """Prosody tags removed; the one rate that covers every speakable character (InvalidInputError otherwise)."""
    stack: list[float] = [1.0]  # text outside any prosody is read at the request's own speed
    spans: list[tuple[str, float]] = []
    pos = 0
    for m in _PROSODY.finditer(text):
        spans.append((text[pos : m.start()], stack[-1]))
        pos = m.end()
        if m.group("close"):
            if len(stack) > 1:
                stack.pop()
        elif not m.group("attrs").rstrip().endswith("/"):
            rate = _rate_of(m.group("attrs"))
            stack.append(rate if rate is not None else stack[-1])
    if not spans:
        return Annotated(text, 1.0)
    spans.append((text[pos:], stack[-1]))
    rates = {rate for part, rate in spans if _speakable(part)}
    if len(rates) > 1:
        raise InvalidInputError(
            "SSML <prosody rate> must cover all the text, at one rate: one request is spoken at one speed "
            "(send the parts as separate requests)",
            param="text",
        )
    return Annotated("".join(part for part, _ in spans), rates.pop() if rates else 1.0)


def _rate_of(attrs: str) -> float | None:
    """The factor of a prosody tag's `rate` (None without one); InvalidInputError for any other attribute."""
    rate: float | None = None
    for a in _ATTR.finditer(attrs):
        name, value = a.group("name").lower(), a.group("value").strip().lower()
        if name != "rate":
            raise InvalidInputError(
                f"SSML <prosody {name}> is not supported (the models have no control for it); only rate is",
                param="text",
            )
        rate = _factor(value)
    return rate


def _factor(value: str) -> float:
    if value in RATE_KEYWORDS:
        return RATE_KEYWORDS[value]
    m = _RATE.fullmatch(value)
    if m is None or (m.group("sign") and not m.group("pct")):
        raise InvalidInputError(
            f"SSML <prosody rate={value!r}> is not a rate: use x-slow, slow, medium, fast, x-fast, 150%, +20% or 1.2",
            param="text",
        )
    n = float(m.group("n"))
    factor = (1 + (n if m.group("sign") != "-" else -n) / 100 if m.group("sign") else n / 100) if m.group("pct") else n
    if not MIN_RATE <= factor <= MAX_RATE:
        raise InvalidInputError(
            f"SSML <prosody rate={value!r}> is a factor of {factor:g}; it must be within {MIN_RATE:g}..{MAX_RATE:g}",
            param="text",
        )
    return factor


def _speakable(part: str) -> bool:
    return any(ch.isalnum() for ch in _TAG.sub("", part))
