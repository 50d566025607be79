"""CosyVoice2's text tokenizer (Qwen2 byte-level BPE + added tokens) built from the bundle's tokenizer.json on tiktoken."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

import tiktoken

from service.errors import BundleError
from service.layers.bpe import AddedToken, BpeSpec, normalize, ranks_from_json

log = logging.getLogger(__name__)

CHECK_FORMAT = 1  # bump when bpe.checked_order changes: cached check results of older code are then ignored
# One character of every kind the split pattern must keep (letters, marks, numbers, punctuation, symbols, spaces,
# controls, CJK, emoji sequences): a pattern that drops text would lose it silently, since tiktoken encodes matches only.
PATTERN_PROBE = (
    "aZ é\u0301ß ſK 9٣½Ⅳ ,.!?-—…()[]{}<>@#$%^&*_=+/\\|~`'S 'll 中文。日本語、한국어 😀👍🏽 x\u200dy"
    " \t\n\r\u00a0\u3000\u2028\u0085\x00\x7f \n\n  end"
)


class Qwen2Tokenizer:
    """Text -> ids exactly as `tokenizers` encodes with the same tokenizer.json (`Tokenizer.encode(text).ids`).

    Added tokens are split out first, leftmost-longest, as `tokenizers`' AddedVocabulary does: those with
    `normalized: false` on the raw text, then each remaining piece is normalized (NFC for Qwen2) and split on the
    `normalized: true` ones; the rest is Qwen2's regex split + byte-level BPE, run by tiktoken. Whether an added token
    is `special` does not change encoding (it only matters to decoding with skip_special_tokens)."""

    def __init__(self, spec: BpeSpec, sha256: str) -> None:
        self.sha256 = sha256
        self._spec = spec
        try:
            self._encoding = tiktoken.Encoding(
                name=f"qwen2-{sha256[:12]}",
                pat_str=spec.pattern,
                mergeable_ranks=spec.ranks,
                special_tokens={t.content: t.id for t in spec.added},
            )
        except (ValueError, TypeError) as e:  # tiktoken's Rust side reports a bad pattern or duplicate ranks so
            raise BundleError(f"tokenizer.json: tiktoken cannot use it: {e}") from e
        if self._encoding.decode(self._encoding.encode_ordinary(PATTERN_PROBE)) != PATTERN_PROBE:
            raise BundleError("tokenizer.json: the pre-tokenizer pattern does not match every character")
        self._raw = _matcher([t for t in spec.added if not t.normalized], None)
        self._normalized = _matcher([t for t in spec.added if t.normalized], spec.normalizer)
        self._raw_ids = {t.content: t.id for t in spec.added if not t.normalized}
        self._normalized_ids = {normalize(spec.normalizer, t.content): t.id for t in spec.added if t.normalized}
        self._to_rank = {token_id: rank for rank, token_id in spec.rank_to_id.items()}

    @classmethod
    def load(cls, path: str | Path, cache_dir: Path | None = None) -> Qwen2Tokenizer:
        """Read and check a tokenizer.json; BundleError if it is missing, malformed, or not reproducible exactly.

        The check of a full Qwen2 vocabulary takes about 1 s of a 2 s load; with a `cache_dir` its result is kept
        there (by the file's sha256) and later loads of the same file skip it."""
        p = Path(path)
        try:
            raw = p.read_bytes()
            data = json.loads(raw)
        except (OSError, ValueError) as e:
            raise BundleError(f"{p}: cannot read the tokenizer file: {e}") from e
        digest = hashlib.sha256(raw).hexdigest()
        unreachable = _cached_check(cache_dir, digest)
        spec = ranks_from_json(data, unreachable)
        if cache_dir is not None and unreachable is None:
            _store_check(cache_dir, digest, spec.unreachable)
        return cls(spec, digest)

    @property
    def n_vocab(self) -> int:
        """One more than the largest id (BPE tokens and added tokens)."""
        return int(self._encoding.n_vocab)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, nothing added around it (CosyVoice2's `tokenizer([text])['input_ids'][0]`)."""
        ids: list[int] = []
        for piece, added in _split(text, self._raw):
            if added:
                ids.append(self._raw_ids[piece])
                continue
            for part, norm_added in _split(normalize(self._spec.normalizer, piece), self._normalized):
                if norm_added:
                    ids.append(self._normalized_ids[part])
                else:
                    ids.extend(self._bpe(part))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (invalid UTF-8 byte runs replaced); added tokens come back as their content."""
        return str(self._encoding.decode([self._to_rank.get(i, i) for i in ids]))

    def _bpe(self, text: str) -> list[int]:
        ranks = self._encoding.encode_ordinary(text)
        if not self._spec.rank_to_id:
            return list(ranks)
        return [self._spec.rank_to_id.get(r, r) for r in ranks]


def _matcher(tokens: list[AddedToken], form: str | None) -> re.Pattern[str] | None:
    """Leftmost-longest over `tokens` (longest alternative first at each position, as aho-corasick LeftmostLongest)."""
    contents = sorted({normalize(form, t.content) for t in tokens}, key=lambda c: (-len(c), c))
    return re.compile("|".join(re.escape(c) for c in contents)) if contents else None


def _split(text: str, matcher: re.Pattern[str] | None) -> list[tuple[str, bool]]:
    """`text` as (piece, is an added token) in order; empty pieces left out."""
    if matcher is None:
        return [(text, False)] if text else []
    pieces: list[tuple[str, bool]] = []
    start = 0
    for match in matcher.finditer(text):
        if match.start() > start:
            pieces.append((text[start : match.start()], False))
        pieces.append((match.group(), True))
        start = match.end()
    if start < len(text):
        pieces.append((text[start:], False))
    return pieces


def _check_path(cache_dir: Path, digest: str) -> Path:
    return cache_dir / f"qwen2-tokenizer-{digest}.json"


def _cached_check(cache_dir: Path | None, digest: str) -> tuple[int, ...] | None:
    """The unreachable ids an earlier load of the file with this sha256 found, or None (not checked yet)."""
    if cache_dir is None:
        return None
    try:
        data = json.loads(_check_path(cache_dir, digest).read_text(encoding="utf-8"))
        if data.get("format") == CHECK_FORMAT and data.get("sha256") == digest:
            return tuple(int(i) for i in data["unreachable"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    return None


def _store_check(cache_dir: Path, digest: str, unreachable: tuple[int, ...]) -> None:
    """Record that the file with this sha256 passed the check (written whole or not at all)."""
    record = {"format": CHECK_FORMAT, "sha256": digest, "unreachable": list(unreachable)}
    tmp: Path | None = None
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=cache_dir, suffix=".tmp", delete=False, encoding="utf-8") as f:
            tmp = Path(f.name)
            json.dump(record, f)
        os.replace(tmp, _check_path(cache_dir, digest))
    except OSError as e:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        log.warning("tokenizer check not cached in %s: %s", cache_dir, e)
