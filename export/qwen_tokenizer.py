"""The text tokenizer of the Qwen2-based families as one `tokenizer.json`: the checkpoint's Qwen2 BPE plus the family's
special tokens.

The official frontend loads `CosyVoice-BlankEN` with transformers' AutoTokenizer (a Qwen2TokenizerFast) and adds
its special tokens; this builds the same tokenizer with the `tokenizers` package alone, so the runtime needs
neither transformers nor torch.
"""

from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from export.onnx_io import ExportError

# transformers' Qwen2 pre-tokenizer pattern (tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json")


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies spell bytes with these characters)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken ranks file (`base64-token rank` per line) as token bytes -> rank."""
    ranks: dict[bytes, int] = {}
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}: not a tiktoken ranks file: {e}") from e
    return ranks


def bpe_from_ranks(ranks: dict[bytes, int]) -> models.BPE:
    """The BPE model tiktoken's ranks describe: each token of 2+ bytes is the merge of two ranked parts, applied in rank
    order (when several splits exist, the one whose parts rank lowest first)."""
    spell = _byte_symbols()

    def text(b: bytes) -> str:
        return "".join(spell[x] for x in b)

    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    vocab = {text(token): rank for token, rank in ranks.items()}
    return models.BPE(vocab, [(text(a), text(b)) for *_, a, b in merges], unk_token=None, byte_fallback=False)


def _qwen_pipeline(bpe: models.BPE) -> Tokenizer:
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _from_bpe_files(qwen_dir: Path) -> Tokenizer:
    """vocab.json + merges.txt with the Qwen2 pipeline (NFC, regex split, byte level), as transformers converts them."""
    return _qwen_pipeline(models.BPE.from_file(str(qwen_dir / "vocab.json"), str(qwen_dir / "merges.txt"), unk_token=None))


def dashscope_ranks() -> Path | None:
    """qwen.tiktoken of an installed `dashscope` package (the Qwen BPE ranks), if there is one."""
    spec = importlib.util.find_spec("dashscope")
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / "resources" / "qwen.tiktoken"
    return path if path.is_file() else None


def usable(path: Path) -> bool:
    """A tokenizer source: a tokenizer.json or *.tiktoken file, or a directory with tokenizer.json or vocab.json + merges.txt."""
    if path.is_file():
        return path.suffix in (".json", ".tiktoken")
    return (path / "tokenizer.json").is_file() or ((path / "vocab.json").is_file() and (path / "merges.txt").is_file())


def find_source(explicit: Path | None, qwen_dir: Path, *, random_init: bool) -> Path:
    """Where the text tokenizer comes from: `explicit` (a tokenizer.json, a qwen.tiktoken or a directory), else the
    checkpoint's CosyVoice-BlankEN (`qwen_dir`), else (random_init only) dashscope's qwen.tiktoken when installed."""
    for path in (explicit, qwen_dir, dashscope_ranks() if random_init else None):
        if path is not None and usable(path):
            return path
    raise ExportError(f"no Qwen2 tokenizer files (tokenizer.json, or vocab.json + merges.txt) in {qwen_dir}; pass --tokenizer")


def source_files(path: Path) -> list[Path]:
    """The files a tokenizer source reads (for the manifest's source hashes)."""
    if path.is_file():
        return [path]
    return [path / f for f in FILES if (path / f).is_file()]


def _config_tokens(qwen_dir: Path) -> list[tuple[int, dict[str, Any]]]:
    """(id, entry) of tokenizer_config.json's added_tokens_decoder, by id (empty without the file)."""
    path = qwen_dir / "tokenizer_config.json"
    if not path.is_file():
        return []
    try:
        decoder = json.loads(path.read_text(encoding="utf-8")).get("added_tokens_decoder", {})
        return sorted((int(i), dict(entry)) for i, entry in decoder.items())
    except (OSError, ValueError, TypeError) as e:
        raise ExportError(f"{path}: cannot read added_tokens_decoder: {e}") from e


def _add_config_tokens(tok: Tokenizer, qwen_dir: Path) -> None:
    for token_id, entry in _config_tokens(qwen_dir):
        content = str(entry["content"])
        if tok.token_to_id(content) is not None:
            continue
        if token_id != tok.get_vocab_size(with_added_tokens=True):
            raise ExportError(f"{qwen_dir}: added token {content!r} has id {token_id}, expected the next id")
        added = AddedToken(
            content,
            single_word=bool(entry.get("single_word", False)),
            lstrip=bool(entry.get("lstrip", False)),
            rstrip=bool(entry.get("rstrip", False)),
            normalized=bool(entry.get("normalized", False)),
            special=bool(entry.get("special", False)),
        )
        (tok.add_special_tokens if added.special else tok.add_tokens)([added])


def _load(source: Path) -> Tokenizer:
    if source.is_file() and source.suffix == ".tiktoken":
        return _qwen_pipeline(bpe_from_ranks(read_tiktoken_ranks(source)))
    if source.is_file():
        return Tokenizer.from_file(str(source))
    if (source / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(source / "tokenizer.json"))
    if (source / "vocab.json").is_file() and (source / "merges.txt").is_file():
        return _from_bpe_files(source)
    raise ExportError(f"{source}: no tokenizer.json and no vocab.json + merges.txt (the Qwen2 tokenizer files)")


def build_tokenizer(source: Path, special: tuple[str, ...]) -> Tokenizer:
    """A family's official tokenizer from a CosyVoice-BlankEN directory (tokenizer.json, or vocab.json + merges.txt,
    plus tokenizer_config.json's added tokens), a tokenizer.json, or Qwen's tiktoken ranks (qwen.tiktoken, then the
    Qwen2.5 added tokens are not there: only the family's), with the family's `special` tokens added in their order."""
    try:
        tok = _load(source)
    except ExportError:
        raise
    except Exception as e:  # tokenizers raises plain Exceptions for malformed files
        raise ExportError(f"{source}: cannot build the tokenizer: {e}") from e
    if source.is_dir():
        _add_config_tokens(tok, source)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    tok.no_padding()
    tok.no_truncation()
    return tok


def write_tokenizer(tokenizer: Tokenizer, path: Path) -> None:
    """Write a built tokenizer as one JSON file (deterministic: `tokenizers` serializes in a fixed order)."""
    tokenizer.save(str(path), pretty=False)
