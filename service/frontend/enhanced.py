"""Enhanced normalization: input clean-up, rule fixes before wetext, and wetext run on bounded chunks."""

from __future__ import annotations

import functools

from service.frontend.mixed import protect, restore
from service.frontend.normalize import OfficialNormalizer
from service.frontend.rules import apply_rules, clean_input
from service.frontend.rules_en import en_rules
from service.frontend.rules_zh import ZH_LATE_RULES, ZH_RULES
from service.frontend.steps import spell_out_number, zh_cleanup

WETEXT_CHUNK_CHARS = 200  # wetext is slow per character; bounded chunks keep its cost linear in the text length
_BOUNDARIES = frozenset("。！？；!?;\n")
_SOFT_CUTS = frozenset(" ，,、：:")
_MIN_RETRY_CHARS = 8


def chunk_text(text: str, limit: int = WETEXT_CHUNK_CHARS) -> list[str]:
    """Split into pieces of at most `limit` characters, cutting after sentence ends, else at blanks/commas.

    A cut never falls between two ASCII digits unless a digit run itself is longer than `limit`.
    The pieces concatenate back to `text`.
    """
    chunks: list[str] = []
    cur_start = 0
    sentence_start = 0
    for i, ch in enumerate(text):
        if ch not in _BOUNDARIES and i + 1 < len(text):
            continue
        end = i + 1
        if end - cur_start > limit and sentence_start > cur_start:
            chunks.append(text[cur_start:sentence_start])
            cur_start = sentence_start
        while end - cur_start > limit:
            cut = _hard_cut(text, cur_start, cur_start + limit)
            chunks.append(text[cur_start:cut])
            cur_start = cut
        sentence_start = end
    if cur_start < len(text):
        chunks.append(text[cur_start:])
    return chunks


def _hard_cut(text: str, start: int, stop: int) -> int:
    """Best cut position in (start, stop]: after the last blank/comma, else a spot not inside a digit run."""
    middle = start + (stop - start) // 2  # a soft cut is only worth it in the second half of the window
    for j in range(stop, middle, -1):
        if text[j - 1] in _SOFT_CUTS and not _inside_digits(text, j):
            return j
    for j in range(stop, start, -1):
        if not _inside_digits(text, j):
            return j
    return stop


def _inside_digits(text: str, j: int) -> bool:
    return 0 < j < len(text) and text[j - 1].isascii() and text[j - 1].isdigit() and text[j].isascii() and text[j].isdigit()


class EnhancedNormalizer:
    """Official steps plus the fixes; returns the normalized text and the names of the rules that fired."""

    def __init__(self, base: OfficialNormalizer) -> None:
        self._base = base
        self._en_rules = en_rules(base.number_words, functools.lru_cache(maxsize=1024)(self._unit_words))

    def _unit_words(self, unit: str) -> str:
        """wetext's words for `unit` after a number (` km` -> kilometers, `°C` -> degrees Celsius); else `unit`."""
        read = self._base.try_wetext(f"2{unit}", zh=False)
        return read[len("two ") :] if read and read.startswith("two ") and read != f"two {unit.strip()}" else unit

    def clean(self, text: str) -> str:
        return clean_input(text)

    def zh(self, text: str) -> tuple[str, list[str]]:
        """Chinese path: English runs (mixed.py) read by the English path; the rest by the zh rules, wetext per chunk,
        digits wetext left read as numbers, the official clean-up."""
        protected, runs = protect(text)
        if not runs:
            return self._zh(text)
        english = [self.en(run) for run in runs]
        said, fired = self._zh(protected)
        restored = restore(said, [read for read, _ in english])
        if restored is None:  # a rule swallowed a slot: read the sentence as Chinese throughout
            return self._zh(text)
        return restored, fired + [name for _, names in english for name in names]

    def _zh(self, text: str) -> tuple[str, list[str]]:
        text, fired = apply_rules(ZH_RULES, text)
        text, late = apply_rules(ZH_LATE_RULES, self._wetext(text, zh=True))
        return zh_cleanup(text), fired + late

    def en(self, text: str) -> tuple[str, list[str]]:
        """Non-Chinese path: en rules, wetext per chunk, then digit runs spelled out."""
        text, fired = apply_rules(self._en_rules, text)
        return spell_out_number(self._wetext(text, zh=False), self._base.number_words), fired

    def _wetext(self, text: str, zh: bool) -> str:
        return "".join(self._wetext_chunk(chunk, zh) for chunk in chunk_text(text))

    def _wetext_chunk(self, chunk: str, zh: bool) -> str:
        """wetext on one chunk, keeping its outer blanks; where wetext fails, retry on halves down to 8 characters."""
        body = chunk.strip()
        if not body:
            return chunk
        lead = chunk[: len(chunk) - len(chunk.lstrip())]
        trail = chunk[len(chunk.rstrip()) :]
        out = self._base.try_wetext(body, zh)
        if out is None:
            if len(body) <= _MIN_RETRY_CHARS:
                out = body
            else:
                pieces = chunk_text(body, (len(body) + 1) // 2)
                out = "".join(self._wetext_chunk(p, zh) for p in pieces) if len(pieces) > 1 else body
        return lead + out + trail
