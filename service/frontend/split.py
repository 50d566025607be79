"""Sentence splitting: the official `split_paragraph` (80/60/20) and a hard cap on sentence length."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ZH_TERMINATORS = frozenset("。？！；：、.?!;")
EN_TERMINATORS = frozenset(".?!;:")
COMMAS = frozenset("，,")
CLOSING_QUOTES = frozenset('"”')


@dataclass(frozen=True)
class SplitOptions:
    """Official defaults: sentences up to 80 units, emitted once over 60, a tail under 20 merged back."""

    token_max_n: int = 80
    token_min_n: int = 60
    merge_len: int = 20
    comma_split: bool = False


def split_paragraph(text: str, measure: Callable[[str], int], lang: str, options: SplitOptions | None = None) -> list[str]:
    """Cut `text` after terminators and merge greedily; `measure` is len() for zh and a BPE token count for en."""
    opts = options or SplitOptions()
    if not text:
        return []
    terminators = set(ZH_TERMINATORS if lang == "zh" else EN_TERMINATORS)
    if opts.comma_split:
        terminators |= COMMAS
    if text[-1] not in terminators:
        text += "。" if lang == "zh" else "."
    return _merge(_cut(text, terminators), measure, opts)


def _cut(text: str, terminators: set[str]) -> list[str]:
    """Pieces ending in a terminator; a closing quote right after one stays with it; empty pieces vanish."""
    pieces: list[str] = []
    start = 0
    for i, ch in enumerate(text):
        if ch not in terminators:
            continue
        if i > start:
            pieces.append(text[start:i] + ch)
        if i + 1 < len(text) and text[i + 1] in CLOSING_QUOTES and pieces:
            pieces[-1] += text[i + 1]
            start = i + 2
        else:
            start = i + 1
    return pieces


def _merge(pieces: list[str], measure: Callable[[str], int], opts: SplitOptions) -> list[str]:
    out: list[str] = []
    cur = ""
    for piece in pieces:
        if measure(cur + piece) > opts.token_max_n and measure(cur) > opts.token_min_n:
            out.append(cur)
            cur = ""
        cur += piece
    if cur:
        if measure(cur) < opts.merge_len and out:
            out[-1] += cur
        else:
            out.append(cur)
    return out


_COMMA_CUTS = frozenset("，,、；;：:")
MIN_CAP_TOKENS = 8  # one character is at most 4 BPE tokens, so any cap >= 8 can always be met


def cap_tokens(text: str, max_tokens: int, count: Callable[[str], int]) -> list[str]:
    """Cut `text` into pieces of at most `max_tokens` (as measured by `count`): at commas, then blanks, then anywhere.

    The pieces concatenate back to `text` exactly: nothing is dropped or repeated.
    """
    if max_tokens < MIN_CAP_TOKENS:
        raise ValueError(f"max_tokens must be >= {MIN_CAP_TOKENS}")
    return _cap(text, max_tokens, count, level=0)


def _cap(text: str, max_tokens: int, count: Callable[[str], int], level: int) -> list[str]:
    if count(text) <= max_tokens:
        return [text]
    if level >= 3:  # character level: halve until it fits (single characters always fit)
        mid = len(text) // 2
        return _cap(text[:mid], max_tokens, count, 3) + _cap(text[mid:], max_tokens, count, 3)
    units = _units(text, level)
    out: list[str] = []
    for piece in _pack(units, max_tokens, count):
        out.extend(_cap(piece, max_tokens, count, level + 1) if count(piece) > max_tokens else [piece])
    return out


def _units(text: str, level: int) -> list[str]:
    """Level 0: pieces ending at a comma-like mark; 1: pieces starting at a blank (` word`, as BPE sees it);
    2: single characters."""
    if level == 2:
        return list(text)
    units: list[str] = []
    start = 0
    for i, ch in enumerate(text):
        if level == 0 and ch in _COMMA_CUTS:
            units.append(text[start : i + 1])
            start = i + 1
        elif level == 1 and ch.isspace() and i > start:
            units.append(text[start:i])
            start = i
    if start < len(text):
        units.append(text[start:])
    return units


def _pack(units: list[str], max_tokens: int, count: Callable[[str], int]) -> list[str]:
    """Greedy packing by summed unit sizes (BPE counts are close to additive; callers re-check each piece)."""
    packed: list[str] = []
    cur: list[str] = []
    cur_n = 0
    for unit in units:
        n = count(unit)
        if cur and cur_n + n > max_tokens:
            packed.append("".join(cur))
            cur, cur_n = [], 0
        cur.append(unit)
        cur_n += n
    if cur:
        packed.append("".join(cur))
    return packed
