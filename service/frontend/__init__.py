"""Text frontend: text -> normalized sentences with whisper BPE ids (tiktoken, wetext, inflect; jieba and pypinyin data)."""

from service.frontend.frontend import FrontendOptions, NormalizeReport, Sentence, TextFrontend
from service.frontend.lexicon import DEFAULT_ENTRIES, InMemoryLexiconStore, Lexicon, LexiconStore, parse_entry
from service.frontend.lru import CacheStats
from service.frontend.rewrite import Rewrite

__all__ = [
    "DEFAULT_ENTRIES",
    "CacheStats",
    "FrontendOptions",
    "InMemoryLexiconStore",
    "Lexicon",
    "LexiconStore",
    "NormalizeReport",
    "Rewrite",
    "Sentence",
    "TextFrontend",
    "parse_entry",
]
