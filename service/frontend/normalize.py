"""Official-equivalent text normalization: wetext (bundled rules) plus the CosyVoice zh/en post-processing."""

from __future__ import annotations

import functools
import importlib.metadata
import re
import threading

import inflect
from wetext import Normalizer

from service.frontend.steps import inflect_number_words, spell_out_number, zh_cleanup

_DIGIT = re.compile(r"\d")


def wetext_info() -> dict[str, str]:
    """Which wetext build and rule files are in use (recorded by the service next to the model identity)."""
    info = {"normalizer": "wetext", "rules": "bundled"}
    for dist in ("wetext", "kaldifst"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist] = "unknown"
    return info


class OfficialNormalizer:
    """The `text_normalize` body of the official frontend, minus splitting: wetext, then the zh or en steps.

    wetext runs only when the text holds a digit (as wetext 0.0.4 did), with the language chosen the
    way 0.0.4 chose it (zh iff a Han character occurs). Thread-safe: the FST and inflect calls are serialized.
    """

    def __init__(self) -> None:
        self._zh = Normalizer(remove_erhua=False)
        self._en = Normalizer()
        self._inflect = inflect.engine()
        self._words = inflect_number_words(self._inflect)
        self._wetext_lock = threading.Lock()
        self._inflect_lock = threading.Lock()
        # inflect is slow and texts repeat small numbers; a bounded memo keeps long inputs cheap (docs/perf-log.md).
        self._memo_words = functools.lru_cache(maxsize=4096)(self._locked_words)

    def wetext(self, text: str, zh: bool) -> str:
        """wetext TN of `text` (unchanged when it has no digit, or when wetext fails on it)."""
        out = self.try_wetext(text, zh)
        return text if out is None else out

    def try_wetext(self, text: str, zh: bool) -> str | None:
        """wetext TN of `text`, or None when wetext fails (0.1.8's English rules assert on inputs like `0+`)."""
        if not _DIGIT.search(text):
            return text
        try:
            with self._wetext_lock:
                if zh:
                    return str(self._zh.normalize(text, lang="zh"))
                return str(self._en.normalize(text, lang="en"))
        except (AssertionError, RuntimeError, ValueError, IndexError, KeyError, UnicodeError):
            return None

    def zh(self, text: str) -> str:
        """Chinese path: wetext, then newline/blank/corner-mark/period/dash/bracket/trailing-comma steps."""
        return zh_cleanup(self.wetext(text, zh=True))

    def en(self, text: str) -> str:
        """Non-Chinese path: wetext, then every digit run spelled out with inflect."""
        return spell_out_number(self.wetext(text, zh=False), self.number_words)

    def number_words(self, digits: str) -> str:
        """inflect's English words for a run of digits (thread-safe: inflect keeps state while it works)."""
        return str(self._memo_words(digits))

    def _locked_words(self, digits: str) -> str:
        with self._inflect_lock:
            return self._words(digits)
