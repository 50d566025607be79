"""Pinyin data from pypinyin: each character's readings and, per syllable, the best single-reading character."""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# Tone-marked letters as base letter + tone number (ü is written v, as in tone-numbered pinyin).
_TONE_MARKS = {
    "ā": "a1", "á": "a2", "ǎ": "a3", "à": "a4",
    "ē": "e1", "é": "e2", "ě": "e3", "è": "e4",
    "ī": "i1", "í": "i2", "ǐ": "i3", "ì": "i4",
    "ō": "o1", "ó": "o2", "ǒ": "o3", "ò": "o4",
    "ū": "u1", "ú": "u2", "ǔ": "u3", "ù": "u4",
    "ǖ": "v1", "ǘ": "v2", "ǚ": "v3", "ǜ": "v4",
    "ń": "n2", "ň": "n3", "ǹ": "n4",
    "m\u0304": "m1", "ḿ": "m2", "m\u0300": "m4",  # m̄ and m̀ have no precomposed form
    "ê\u0304": "ê1", "ế": "ê2", "ê\u030c": "ê3", "ề": "ê4",
}  # fmt: skip
_TONE_MARK = re.compile("|".join(sorted(_TONE_MARKS, key=len, reverse=True)))
_DIGIT = re.compile(r"\d")


def tone3(syllable: str) -> str:
    """Tone-mark or tone-number pinyin -> lower-case tone-number form with 5 for neutral (`lǜ` -> lv4, `ma` -> ma5).

    The first tone number found is kept and moved to the end; a "5" anywhere counts as no tone. Agrees with
    pypinyin's `to_tone3(s, neutral_tone_with_five=True)` on every well-formed syllable; anything else comes out
    as a string that is not a valid syllable either way.
    """
    s = syllable.strip().lower().replace("ü", "v").replace("u:", "v").replace("5", "")
    s = _TONE_MARK.sub(lambda m: _TONE_MARKS[m.group()], s)
    tones = _DIGIT.findall(s)
    return _DIGIT.sub("", s) + (tones[0] if tones else "5")


def pinyin_readings() -> dict[int, str]:
    """pypinyin's per-character data: code point -> comma-separated tone-marked readings ("zhōng,zhòng").

    Only pypinyin's `pinyin_dict.py` is run, under a private name: importing any pypinyin module would run the
    package `__init__`, which loads its ~55 MB phrase dictionary that nothing here uses.
    """
    package = importlib.util.find_spec("pypinyin")
    if package is None or not package.submodule_search_locations:
        raise ModuleNotFoundError("pypinyin is not installed")
    path = Path(next(iter(package.submodule_search_locations))) / "pinyin_dict.py"
    spec = importlib.util.spec_from_file_location("_cosyvoice_pinyin_dict", path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readings: dict[int, str] = module.pinyin_dict
    return readings


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
        # Interned: some 1,500 distinct syllables are shared by 21k characters (~1 MB less resident).
        for code, marks in pinyin_readings().items():
            if 0x4E00 <= code <= 0x9FFF:
                readings[chr(code)] = tuple(dict.fromkeys(sys.intern(tone3(m)) for m in marks.split(",")))
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
