"""The frontend's lean text data: Segmenter cuts as jieba (HMM off), pinyin data without pypinyin's package, RSS budget."""

from __future__ import annotations

import ast
import json
import logging
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jieba
import pytest
from pypinyin.contrib.tone_convert import to_tone3
from pypinyin.pinyin_dict import pinyin_dict

from service.frontend.homophones import pinyin_readings, tone3
from service.frontend.lexicon import DEFAULT_ENTRIES
from service.frontend.segment import Segmenter, jieba_dictionary

TESTS = Path(__file__).parent
REPO = TESTS.parent

# Words added to both segmenters: new ones, ones inside dictionary words, an existing word re-weighted, one with ASCII,
# one deleted (frequency 0), and one first added then restored to its old frequency, as LexiconRewriter._sync does.
ADDED: list[tuple[str, int | None]] = [
    *((w, None) for w in DEFAULT_ENTRIES),
    ("长乐坊", None), ("庆银", None), ("江大桥", None), ("AI芯片", None), ("量子纠缠态", None),
    ("南京市", 5), ("大桥", 0), ("长乐坊", 0), ("市长", 300000),
]  # fmt: skip


@pytest.fixture(scope="module")
def ours() -> Segmenter:
    return Segmenter.load()


@pytest.fixture(scope="module")
def reference() -> jieba.Tokenizer:
    jieba.setLogLevel(logging.WARNING)
    tokenizer = jieba.Tokenizer()
    tokenizer.initialize()
    return tokenizer


def _cut(tokenizer: jieba.Tokenizer, text: str) -> list[str]:
    return list(tokenizer.cut(text, HMM=False))


def _golden_texts() -> list[str]:
    texts: list[str] = []
    for path in sorted((TESTS / "data" / "frontend").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                case = json.loads(line)
                texts += [case["text"], case["expected"]]
    return texts


def _lexicon_test_texts() -> list[str]:
    """Every string constant holding a Han character in the lexicon tests, and each default entry in a sentence."""
    texts = [f"我说{word}。" for word in DEFAULT_ENTRIES]
    for path in [TESTS / "test_frontend_lexicon.py", *sorted(TESTS.glob("test_lexicon_*.py"))]:
        constants = [n.value for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, ast.Constant)]
        texts += [c for c in constants if isinstance(c, str) and any("\u4e00" <= ch <= "\u9fff" for ch in c)]
    return texts


def _random_texts(n: int, seed: int = 20240611) -> Iterator[str]:
    """Mixed strings: dictionary words (so real words overlap), common hanzi, ASCII runs, punctuation, whitespace."""
    rng = random.Random(seed)
    hanzi = [bytes([hi, lo]).decode("gb2312") for hi in range(0xB0, 0xD8) for lo in range(0xA1, 0xFF) if (hi, lo) < (0xD7, 0xFA)]
    lines = jieba_dictionary().read_text(encoding="utf-8").splitlines()
    words = [line.split(" ")[0] for line in rng.sample(lines, 20000)]
    pieces = [
        lambda: rng.choice(words),
        lambda: rng.choice(hanzi),
        lambda: "".join(rng.choices("abcxyzABCXYZ0123456789", k=rng.randint(1, 4))),
        lambda: rng.choice(list("，。！？、；：“”（）《》.,!?;:'\"()-_%#&+@/~…·")),
        lambda: rng.choice([" ", "  ", "\t", "\n", "\r\n", "\u3000"]),
    ]
    for _ in range(n):
        chosen = rng.choices(pieces, weights=[5, 5, 2, 2, 1], k=rng.randint(1, 30))
        yield "".join(piece() for piece in chosen)


def test_dictionary_table_is_jiebas(ours: Segmenter, reference: jieba.Tokenizer) -> None:
    assert ours.nbytes < 12_000_000
    assert len(ours._keys) == len(reference.FREQ)
    assert ours.char_frequencies() == {w: f for w, f in reference.FREQ.items() if len(w) == 1}
    rng = random.Random(1)
    probes = [*rng.sample(sorted(reference.FREQ), 5000), "BP", "偂", "4s", "猴", "", "不存在的词语", "z"]
    assert [ours.frequency(w) for w in probes] == [reference.FREQ.get(w, 0) for w in probes]


def test_cut_equals_jieba_on_golden_and_lexicon_texts(ours: Segmenter, reference: jieba.Tokenizer) -> None:
    texts = _golden_texts() + _lexicon_test_texts()
    assert len(texts) > 300
    for text in texts:
        assert ours.cut(text) == _cut(reference, text), text


def test_cut_equals_jieba_on_random_mixed_text(ours: Segmenter, reference: jieba.Tokenizer) -> None:
    for text in _random_texts(3000):
        assert ours.cut(text) == _cut(reference, text), text


def test_add_word_matches_jieba() -> None:
    ours = Segmenter.load()
    jieba.setLogLevel(logging.WARNING)
    reference = jieba.Tokenizer()
    reference.initialize()
    texts = _golden_texts() + _lexicon_test_texts() + list(_random_texts(500, seed=7))
    texts += ["南京市长江大桥上的AI芯片", "量子纠缠态和长乐坊", "重庆银行的行长来了。"]
    for word, freq in ADDED:
        ours.add_word(word, freq)
        reference.add_word(word, freq)
        assert ours.frequency(word) == reference.FREQ.get(word, 0), word
    assert ours._total == reference.total
    assert ours.char_frequencies() == {w: f for w, f in reference.FREQ.items() if len(w) == 1}
    for text in texts:
        assert ours.cut(text) == _cut(reference, text), text
    prefixes = {w[:i] for w, _ in ADDED for i in range(1, len(w) + 1)}
    assert {w: ours.frequency(w) for w in prefixes} == {w: reference.FREQ.get(w, 0) for w in prefixes}


def test_cut_keeps_every_character() -> None:
    seg = Segmenter.load(jieba_dictionary())
    for text in ["", " ", "\r\n\r\n", "a1 b2", "重庆市长江大桥。Hello, 世界!"]:
        assert "".join(seg.cut(text)) == text


RSS_SCRIPT = r"""
import json, sys
from service.frontend.segment import Segmenter

def rss_kb():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1])

before = rss_kb()
seg = Segmenter.load()
print(json.dumps({"added_mb": (rss_kb() - before) / 1024, "table_mb": seg.nbytes / 2**20}))
"""


def test_building_the_segmenter_adds_less_than_15_mb_rss() -> None:
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT], cwd=REPO, capture_output=True, text=True, check=True, timeout=120)
    result = json.loads(out.stdout)
    assert result["table_mb"] < 12
    assert result["added_mb"] < 15, result


# TextFrontend.load builds the homophone table (pinyin data) and the segmenter: neither may pull in pypinyin's
# package (its __init__ loads the ~55 MB phrase dictionary) nor build a jieba.Tokenizer (~60 MB).
IMPORT_SCRIPT = r"""
import json, sys
import service.frontend
from service.frontend import TextFrontend

TextFrontend.load(sys.argv[1])
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("pypinyin", "jieba"))))
"""


def test_frontend_loads_without_the_pypinyin_and_jieba_packages(tiny_bundle: Path) -> None:
    tokenizer = str(tiny_bundle / "multilingual.tiktoken")
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_SCRIPT, tokenizer], cwd=REPO, capture_output=True, text=True, check=True, timeout=120
    )
    modules = json.loads(out.stdout)
    assert "pypinyin.phrases_dict" not in modules
    assert modules == []


def _pypinyin_tone3(syllable: str) -> str:
    """What homophones.tone3 did before it stopped importing pypinyin."""
    s = syllable.strip().lower().replace("ü", "v").replace("u:", "v")
    s = str(to_tone3(s, neutral_tone_with_five=True))
    return s if s[-1:].isdigit() else s + "5"


def test_pinyin_readings_are_pypinyins_data() -> None:
    assert pinyin_readings() == pinyin_dict


def test_tone3_equals_pypinyin_on_every_reading() -> None:
    readings = {r for marks in pinyin_dict.values() for r in marks.split(",")}
    assert len(readings) > 1400
    assert {r: tone3(r) for r in readings} == {r: _pypinyin_tone3(r) for r in readings}
    variants = [v for r in sorted(readings) for v in (r.upper(), f" {r} ", _pypinyin_tone3(r), _pypinyin_tone3(r)[:-1])]
    assert [tone3(v) for v in variants] == [_pypinyin_tone3(v) for v in variants]
    examples = {"lǜ": "lv4", "lü4": "lv4", "lu:4": "lv4", "ma": "ma5", "ma5": "ma5", "zho1ng": "zhong1", "m\u0304": "m1"}
    assert {s: tone3(s) for s in examples} == examples


def test_tone3_accepts_and_rejects_exactly_as_pypinyin() -> None:
    """On malformed input the strings may differ, but a lexicon entry is valid with one iff valid with the other."""
    valid = re.compile(r"[a-z]{1,6}[1-5]")
    rng = random.Random(3)
    alphabet = list("abcdefghijklmnopqrstuvwxyzü0123456789 :-'AZ") + list("āáǎàēéěèīíǐìōóǒòūúǔùǖǘǚǜńňǹḿếềê\u0304\u0300\u030c")
    samples = ["".join(rng.choices(alphabet, k=rng.randint(0, 7))) for _ in range(20000)]
    for s in samples:
        ours, theirs = tone3(s), _pypinyin_tone3(s)
        assert bool(valid.fullmatch(ours)) == bool(valid.fullmatch(theirs)), s
        if valid.fullmatch(ours):
            assert ours == theirs, s
