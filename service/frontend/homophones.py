"""Pinyin data from pypinyin: each character's readings and, per syllable, the best single-reading character."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pypinyin.contrib.tone_convert import to_tone3
from pypinyin.pinyin_dict import pinyin_dict


def tone3(syllable: str) -> str:
    """Tone-mark or tone-number pinyin -> lower-case tone-number form with 5 for neutral (`lǜ` -> lv4, `ma` -> ma5)."""
    s = syllable.strip().lower().replace("ü", "v").replace("u:", "v")
    s = str(to_tone3(s, neutral_tone_with_five=True))
    return s if s[-1:].isdigit() else s + "5"


def gb2312_level(ch: str) -> int:
    """1 for the 3,755 most common hanzi (GB2312 level 1), 2 for the other 3,008 of GB2312, 0 otherwise."""
    try:
        encoded = ch.encode("gb2312")
    except UnicodeEncodeError:
        return 0
    if len(encoded) != 2 or encoded[0] < 0xB0:
        return 0
    return 1 if encoded[0] <= 0xD7 else 2


@dataclass(frozen=True)
class HomophoneTable:
    """Readings per Han character and, per tone-numbered syllable, the monophonic characters (best first)."""

    readings: Mapping[str, tuple[str, ...]]
    by_syllable: Mapping[str, tuple[str, ...]]

    @classmethod
    def build(cls, char_frequency: Mapping[str, int]) -> HomophoneTable:
        """Index pypinyin's character data; candidates are GB2312 hanzi, level 1 first, then by `char_frequency`."""
        readings: dict[str, tuple[str, ...]] = {}
        for code, marks in pinyin_dict.items():
            if 0x4E00 <= code <= 0x9FFF:
                readings[chr(code)] = tuple(dict.fromkeys(tone3(m) for m in marks.split(",")))
        groups: dict[str, list[str]] = {}
        for ch, syls in readings.items():
            # Rare characters are left out: the LLM has seen too little of them to read them reliably.
            if len(syls) == 1 and gb2312_level(ch):
                groups.setdefault(syls[0], []).append(ch)
        ranked = {
            syl: tuple(sorted(chars, key=lambda c: (gb2312_level(c), -char_frequency.get(c, 0), c)))
            for syl, chars in groups.items()
        }
        return cls(readings=readings, by_syllable=ranked)

    @property
    def syllables(self) -> frozenset[str]:
        """Every tone-numbered syllable that some character can be read as."""
        return frozenset(s for syls in self.readings.values() for s in syls)

    def is_only_reading(self, ch: str, syllable: str) -> bool:
        """True if `syllable` is the one and only reading of `ch`."""
        return self.readings.get(ch) == (syllable,)

    def spell(self, ch: str, syllable: str) -> tuple[str, bool]:
        """Character to write for `ch` read as `syllable`, and whether that character has no other reading.

        Order: `ch` itself if it reads only `syllable`; else the best common (GB2312 level 1) single-reading
        character; else `ch` if `syllable` is its default (first) reading; else a level-2 one; else `ch`.
        """
        if self.is_only_reading(ch, syllable):
            return ch, True
        candidates = self.by_syllable.get(syllable, ())
        if candidates and gb2312_level(candidates[0]) == 1:
            return candidates[0], True
        if self.readings.get(ch, ("",))[0] == syllable:
            return ch, False
        if candidates:
            return candidates[0], True
        return ch, False
