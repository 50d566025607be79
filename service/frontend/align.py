"""Where a cut in the reading of a sentence falls in its written form (for the captions of a sentence spoken in pieces).

The reading and the writing share most characters (Chinese characters, letters, punctuation); numbers, symbols and
abbreviations differ. Characters are matched greedily in order, resynchronising within a window, so the work is
linear in the text. A cut maps to the written position of the next matched character: written text that has no
counterpart in the reading (the digits of a number read as words) stays with the piece before the cut.
"""

from __future__ import annotations

from collections.abc import Sequence

WINDOW = 48  # how far ahead a character is looked for when the two texts differ


def written_cuts(written: str, reading: str, cuts: Sequence[int]) -> list[int]:
    """For each position in `cuts` (increasing, 0..len(reading)), the position in `written` that corresponds."""
    matched = _match(written, reading)
    following = [len(written)] * (len(reading) + 1)
    for j in range(len(reading) - 1, -1, -1):
        following[j] = matched[j] if matched[j] >= 0 else following[j + 1]
    return [following[min(max(p, 0), len(reading))] for p in cuts]


def _match(written: str, reading: str) -> list[int]:
    """For each character of `reading`, the index of the written character matched to it, or -1 (increasing)."""
    out = [-1] * len(reading)
    i = j = 0
    while i < len(written) and j < len(reading):
        if written[i] == reading[j]:
            out[j] = i
            i += 1
            j += 1
            continue
        ahead_written = written.find(reading[j], i + 1, i + 1 + WINDOW)
        ahead_reading = reading.find(written[i], j + 1, j + 1 + WINDOW)
        if ahead_written < 0 and ahead_reading < 0:
            i += 1
            j += 1
        elif ahead_reading < 0 or (ahead_written >= 0 and ahead_written - i <= ahead_reading - j):
            i = ahead_written
        else:
            j = ahead_reading
    return out
