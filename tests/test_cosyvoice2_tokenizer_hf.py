"""The serving Qwen2 tokenizer against `tokenizers` (export side) on many random texts, for the tokenizer.json files the
exporter writes: the official-layout tiny checkpoint's Qwen2 files, the full vocabulary from `qwen.tiktoken`, the test
checkpoint's few merges, and a trained BPE whose ids are shuffled."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizer_files import CASES, COSYVOICE2_TAGS, random_text, spell, tokenizer_json, write

from service.families.cosyvoice2.verify import verify_tokenizer
from service.layers.qwen_tokenizer import Qwen2Tokenizer

tokenizers = pytest.importorskip("tokenizers")
pytestmark = pytest.mark.export
REF_QWEN = CASES.parent / "CosyVoice-BlankEN"
TEXTS = 3000


def _exported(source: Path, out: Path) -> Path:
    from export.cosyvoice2 import tokenizer as exporter

    exporter.write_tokenizer(exporter.build_tokenizer(source), out)
    return out


@pytest.fixture(scope="module")
def ref_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/reference/tiny-cosyvoice2's CosyVoice-BlankEN (Qwen2's vocab.json + merges.txt) as the exporter writes it."""
    return _exported(REF_QWEN, tmp_path_factory.mktemp("ref") / "tokenizer.json")


@pytest.fixture(scope="module")
def full_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The full-size random-init export's tokenizer: every split of each `qwen.tiktoken` rank listed as a merge."""
    from export.cosyvoice2.tokenizer import dashscope_ranks

    ranks = dashscope_ranks()
    if ranks is None:
        pytest.skip("dashscope (qwen.tiktoken) is not installed")
    return _exported(ranks, tmp_path_factory.mktemp("full") / "tokenizer.json")


def _mismatches(path: Path, seed: int, tags: tuple[str, ...] = COSYVOICE2_TAGS) -> list[tuple[str, list[int], list[int]]]:
    ours, theirs = Qwen2Tokenizer.load(path), tokenizers.Tokenizer.from_file(str(path))
    rng = random.Random(seed)
    texts = [random_text(rng, tags) for _ in range(TEXTS)]
    pairs = [(t, ours.encode(t), theirs.encode(t).ids) for t in texts]
    return [p for p in pairs if p[1] != p[2]][:5]


def test_reference_qwen2_files_match_tokenizers(ref_json: Path) -> None:
    assert _mismatches(ref_json, seed=1) == []


def test_full_vocabulary_from_qwen_tiktoken_matches_tokenizers(full_json: Path) -> None:
    data = json.loads(full_json.read_text(encoding="utf-8"))
    assert len(data["model"]["vocab"]) == 151643 and len(data["model"]["merges"]) > 151643  # several splits per token
    assert _mismatches(full_json, seed=2) == []


def test_every_official_case_matches_exactly(ref_json: Path, full_json: Path) -> None:
    for path in (ref_json, full_json):
        checks = list(verify_tokenizer(Qwen2Tokenizer.load(path), CASES))
        assert len(checks) == 2 * len(json.loads(CASES.read_text(encoding="utf-8"))["cases"])
        assert [c.name for c in checks if not c.ok] == []


def test_test_checkpoint_tokenizer_matches_tokenizers(tmp_path: Path) -> None:
    from cosyvoice2_checkpoint import write_tokenizer_files

    write_tokenizer_files(tmp_path)
    path = _exported(tmp_path, tmp_path / "tokenizer.json")
    assert _mismatches(path, seed=3) == []


def test_trained_bpe_with_shuffled_ids_matches_tokenizers(tmp_path: Path) -> None:
    rng = random.Random(4)
    trained = tokenizers.Tokenizer(tokenizers.models.BPE())
    trained.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=2000, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    trained.train_from_iterator([random_text(rng, ()) for _ in range(3000)], trainer)
    model = json.loads(trained.to_str())["model"]
    tokens = list(model["vocab"])
    shuffled = list(range(len(tokens)))
    rng.shuffle(shuffled)
    data = tokenizer_json([], added=tuple((t, False) for t in COSYVOICE2_TAGS))
    data["model"]["vocab"] = dict(zip(tokens, shuffled, strict=True))
    data["model"]["merges"] = model["merges"]
    for i, token in enumerate(data["added_tokens"]):
        token["id"] = len(tokens) + i
    path = write(data, tmp_path / "tokenizer.json")
    ours = Qwen2Tokenizer.load(path)
    assert ours._spec.rank_to_id  # the ids really do not follow merge order
    assert _mismatches(path, seed=5) == []


def test_merges_ranked_bpe_cannot_reproduce_differ_in_tokenizers(tmp_path: Path) -> None:
    """Why the loader refuses such files (test_cosyvoice2_tokenizer.py): `tokenizers` keeps [a, bc] where tiktoken
    ranks would join them into "abc"."""
    data = tokenizer_json([("b", "c"), ("a", "b"), ("ab", "c")])
    theirs = tokenizers.Tokenizer.from_str(json.dumps(data))
    vocab = data["model"]["vocab"]
    assert theirs.encode("abc").ids == [ord("a"), vocab[spell("bc")]]
