"""Pause markup: SSML `<break>` tags and `[pause 1s]` become silence after the text before them.

Accepted forms (case-insensitive):
- `<break time="500ms"/>`, `<break time='1.5s'/>`: an explicit time in `ms` or `s`;
- `<break strength="weak"/>`: none 0, x-weak 0.1 s, weak 0.25 s, medium 0.5 s, strong 1 s, x-strong 2 s;
- `<break/>`, or a time or strength that cannot be read: medium (0.5 s), the SSML default;
- `[pause 1s]`, `[pause 300ms]`, `[pause 1.5 s]`; `[pause]` alone is 0.5 s.
A pause longer than MAX_PAUSE_S is clamped to it (not an error); once MAX_TOTAL_PAUSE_S of pauses have been
granted in one text, later markers add nothing more. Markers are removed from the text in every case.
"""

from __future__ import annotations

from dataclasses import dataclass

import regex

MAX_PAUSE_S = 10.0
MAX_TOTAL_PAUSE_S = 60.0  # bounds the silence (and memory) a short text can ask for
DEFAULT_PAUSE_S = 0.5
PAUSE_MARK = "\ue002"  # private use: clean_input removes such characters, so input never holds one
_STRENGTHS = {"none": 0.0, "x-weak": 0.1, "weak": 0.25, "medium": 0.5, "strong": 1.0, "x-strong": 2.0}

_MARKER = regex.compile(r"<break\b(?P<attrs>[^<>]{0,200}+)>|\[pause\b(?P<arg>[^\[\]\n]{0,20}+)\]", regex.IGNORECASE)
_ATTR = regex.compile(r"""\b(?P<name>time|strength)\s*+=\s*+(?P<q>["'])(?P<value>[^"'<>]{0,40}+)(?P=q)""", regex.IGNORECASE)
_TIME = regex.compile(r"\s*+(?P<n>\d{1,6}+(?:\.\d{1,6}+)?+)\s*+(?P<unit>ms|s)\s*+", regex.IGNORECASE)


@dataclass(frozen=True)
class Segment:
    """Text between pause markers and the silence (seconds) the marker after it asked for (0 after the last)."""

    text: str
    pause_after_s: float


def parse_time(value: str) -> float | None:
    """Seconds of `500ms` / `1.5s` / `2 s`, unclamped; None when `value` is not such a time."""
    m = _TIME.fullmatch(value)
    if m is None:
        return None
    seconds = float(m.group("n"))
    return seconds / 1000.0 if m.group("unit").lower() == "ms" else seconds


def _requested(m: regex.Match[str]) -> float:
    """Seconds one marker asks for, before clamping."""
    if m.group("attrs") is None:
        arg = m.group("arg").strip()
        seconds = parse_time(arg) if arg else None
        return DEFAULT_PAUSE_S if seconds is None else seconds
    attrs = {a.group("name").lower(): a.group("value") for a in _ATTR.finditer(m.group("attrs"))}
    if "time" in attrs and (seconds := parse_time(attrs["time"])) is not None:
        return seconds
    return _STRENGTHS.get(attrs.get("strength", "medium").strip().lower(), DEFAULT_PAUSE_S)


def mark_pauses(text: str) -> tuple[str, tuple[float, ...]]:
    """Replace every marker by PAUSE_MARK; also return the clamped seconds of each, in order."""
    granted: list[float] = []
    left = [MAX_TOTAL_PAUSE_S]

    def mark(m: regex.Match[str]) -> str:
        seconds = max(0.0, min(_requested(m), MAX_PAUSE_S, left[0]))
        left[0] -= seconds
        granted.append(seconds)
        return PAUSE_MARK

    return _MARKER.sub(mark, text), tuple(granted)


def split_pauses(text: str, pauses: tuple[float, ...]) -> list[Segment]:
    """Cut marked text at each PAUSE_MARK; the i-th mark's seconds go to the segment before it."""
    parts = text.split(PAUSE_MARK)
    return [Segment(part, pauses[i] if i < len(pauses) and i < len(parts) - 1 else 0.0) for i, part in enumerate(parts)]
