"""TextFrontend: text -> normalized sentences with the model's text token ids (the official frontend, torch-free)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from service.errors import EmptyTextError
from service.frontend.enhanced import EnhancedNormalizer
from service.frontend.lexicon import DEFAULT_ENTRIES, Lexicon, LexiconSnapshot, LexiconStore
from service.frontend.lru import CacheStats, LRUCache
from service.frontend.normalize import OfficialNormalizer, wetext_info
from service.frontend.pipeline import Normalized, Pipeline
from service.frontend.rewrite import LexiconRewriter, Rewrite
from service.frontend.split import MIN_CAP_TOKENS
from service.frontend.steps import is_only_punctuation
from service.frontend.tokenizer import TextTokenizer, WhisperTokenizer

_SPECIAL_TAG = re.compile(r"<\|[^<>|]{0,32}\|>")
OFFICIAL_LEXICON_VERSION = "off"


@dataclass(frozen=True)
class Sentence:
    """One unit of synthesis: the text as it will be spoken, its BPE ids, and the silence after its audio.

    `source` is the written text it was read from (markup removed): what a caption shows. `rate` is the speed factor
    SSML `<prosody rate>` asked for (the same for every sentence of one text). Only a pause before any text (leading
    silence) gives a sentence with empty `text` and `ids`: it is always the first one, and it must not be sent to the
    engine.
    """

    text: str
    ids: tuple[int, ...]
    pause_after_s: float = 0.0
    source: str = ""
    rate: float = 1.0


@dataclass(frozen=True)
class FrontendOptions:
    """enhanced=False is the official frontend (no fixes, no lexicon, no cap); the cap counts BPE tokens."""

    enhanced: bool = True
    max_sentence_tokens: int = 200
    cache_size: int = 1024

    def __post_init__(self) -> None:
        if self.max_sentence_tokens < MIN_CAP_TOKENS:
            raise ValueError(f"max_sentence_tokens must be >= {MIN_CAP_TOKENS}, got {self.max_sentence_tokens}")
        if self.cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {self.cache_size}")


@dataclass(frozen=True)
class NormalizeReport:
    """What will be spoken for one input, and how it got there (served by /v1/normalize)."""

    text: str
    language: str  # "zh", "en" or "bypass"
    enhanced: bool
    normalized: str  # whole normalized text before sentence splitting
    sentences: tuple[Sentence, ...]
    rules: tuple[str, ...]  # enhanced normalization rules that changed the text
    rewrites: tuple[Rewrite, ...]  # lexicon words rewritten into single-reading characters
    lexicon_version: str
    elapsed_ms: float  # time spent normalizing (0 when served from the cache)
    cache_hit: bool

    @property
    def token_counts(self) -> tuple[int, ...]:
        return tuple(len(s.ids) for s in self.sentences)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (ids included per sentence)."""
        data = asdict(self)
        data["sentences"] = [
            {"text": s.text, "source": s.source, "ids": list(s.ids), "tokens": len(s.ids), "pause_after_s": s.pause_after_s}
            for s in self.sentences
        ]
        data["token_counts"] = list(self.token_counts)
        data["total_tokens"] = sum(self.token_counts)
        return data


class TextFrontend:
    """CosyVoice SFT frontend. Thread-safe; build it once with `load()` and share it."""

    def __init__(self, tokenizer: TextTokenizer, pipeline: Pipeline, options: FrontendOptions, lexicon: Lexicon | None):
        self._tokenizer = tokenizer
        self._pipeline = pipeline
        self._options = options
        self._lexicon = lexicon
        self._cache: LRUCache[tuple[str, str, bool], tuple[Normalized, tuple[Sentence, ...]]] = LRUCache(options.cache_size)

    @classmethod
    def load(
        cls,
        tokenizer_path: str | Path | TextTokenizer,
        enhanced: bool = True,
        *,
        lexicon_store: LexiconStore | None = None,
        lexicon_defaults: Mapping[str, str] | None = None,
        max_sentence_tokens: int = 200,
        cache_size: int = 1024,
    ) -> TextFrontend:
        """Build from the bundle's `multilingual.tiktoken` (a path), or over a family's own tokenizer (CosyVoice2's
        Qwen2 BPE); raises BundleError if the file is unusable.

        enhanced=True (serving default): normalization fixes, lexicon rewriting (`lexicon_store`, in memory when
        None, over `lexicon_defaults`, the built-in polyphone entries when None), and a hard cap of
        `max_sentence_tokens` per sentence. enhanced=False: the official frontend.
        """
        options = FrontendOptions(enhanced, max_sentence_tokens, cache_size)
        tokenizer = WhisperTokenizer.load(tokenizer_path) if isinstance(tokenizer_path, str | Path) else tokenizer_path
        official = OfficialNormalizer()
        if not enhanced:
            return cls(tokenizer, Pipeline(tokenizer, official), options, None)
        rewriter = LexiconRewriter.create()
        defaults = DEFAULT_ENTRIES if lexicon_defaults is None else lexicon_defaults
        lexicon = Lexicon(lexicon_store, defaults, known_syllables=rewriter.syllables)
        pipeline = Pipeline(tokenizer, official, EnhancedNormalizer(official), rewriter, max_sentence_tokens)
        return cls(tokenizer, pipeline, options, lexicon)

    @property
    def options(self) -> FrontendOptions:
        return self._options

    @property
    def normalizer_info(self) -> dict[str, str]:
        """Normalizer identity for logs and the service's info endpoint."""
        mode = "enhanced" if self._options.enhanced else "official"
        return {**wetext_info(), "mode": mode, "tokenizer_sha256": self._tokenizer.sha256}

    @property
    def lexicon(self) -> Lexicon | None:
        """The pronunciation lexicon (None in official mode)."""
        return self._lexicon

    @property
    def lexicon_version(self) -> str:
        """Changes whenever lexicon entries change; put it in audio cache keys."""
        return self._lexicon.version() if self._lexicon is not None else OFFICIAL_LEXICON_VERSION

    def encode(self, text: str) -> list[int]:
        """The tokenizer's ids of `text` as is (special tokens allowed, as the official frontend encodes)."""
        return self._tokenizer.encode(text)

    def normalize(self, text: str, split: bool = True) -> list[str]:
        """Normalized sentences (split=True) or the whole normalized text as one item (split=False)."""
        normalized, _ = self._result(text)
        return list(normalized.pieces) if split else [normalized.joined]

    def sentences(self, text: str, captions: bool = False) -> list[Sentence]:
        """Sentences ready for the engine (a leading pause may come first); EmptyTextError when nothing is speakable.
        With `captions` (timed captions) no sentence holds more than one written sentence; InvalidInputError for
        markup that cannot be honoured."""
        out = list(self.normalize_report(text, captions).sentences)
        if not any(s.ids for s in out):
            raise EmptyTextError("the text has nothing to speak after normalization", param="input")
        return out

    def normalize_report(self, text: str, captions: bool = False) -> NormalizeReport:
        """Sentences, token counts, rules fired and lexicon rewrites for `text` (never raises on empty text)."""
        lexicon = self._lexicon.snapshot() if self._lexicon is not None else None
        (normalized, sentences), hit, seconds = self._cached(text, lexicon, captions)
        return NormalizeReport(
            text=text,
            language=normalized.language,
            enhanced=self._options.enhanced,
            normalized=normalized.joined,
            sentences=sentences,
            rules=normalized.rules,
            rewrites=normalized.rewrites,
            lexicon_version=lexicon.version if lexicon is not None else OFFICIAL_LEXICON_VERSION,
            elapsed_ms=seconds * 1000.0,
            cache_hit=hit,
        )

    def cache_stats(self) -> CacheStats:
        return self._cache.stats()

    def _result(self, text: str) -> tuple[Normalized, tuple[Sentence, ...]]:
        lexicon = self._lexicon.snapshot() if self._lexicon is not None else None
        return self._cached(text, lexicon)[0]

    def _cached(
        self, text: str, lexicon: LexiconSnapshot | None, captions: bool = False
    ) -> tuple[tuple[Normalized, tuple[Sentence, ...]], bool, float]:
        version = lexicon.version if lexicon is not None else OFFICIAL_LEXICON_VERSION

        def compute() -> tuple[Normalized, tuple[Sentence, ...]]:
            normalized = self._pipeline.run(text, lexicon, captions)
            return normalized, self._assemble(normalized)

        return self._cache.get_or_compute((text, version, captions), compute)

    def _assemble(self, normalized: Normalized) -> tuple[Sentence, ...]:
        """Speakable pieces with their ids; the pause after an unspeakable piece moves to the sentence before."""
        pauses = normalized.pauses or (0.0,) * len(normalized.pieces)
        shown = normalized.shown or normalized.pieces
        out: list[Sentence] = []
        lead = normalized.lead_pause_s
        for piece, pause, source in zip(normalized.pieces, pauses, shown, strict=True):
            if _speakable(piece):
                out.append(Sentence(piece, tuple(self._tokenizer.encode(piece)), pause, source, normalized.rate))
            elif out:
                out[-1] = replace(out[-1], pause_after_s=out[-1].pause_after_s + pause)
            else:
                lead += pause
        return (Sentence("", (), lead), *out) if lead > 0 else tuple(out)


def _speakable(sentence: str) -> bool:
    """Something other than blanks, punctuation, symbols and `<|tag|>` markers is left to read."""
    bare = "".join(_SPECIAL_TAG.sub("", sentence).split())
    return not is_only_punctuation(bare)
