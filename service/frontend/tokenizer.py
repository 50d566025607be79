"""Whisper multilingual BPE tokenizer (the CosyVoice v1 text tokenizer) rebuilt with tiktoken, torch-free."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from service.errors import BundleError

# openai-whisper's pre-tokenizer regex.
WHISPER_PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# The 100 language tags in whisper's order (ids 50259..50358).
WHISPER_LANGUAGES: tuple[str, ...] = (
    "en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr", "pl", "ca", "nl", "ar", "sv", "it", "id", "hi", "fi", "vi",
    "he", "uk", "el", "ms", "cs", "ro", "da", "hu", "ta", "no", "th", "ur", "hr", "bg", "lt", "la", "mi", "ml", "cy", "sk",
    "te", "fa", "lv", "bn", "sr", "az", "sl", "kn", "et", "mk", "br", "eu", "is", "hy", "ne", "mn", "bs", "kk", "sq", "sw",
    "gl", "mr", "pa", "si", "km", "sn", "yo", "so", "af", "oc", "ka", "be", "tg", "sd", "gu", "am", "yi", "lo", "uz", "fo",
    "ht", "ps", "tk", "nn", "mt", "sa", "lb", "my", "bo", "tl", "mg", "as", "tt", "haw", "ln", "ha", "ba", "jw", "su", "yue",
)  # fmt: skip
BASE_VOCAB_SIZE = 50257  # mergeable ranks in multilingual.tiktoken
VOCAB_SIZE = 51866  # base + specials; equals the LLM's text_token_size
N_TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|> in steps of 0.02 s


class TextTokenizer(Protocol):
    """What the frontend needs of a model family's text tokenizer: ids of a text (special tokens allowed) and the
    hash of the file it was built from (reported by /info)."""

    @property
    def sha256(self) -> str: ...

    def encode(self, text: str) -> list[int]: ...


def whisper_special_tokens(first_id: int = BASE_VOCAB_SIZE) -> dict[str, int]:
    """Special token string -> id, in whisper's order (endoftext, sot, languages, tasks, timestamps)."""
    names = ["<|endoftext|>", "<|startoftranscript|>"]
    names += [f"<|{code}|>" for code in WHISPER_LANGUAGES]
    names += ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
    names += [f"<|{i * 0.02:.2f}|>" for i in range(N_TIMESTAMPS)]
    return {name: first_id + i for i, name in enumerate(names)}


class WhisperTokenizer:
    """Text -> whisper BPE ids, exactly `whisper.tokenizer.get_tokenizer(multilingual=True).encode(t, allowed_special='all')`."""

    def __init__(self, encoding: tiktoken.Encoding, sha256: str) -> None:
        self._encoding = encoding
        self.sha256 = sha256

    @classmethod
    def load(cls, path: str | Path) -> WhisperTokenizer:
        """Read `multilingual.tiktoken`; raises BundleError if the file is missing or not the whisper vocabulary."""
        p = Path(path)
        try:
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
            # expected_hash makes tiktoken's on-disk cache re-read the file when it changes at the same path.
            ranks = load_tiktoken_bpe(str(p), expected_hash=digest)
        except (OSError, ValueError) as e:
            raise BundleError(f"{p}: cannot read the tokenizer file: {e}") from e
        if len(ranks) != BASE_VOCAB_SIZE or set(ranks.values()) != set(range(BASE_VOCAB_SIZE)):
            raise BundleError(f"{p}: expected {BASE_VOCAB_SIZE} BPE ranks 0..{BASE_VOCAB_SIZE - 1}, found {len(ranks)}")
        encoding = tiktoken.Encoding(
            name=p.name,
            pat_str=WHISPER_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=whisper_special_tokens(),
            explicit_n_vocab=VOCAB_SIZE,
        )
        return cls(encoding, digest)

    @property
    def n_vocab(self) -> int:
        return int(self._encoding.n_vocab)

    def encode(self, text: str) -> list[int]:
        """BPE ids of `text`; special-token strings such as `<|en|>` become their single ids."""
        if "<|" not in text:
            # Same ids as below (no special token can occur), without passing the 1,609-entry special set every call.
            return list(self._encoding.encode_ordinary(text))
        return list(self._encoding.encode(text, allowed_special="all"))

    def decode(self, ids: list[int]) -> str:
        """Inverse of encode (invalid UTF-8 byte runs are replaced)."""
        return str(self._encoding.decode(ids))
