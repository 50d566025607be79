"""Pronunciation lexicon: word -> tone-numbered pinyin, kept in a pluggable store, with built-in defaults."""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from service.errors import InvalidInputError
from service.frontend.homophones import tone3

log = logging.getLogger(__name__)

MAX_WORD_CHARS = 16
_HAN_WORD = re.compile(rf"[\u4e00-\u9fff]{{1,{MAX_WORD_CHARS}}}")
_SYLLABLE = re.compile(r"[a-z]{1,6}[1-5]")

# Well-known polyphone traps, read the way standard Mandarin reads them in these words.
DEFAULT_ENTRIES: Mapping[str, str] = {
    "重庆": "chong2 qing4", "行长": "hang2 zhang3", "处长": "chu4 zhang3", "长大": "zhang3 da4",
    "重新": "chong2 xin1", "便宜": "pian2 yi2", "还款": "huan2 kuan3", "会计": "kuai4 ji4",
    "尽管": "jin3 guan3", "相处": "xiang1 chu3", "单于": "chan2 yu2", "可汗": "ke4 han2",
    "蚌埠": "beng4 bu4", "六安": "lu4 an1", "丽水": "li2 shui3", "乐清": "yue4 qing1",
    "厦门": "xia4 men2", "给予": "ji3 yu3", "供给": "gong1 ji3", "角色": "jue2 se4",
    "主角": "zhu3 jue2", "削弱": "xue1 ruo4", "剥削": "bo1 xue1", "宿舍": "su4 she4",
    "空调": "kong1 tiao2", "粘贴": "zhan1 tie1", "勉强": "mian3 qiang3", "传记": "zhuan4 ji4",
    "率领": "shuai4 ling3", "反省": "fan3 xing3", "茶几": "cha2 ji1", "投降": "tou2 xiang2",
    "朝鲜": "chao2 xian3", "血泊": "xue4 po1", "说服": "shuo1 fu2", "处方": "chu3 fang1",
    "曝光": "bao4 guang1", "大厦": "da4 sha4", "咀嚼": "ju3 jue2",
}  # fmt: skip


def parse_entry(word: str, pinyin: str, known_syllables: frozenset[str] | None = None) -> tuple[str, str]:
    """Validate one entry; returns (word, canonical pinyin `chong2 qing4`). Raises InvalidInputError."""
    word = word.strip()
    if not _HAN_WORD.fullmatch(word):
        raise InvalidInputError(f"lexicon word must be 1..{MAX_WORD_CHARS} Chinese characters, got {word!r}", param="word")
    syllables = [tone3(s) for s in pinyin.replace(",", " ").split()]
    if len(syllables) != len(word):
        raise InvalidInputError(f"{word!r} has {len(word)} characters but {len(syllables)} syllables", param="pinyin")
    bad = [s for s in syllables if not _SYLLABLE.fullmatch(s) or (known_syllables is not None and s not in known_syllables)]
    if bad:
        raise InvalidInputError(f"not a tone-numbered pinyin syllable: {', '.join(bad)}", param="pinyin")
    return word, " ".join(syllables)


@runtime_checkable
class LexiconStore(Protocol):
    """Where operator entries live (Redis shared by replicas, or memory). Values are canonical pinyin strings."""

    def get_all(self) -> dict[str, str]:
        """Every stored entry, word -> pinyin."""
        ...

    def put(self, word: str, pinyin: str) -> None:
        """Insert or replace one entry and change the version."""
        ...

    def delete(self, word: str) -> bool:
        """Remove one entry (True if it existed) and change the version when it did."""
        ...

    def version(self) -> str:
        """Opaque token that changes whenever the stored entries change (cheap to read)."""
        ...


class InMemoryLexiconStore:
    """Process-local LexiconStore (single replica, tests, or the fallback when Redis is off)."""

    def __init__(self, entries: Mapping[str, str] | None = None) -> None:
        self._entries = dict(entries or {})
        self._generation = 0
        self._lock = threading.Lock()

    def get_all(self) -> dict[str, str]:
        with self._lock:
            return dict(self._entries)

    def put(self, word: str, pinyin: str) -> None:
        with self._lock:
            self._entries[word] = pinyin
            self._generation += 1

    def delete(self, word: str) -> bool:
        with self._lock:
            if word not in self._entries:
                return False
            del self._entries[word]
            self._generation += 1
            return True

    def version(self) -> str:
        with self._lock:
            return f"mem:{self._generation}"


@dataclass(frozen=True)
class LexiconSnapshot:
    """The effective entries at one version: defaults overlaid with the store's entries."""

    version: str
    entries: Mapping[str, str] = field(default_factory=dict)


class Lexicon:
    """Validated access to a LexiconStore plus defaults; `snapshot()` re-reads the store only when its version moved."""

    def __init__(
        self,
        store: LexiconStore | None = None,
        defaults: Mapping[str, str] = DEFAULT_ENTRIES,
        known_syllables: frozenset[str] | None = None,
    ) -> None:
        self.store: LexiconStore = store if store is not None else InMemoryLexiconStore()
        self._known = known_syllables
        self._defaults = dict(parse_entry(w, p, known_syllables) for w, p in defaults.items())
        blob = "\n".join(f"{w}\t{p}" for w, p in sorted(self._defaults.items()))
        self._defaults_id = hashlib.sha256(blob.encode()).hexdigest()[:12]
        self._lock = threading.Lock()
        self._snapshot: LexiconSnapshot | None = None

    @property
    def defaults(self) -> dict[str, str]:
        return dict(self._defaults)

    def version(self) -> str:
        """Changes whenever the effective entries can have changed (part of the audio cache key)."""
        return f"{self._defaults_id}:{self.store.version()}"

    def put(self, word: str, pinyin: str) -> tuple[str, str]:
        """Validate and store an entry (overrides a default); returns the canonical (word, pinyin)."""
        entry = parse_entry(word, pinyin, self._known)
        self.store.put(*entry)
        return entry

    def delete(self, word: str) -> bool:
        """Remove an operator entry; a built-in default of the same word applies again."""
        return self.store.delete(word.strip())

    def get(self, word: str) -> str | None:
        return self.snapshot().entries.get(word.strip())

    def snapshot(self) -> LexiconSnapshot:
        """Effective entries; invalid stored values (e.g. written by another build) are skipped.

        If the store cannot be read (say Redis is down), synthesis goes on with the last entries read,
        or with the defaults alone, instead of failing the request.
        """
        try:
            version = self.version()
            with self._lock:
                if self._snapshot is not None and self._snapshot.version == version:
                    return self._snapshot
            stored = self.store.get_all()
        except Exception as e:  # the store's own error types (redis, network) are unknown here
            log.warning(
                "lexicon store unreadable, using %s: %s: %s",
                "last entries" if self._snapshot else "defaults",
                type(e).__name__,
                e,
            )
            return self._snapshot or LexiconSnapshot(f"{self._defaults_id}:unavailable", dict(self._defaults))
        snap = LexiconSnapshot(version=version, entries=self._merge(stored))
        with self._lock:
            self._snapshot = snap
        return snap

    def _merge(self, stored: Mapping[str, str]) -> dict[str, str]:
        entries = dict(self._defaults)
        for word, pinyin in stored.items():
            try:
                w, p = parse_entry(word, pinyin, self._known)
            except InvalidInputError:
                continue
            entries[w] = p
        return entries
