"""A `tokenizers` byte-level BPE (tokenizer.json) as tiktoken ranks, checked to give the same ids as `tokenizers`."""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any

from service.errors import BundleError

SUPPORTED_NORMALIZERS = ("NFC", "NFD", "NFKC", "NFKD")
_FAR = 1 << 62  # "no such token" in the BPE walk


@dataclass(frozen=True)
class AddedToken:
    """A token matched in the text before BPE: on the raw text, or (normalized) on the normalized pieces."""

    content: str
    id: int
    normalized: bool


@dataclass(frozen=True)
class BpeSpec:
    """What tiktoken needs to reproduce one tokenizer.json: ranks, split pattern, normalizer form, added tokens."""

    pattern: str
    normalizer: str | None  # a unicodedata form, or None
    ranks: dict[bytes, int]
    rank_to_id: dict[int, int]  # only the ranks that differ from their token's id
    added: tuple[AddedToken, ...]
    unreachable: tuple[int, ...]  # vocabulary ids no merge sequence produces (left out of `ranks`)


def byte_symbols() -> dict[str, int]:
    """GPT-2's printable character -> byte table (byte-level BPE vocabularies spell bytes with these characters)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _field(data: Any, key: str, kind: type) -> Any:
    value = data.get(key) if isinstance(data, dict) else None
    if not isinstance(value, kind):
        raise BundleError(f"tokenizer.json: `{key}` missing or not a {kind.__name__}")
    return value


def read_normalizer(data: dict[str, Any]) -> str | None:
    """The normalizer's unicodedata form (NFC for Qwen2), or None; anything else is refused."""
    spec = data.get("normalizer")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind not in SUPPORTED_NORMALIZERS:
        raise BundleError(f"tokenizer.json: normalizer {spec!r} is not supported (only none or {SUPPORTED_NORMALIZERS})")
    return str(kind)


def read_pattern(data: dict[str, Any]) -> str:
    """The Split regex of Qwen2's pre-tokenizer: Sequence[Split(Regex, Isolated), ByteLevel(no prefix, no regex)]."""
    steps = data.get("pre_tokenizer", {}).get("pretokenizers") if isinstance(data.get("pre_tokenizer"), dict) else None
    if not isinstance(steps, list) or len(steps) != 2 or not all(isinstance(s, dict) for s in steps):
        raise BundleError("tokenizer.json: pre_tokenizer is not Qwen2's Split + ByteLevel sequence")
    split, byte_level = steps
    pattern = split.get("pattern")
    regex = pattern.get("Regex") if isinstance(pattern, dict) else None
    split_ok = split.get("type") == "Split" and split.get("behavior") == "Isolated" and not split.get("invert")
    level_ok = byte_level.get("type") == "ByteLevel" and not byte_level.get("add_prefix_space")
    if not (split_ok and isinstance(regex, str) and level_ok and not byte_level.get("use_regex")):
        raise BundleError("tokenizer.json: pre_tokenizer is not Qwen2's Split(Regex, Isolated) + ByteLevel sequence")
    return regex


def read_added(data: dict[str, Any]) -> tuple[AddedToken, ...]:
    """`added_tokens`; single_word / lstrip / rstrip change the matching and are refused (Qwen2 uses none)."""
    added = []
    for entry in _field(data, "added_tokens", list):
        content, token_id = entry.get("content"), entry.get("id")
        if not isinstance(content, str) or not content or not isinstance(token_id, int):
            raise BundleError(f"tokenizer.json: bad added token {entry!r}")
        if any(entry.get(k) for k in ("single_word", "lstrip", "rstrip")):
            raise BundleError(f"tokenizer.json: added token {content!r} uses single_word/lstrip/rstrip (not supported)")
        added.append(AddedToken(content, token_id, bool(entry.get("normalized", True))))
    return tuple(added)


def _check_pipeline(data: dict[str, Any], model: dict[str, Any]) -> None:
    """Refuse settings that would change the ids but that this runtime does not reproduce."""
    if model.get("type") != "BPE":
        raise BundleError(f"tokenizer.json: model type {model.get('type')!r}, expected BPE")
    if model.get("ignore_merges") or model.get("dropout") or model.get("continuing_subword_prefix"):
        raise BundleError("tokenizer.json: BPE with ignore_merges, dropout or a subword prefix is not supported")
    if model.get("end_of_word_suffix"):
        raise BundleError("tokenizer.json: BPE with an end-of-word suffix is not supported")
    post = data.get("post_processor")
    if post is not None and (not isinstance(post, dict) or post.get("type") != "ByteLevel"):
        raise BundleError(f"tokenizer.json: post_processor {post!r} would add tokens (only ByteLevel or none)")
    if data.get("truncation") is not None or data.get("padding") is not None:
        raise BundleError("tokenizer.json: truncation or padding is set")


def _vocab_bytes(vocab: dict[str, Any]) -> dict[str, bytes]:
    symbols = byte_symbols()
    if not set("".join(vocab)) <= symbols.keys() or not all(type(i) is int for i in vocab.values()) or "" in vocab:
        raise BundleError("tokenizer.json: the vocabulary is not byte-level BPE (GPT-2 byte symbols, integer ids)")
    if not symbols.keys() <= vocab.keys():
        raise BundleError("tokenizer.json: the vocabulary lacks some of the 256 byte symbols")
    to_latin1 = str.maketrans({c: chr(b) for c, b in symbols.items()})
    return {token: token.translate(to_latin1).encode("latin-1") for token in vocab}


def _merge_pairs(model: dict[str, Any], spelled: dict[str, bytes]) -> tuple[dict[tuple[bytes, bytes], int], list[bytes]]:
    """((left, right) bytes -> merge index, merged tokens by their first merge); a pair listed twice keeps its last
    index, as `tokenizers` does."""
    pairs: dict[tuple[bytes, bytes], int] = {}
    first: dict[bytes, None] = {}
    known, get = set(spelled.values()), spelled.get
    for index, merge in enumerate(_field(model, "merges", list)):
        parts = merge.split(" ") if type(merge) is str else merge
        left = right = None
        if type(parts) is list and len(parts) == 2:
            left, right = get(parts[0]), get(parts[1])
        if left is None or right is None or left + right not in known:
            raise BundleError(f"tokenizer.json: merge {index} {merge!r} is not two vocabulary tokens making a third")
        pairs[(left, right)] = index
        first.setdefault(left + right)
    return pairs, list(first)


def last_pair(token: bytes, order: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """S2(token): the two parts tiktoken's BPE of `token`'s bytes reaches before its last merge (None if it sticks).

    `order` ranks the merged tokens; merging the lowest-ranked adjacent pair, leftmost first, as tiktoken does."""
    get = order.get
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = _FAR, -1
        for i in range(len(parts) - 1):
            rank = get(parts[i] + parts[i + 1], _FAR)
            if rank < best:
                best, at = rank, i
        if at < 0:
            return None
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def checked_order(pairs: dict[tuple[bytes, bytes], int], tokens: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """(reachable merged tokens in rank order, unreachable ones) of `tokens` (merged tokens by first merge); BundleError
    when tiktoken cannot reproduce the merges.

    Why that suffices. `tokenizers` merges, in each pre-token, the adjacent pair with the lowest merge index among the
    pairs listed in `merges`, leftmost on ties (`models/bpe/word.rs`). tiktoken merges the adjacent pair whose
    concatenation has the lowest rank among all its tokens, leftmost on ties, and takes a whole pre-token that is a
    token at once. Rank the merged tokens in merge order and let S2(t) be the last two parts of tiktoken's BPE of t's
    own bytes (`last_pair`). Whenever adjacent parts x, y with x + y = t appear while tiktoken encodes any text, no merge
    has crossed their boundary, so the parts inside t's span went through a prefix of that same BPE of t: (x, y) =
    S2(t). So when S2(t) exists and is a listed merge for every t, and the listed indices of the S2 pairs rise with the
    ranks, both libraries see the same candidate pairs in the same order at every step, and the whole-token shortcut
    gives what BPE gives. A token whose BPE sticks before two parts is never formed by either (no rank for it). Qwen2's
    files pass by construction (each merge is the last step of the rank-limited BPE of its token, as the
    tiktoken-to-`tokenizers` converters write them), and so does the exporter's all-splits file from `qwen.tiktoken`.
    Token ids need not follow merge order: `ranks_from_json` re-deals the merged tokens' ids in merge order."""
    order = {t: i for i, t in enumerate(tokens)}
    reachable, unreachable, last_index = [], [], -1
    for token in tokens:
        pair = last_pair(token, order)
        if pair is None:
            unreachable.append(token)
            continue
        index = pairs.get(pair)
        if index is None:
            raise BundleError(
                f"tokenizer.json: the merges cannot be run as ranked BPE: {token!r} is formed from {pair!r}, "
                "which is not a listed merge"
            )
        if index < last_index:
            raise BundleError(f"tokenizer.json: the merges cannot be run as ranked BPE: {token!r} is merged out of order")
        reachable.append(token)
        last_index = index
    return reachable, unreachable


def ranks_from_json(data: Any, unreachable_ids: tuple[int, ...] | None = None) -> BpeSpec:
    """Everything tiktoken needs from a parsed tokenizer.json; BundleError for what it cannot reproduce exactly.

    `unreachable_ids` is `BpeSpec.unreachable` of an earlier check of the same file: the slow check is then skipped."""
    if not isinstance(data, dict):
        raise BundleError("tokenizer.json: not a JSON object")
    model = _field(data, "model", dict)
    _check_pipeline(data, model)
    vocab = _field(model, "vocab", dict)
    spelled = _vocab_bytes(vocab)
    ids = {spelled[token]: int(token_id) for token, token_id in vocab.items()}
    pairs, merged = _merge_pairs(model, spelled)
    if unreachable_ids is None:
        reachable, unreachable = checked_order(pairs, merged)
    else:
        skip = set(unreachable_ids)
        reachable = [t for t in merged if ids[t] not in skip] if skip else merged
        unreachable = [t for t in merged if ids[t] in skip] if skip else []
    ranks = {token: token_id for token, token_id in ids.items() if len(token) == 1}
    rank_to_id: dict[int, int] = {}
    for token, rank in zip(reachable, sorted(ids[t] for t in reachable), strict=True):
        ranks[token] = rank
        if rank != ids[token]:
            rank_to_id[rank] = ids[token]
    return BpeSpec(
        read_pattern(data),
        read_normalizer(data),
        ranks,
        rank_to_id,
        read_added(data),
        tuple(sorted(ids[t] for t in unreachable)),
    )


def normalize(form: str | None, text: str) -> str:
    """`text` in the tokenizer's normalization form (unchanged without one)."""
    return unicodedata.normalize(form, text) if form is not None else text  # type: ignore[arg-type]
