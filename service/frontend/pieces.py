"""From sentences read one at a time to the pieces the engine speaks, each with the written text it was read from.

Each sentence's reading is split as the official frontend splits a text (split_paragraph: cut at its terminators,
short parts merged); then, unless captions are asked for, parts of consecutive sentences are merged with the same
official rule (60/80 units), so a text is spoken in the pieces the official frontend would make. With captions no
piece holds more than one sentence. Last, the length cap cuts over-long pieces (commas, then blanks, then anywhere).
A piece's written text is its sentences' written text; where a sentence was cut inside, align.py finds the cut in
the written text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from service.frontend.align import written_cuts
from service.frontend.split import SplitOptions, cap_tokens, split_paragraph
from service.frontend.steps import is_only_punctuation

Measure = Callable[[str], int]


@dataclass(frozen=True)
class ReadSentence:
    """One written sentence and how it is read."""

    glue: str  # the blank its reading follows the previous one with ("" for Chinese)
    said: str  # the reading; empty when nothing is read
    shown: str  # the written form (markup removed), the blanks before it included


@dataclass(frozen=True)
class Piece:
    """One unit of synthesis: its reading and the written text it comes from."""

    said: str
    shown: str

    def __add__(self, other: Piece) -> Piece:
        return Piece(self.said + other.said, self.shown + other.shown)


@dataclass(frozen=True)
class PieceRules:
    """How readings become pieces: the split's measure and language, the cap (None: none), whether to merge sentences."""

    measure: Measure
    lang: str
    count_tokens: Measure
    max_tokens: int | None
    merge_sentences: bool = True


def make_pieces(sentences: Sequence[ReadSentence], rules: PieceRules) -> list[Piece]:
    """Pieces in order; none is punctuation only. The readings' concatenation is kept apart from the split's
    additions (a full stop after a last part without one) and what it drops (repeated terminators)."""
    per_sentence = [_split(s, rules) for s in sentences]
    groups = [[p for parts in per_sentence for p in parts]] if rules.merge_sentences else per_sentence
    merged = [p for group in groups for p in _merge(group, rules.measure)]
    kept = _spoken(merged)
    capped = _spoken([c for p in kept for c in _cap(p, rules)])
    return [Piece(p.said, p.shown.strip()) for p in capped]


def _spoken(pieces: list[Piece]) -> list[Piece]:
    """The pieces whose reading is more than punctuation. A dropped piece's written text goes to the next kept piece
    (or, at the end, the one before): a cut may give a piece the punctuation of the reading and a digit of the text
    (said "，", shown "，1"), and captions must still show every written character once."""
    out: list[Piece] = []
    carried = ""
    for piece in pieces:
        if is_only_punctuation(piece.said):
            carried += piece.shown
            continue
        out.append(Piece(piece.said, carried + piece.shown))
        carried = ""
    if carried and out:
        out[-1] = Piece(out[-1].said, out[-1].shown + carried)
    return out


def _split(sentence: ReadSentence, rules: PieceRules) -> list[Piece]:
    """The official split of one sentence's reading (its parts merged within it), each part with its written text."""
    parts = split_paragraph(sentence.said, rules.measure, rules.lang)
    if not parts:  # nothing but terminators
        return []
    glue = sentence.glue if rules.merge_sentences else ""  # a piece of its own starts with no blank
    if len(parts) == 1:
        return [Piece(glue + parts[0], sentence.shown)]
    cuts = _located(parts, sentence.said)
    shown = _cut(sentence.shown, written_cuts(sentence.shown, sentence.said, cuts))
    pieces = [Piece(said, text) for said, text in zip(parts, shown, strict=True)]
    return [Piece(glue + pieces[0].said, pieces[0].shown), *pieces[1:]]


def _located(parts: list[str], said: str) -> list[int]:
    """Where each part but the last ends in `said` (the split drops repeated terminators, so parts are searched)."""
    cuts: list[int] = []
    pos = 0
    for part in parts[:-1]:
        found = said.find(part, pos)
        pos = found + len(part) if found >= 0 else min(len(said), pos + len(part))
        cuts.append(pos)
    return cuts


def _cut(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in pairwise(bounds)]


def _merge(parts: list[Piece], measure: Measure) -> list[Piece]:
    """split.py's official merge over parts: a piece is emitted once over 60 units when the next would pass 80; a
    tail under 20 joins the piece before it."""
    opts = SplitOptions()
    out: list[Piece] = []
    cur: Piece | None = None
    for part in parts:
        if cur is not None and measure(cur.said + part.said) > opts.token_max_n and measure(cur.said) > opts.token_min_n:
            out.append(cur)
            cur = None
        cur = part if cur is None else cur + part
    if cur is not None:
        if measure(cur.said) < opts.merge_len and out:
            out[-1] = out[-1] + cur
        else:
            out.append(cur)
    return out


def _cap(piece: Piece, rules: PieceRules) -> list[Piece]:
    if rules.max_tokens is None:
        return [piece]
    said = cap_tokens(piece.said, rules.max_tokens, rules.count_tokens)
    if len(said) == 1:
        return [piece]
    ends = [sum(len(s) for s in said[: k + 1]) for k in range(len(said) - 1)]
    shown = _cut(piece.shown, written_cuts(piece.shown, piece.said, ends))
    return [Piece(s, w) for s, w in zip(said, shown, strict=True)]
