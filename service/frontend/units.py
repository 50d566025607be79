"""Where the sentences of a written text end, so that each is read in its own language and keeps its written form.

A sentence ends after 。？！； at once; after an ASCII `.` `?` `!` `;` only where a blank, CJK text or the end follows
(not in `3.5` or `example.com`; not after `Mr.`, `e.g.`, `U.S.` or an initial, unless Chinese text follows); and
before a line break. Closing quotes and brackets stay with the sentence they close. The full-width colon and the
enumeration comma 、 end no sentence: the split cuts there inside one. An annotation (annotate.py) is never cut.
"""

from __future__ import annotations

from service.frontend.annotate import ANNOTATION_END, ANNOTATION_START
from service.frontend.incremental import CLOSERS, is_abbreviation, is_cjk

WIDE_ENDS = frozenset("。？！；")
ASCII_ENDS = frozenset(".?!;")


def cut_sentences(text: str) -> list[str]:
    """`text` cut after every sentence end; the pieces concatenate back to `text`. Blanks and line breaks between two
    sentences start the second one; blank pieces never occur on their own."""
    pieces: list[str] = []
    start = i = 0
    while i < len(text):
        ch = text[i]
        if ch == ANNOTATION_START and (close := text.find(ANNOTATION_END, i)) > 0:
            i = close + 1
            continue
        end = _end_at(text, i)
        if ch == "\n" and text[start:i].strip():
            pieces.append(text[start:i])
            start = i
        elif end is not None and text[start:end].strip():
            pieces.append(text[start:end])
            start = i = end
            continue
        i += 1
    if start < len(text):
        if pieces and not text[start:].strip():
            pieces[-1] += text[start:]
        else:
            pieces.append(text[start:])
    return pieces


def _end_at(text: str, i: int) -> int | None:
    """Index just past the sentence end starting at `i` (closers included), or None when `text[i]` ends none."""
    ch = text[i]
    if ch in WIDE_ENDS:
        return _past_closers(text, i + 1)
    if ch not in ASCII_ENDS:
        return None
    j = i + 1
    while j < len(text) and (text[j] in ASCII_ENDS or text[j] in CLOSERS):
        j += 1
    if j == len(text) or is_cjk(text[j]):
        return j
    if not text[j].isspace():
        return None  # 3.5, example.com, "?!" inside a word
    after = text[j : j + 4]
    if text[j - 1] != "." or j - i > 1 or is_cjk(after.lstrip()[:1] or " "):
        return j
    return None if is_abbreviation(text[max(0, i - 16) : i], after) else j


def _past_closers(text: str, j: int) -> int:
    while j < len(text) and text[j] in CLOSERS:
        j += 1
    return j
