"""Phase-1 frontend: official-equivalent normalization, splitting and whisper BPE ids vs the tiny fixtures."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import inflect
import pytest

from service.errors import BundleError, EmptyTextError
from service.frontend import Sentence, TextFrontend
from service.frontend.split import SplitOptions, split_paragraph
from service.frontend.steps import (
    contains_chinese,
    inflect_number_words,
    is_only_punctuation,
    remove_bracket,
    replace_blank,
    replace_corner_mark,
    spell_out_number,
    trailing_comma_to_period,
    zh_cleanup,
)
from service.frontend.tokenizer import WhisperTokenizer, whisper_special_tokens

# Known, accepted differences between the fixture's normalizer (wetext 0.0.4 + WeTextProcessing 1.2.0 rules)
# and ours (wetext 0.1.8 bundled rules). Each entry rewrites the fixture text into what 0.1.8 yields.
# - punctuation width: 1.2.0 turns full-width ，into , in sentences that contain a digit (README "Normalizer versions").
# - en date spacing: 1.2.0's English date verbalizer leaves a space before the comma that follows the month
#   ("january , twenty"); 0.1.8 does not. Whitespace only; not in the README's list, so it is listed here.
KNOWN_DIFFERENCES: dict[str, tuple[tuple[str, str], ...]] = {
    "zh_numbers_dates_english": ((",", "，"),),
    "zh_units_phone": ((",", "，"),),
    "en_numbers": (("january ,", "january,"),),
}


# Cases where an enhanced-mode fix applies (so enhanced output differs from the official one on purpose).
ENHANCED_FIXES: dict[str, tuple[tuple[str, str], ...]] = {
    "en_numbers": (("twelve point five dollars", "twelve dollars and fifty cents"),),  # money rule: $12.50
}


def _map_known(name: str, text: str, enhanced: bool = False) -> str:
    fixes = ENHANCED_FIXES.get(name, ()) if enhanced else ()
    for old, new in KNOWN_DIFFERENCES.get(name, ()) + fixes:
        assert old in text, (name, old)
        text = text.replace(old, new)
    return text


@pytest.fixture(scope="module")
def cases(ref_dir: Path) -> list[dict]:
    return json.loads((ref_dir / "tokenizer.json").read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="module")
def tokenizer_meta(ref_dir: Path) -> dict:
    return json.loads((ref_dir / "tokenizer.json").read_text(encoding="utf-8"))["tokenizer"]


@pytest.fixture(scope="module")
def official(ref_dir: Path) -> TextFrontend:
    return TextFrontend.load(ref_dir / "multilingual.tiktoken", enhanced=False)


def test_tokenizer_ids_exact_for_every_fixture_sentence(official: TextFrontend, cases: list[dict]) -> None:
    n = 0
    for case in cases:
        assert len(case["normalized_sentences"]) == len(case["ids"])
        for sentence, ids in zip(case["normalized_sentences"], case["ids"], strict=True):
            assert official.encode(sentence) == ids, case["name"]
            n += 1
        assert official.encode(case["text"]) == case["ids_of_raw_text_without_frontend"], case["name"]
    assert n == 14


def test_special_tokens_match_fixture(tokenizer_meta: dict, ref_dir: Path) -> None:
    assert whisper_special_tokens() == tokenizer_meta["special_tokens"]
    tok = WhisperTokenizer.load(ref_dir / "multilingual.tiktoken")
    assert tok.n_vocab == tokenizer_meta["n_vocab"] == 51866
    assert tok.sha256 == tokenizer_meta["tiktoken_file_sha256"]
    assert tok.encode("<|en|>Hello") == [50259, 15947]
    assert tok.encode("<|30.00|><|endoftext|>") == [51865, 50257]
    assert len(tok.encode("<|endofprompt|>")) == 8  # not special in this vocabulary


@pytest.mark.parametrize("enhanced", [False, True])
def test_normalized_sentences_match_fixture(ref_dir: Path, cases: list[dict], enhanced: bool) -> None:
    frontend = TextFrontend.load(ref_dir / "multilingual.tiktoken", enhanced=enhanced)
    mapped = []
    for case in cases:
        got = frontend.normalize(case["text"])
        expected = [_map_known(case["name"], s, enhanced) for s in case["normalized_sentences"]]
        assert got == expected, case["name"]
        joined = frontend.normalize(case["text"], split=False)
        assert joined == [_map_known(case["name"], case["normalized_joined"], enhanced)], case["name"]
        if expected != case["normalized_sentences"]:
            mapped.append(case["name"])
            continue
        # No normalization difference or fix applies: the full pipeline must give the fixture ids exactly.
        assert [list(s.ids) for s in frontend.sentences(case["text"])] == case["ids"], case["name"]
    # The mapping lists are exactly what was needed: no stale entry, no unexplained difference.
    assert sorted(mapped) == sorted(set(KNOWN_DIFFERENCES) | (set(ENHANCED_FIXES) if enhanced else set()))


def test_split_paragraph_zh_terminators_quotes_and_merge() -> None:
    assert split_paragraph("好", len, "zh") == ["好。"]
    assert split_paragraph("你好！！这是", len, "zh") == ["你好！这是。"]
    assert split_paragraph("他说：“走。”然后走了", len, "zh") == ["他说：“走。”然后走了。"]
    opts = SplitOptions(token_max_n=8, token_min_n=5, merge_len=3)
    assert split_paragraph("一二三四五六。七八九十。甲乙丙丁戊己。子", len, "zh", opts) == [
        "一二三四五六。",
        "七八九十。甲乙丙丁戊己。子。",
    ]
    assert split_paragraph("一二三四五六。七八九十甲乙。丙丁戊己庚辛。", len, "zh", opts) == [
        "一二三四五六。",
        "七八九十甲乙。",
        "丙丁戊己庚辛。",
    ]
    assert split_paragraph("a、b", len, "zh") == ["a、b。"]
    assert split_paragraph("", len, "zh") == []
    assert split_paragraph("。”好", len, "zh") == ["”好。"]  # the official code raises here; we keep the quote


def test_split_paragraph_en_measures_tokens(official: TextFrontend) -> None:
    def measure(text: str) -> int:
        return len(official.encode(text))

    assert split_paragraph("Hi", measure, "en") == ["Hi."]
    # Short pieces are merged back into one sentence; the quote stays after its period.
    assert split_paragraph('He said "go." Then: left', measure, "en") == ['He said "go." Then: left.']
    tight = SplitOptions(token_max_n=4, token_min_n=2, merge_len=1)
    assert split_paragraph('He said "go." Then: left', measure, "en", tight) == ['He said "go."', " Then: left."]
    long = " ".join(
        f"Sentence number {w} is here."
        for w in ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"] * 2
    )
    pieces = split_paragraph(long, measure, "en")
    assert "".join(pieces) == long
    assert len(pieces) == 2 and measure(pieces[0]) <= 80
    assert measure(pieces[0]) > 60 and measure(long) > 80


def test_zh_regex_steps() -> None:
    assert replace_blank("今天 去 park 散步 GPU is") == "今天去park散步GPU is"
    assert replace_blank(" a b ") == "a b"
    assert replace_corner_mark("5m²和3m³") == "5m平方和3m立方"
    assert remove_bracket("（括号）【方】`x`——y") == "括号方x y"
    assert trailing_comma_to_period("好，,、") == "好。"
    assert trailing_comma_to_period("好，的") == "好，的"
    assert zh_cleanup("第一行\nA - B.（注）") == "第一行A，B。注"
    assert zh_cleanup("第二行 - 三") == "第二行-三"  # blanks next to Han go first, so no dash rule
    assert contains_chinese("abc中") and not contains_chinese("こんにちは") and not contains_chinese("한국어")


def test_spell_out_number() -> None:
    words = inflect_number_words(inflect.engine())
    assert spell_out_number("I have 2 cats and 2024 dogs", words) == "I have two cats and two thousand and twenty-four dogs"
    assert spell_out_number("007", words) == "seven"
    assert spell_out_number("x12y3", words) == "xtwelveythree"
    too_long = "1" * 40  # inflect raises; read digit by digit instead
    assert spell_out_number(too_long, words) == " ".join(["one"] * 40)


def test_punctuation_only_pieces() -> None:
    assert is_only_punctuation("") and is_only_punctuation("。！？…“”") and is_only_punctuation("$+=")
    assert not is_only_punctuation("a。") and not is_only_punctuation("好")


def test_bypass_and_empty(official: TextFrontend) -> None:
    tagged = "<|en|>Hello 2 world。 second. "
    assert official.normalize(tagged) == [tagged]
    assert official.sentences(tagged) == [Sentence(tagged, tuple(official.encode(tagged)), source=tagged)]
    assert official.normalize("") == [""]
    for empty in ["", "   ", "。。！", "……", "<|en|>", "<|en|> 。"]:
        with pytest.raises(EmptyTextError):
            official.sentences(empty)


def test_sentences_carry_ids(official: TextFrontend) -> None:
    got = official.sentences("你好。Hello there 3 times")
    # zh path: wetext reads 3 as 三, then blanks next to non-ASCII characters are dropped.
    assert [s.text for s in got] == ["你好。Hello there三times。"]  # short pieces are merged
    for s in got:
        assert s.ids == tuple(official.encode(s.text))
    en = official.sentences("I have 3 apples.")
    # `source`: the written text a caption shows
    assert en == [Sentence("I have three apples.", tuple(official.encode("I have three apples.")), source="I have 3 apples.")]


def test_load_rejects_bad_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(BundleError):
        TextFrontend.load(tmp_path / "missing.tiktoken")
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("aGVsbG8= 0\n", encoding="utf-8")
    with pytest.raises(BundleError):
        TextFrontend.load(bad)
    garbage = tmp_path / "garbage.tiktoken"
    garbage.write_text("not a bpe file\n", encoding="utf-8")
    with pytest.raises(BundleError):
        TextFrontend.load(garbage)


def test_thread_safe(official: TextFrontend, cases: list[dict]) -> None:
    texts = [c["text"] for c in cases] * 4
    expected = [official.normalize(t) for t in texts]
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(official.normalize, texts))
    assert got == expected


def test_normalizer_info(official: TextFrontend) -> None:
    info = official.normalizer_info
    assert info["wetext"] == "0.1.8" and info["rules"] == "bundled"
    assert all(isinstance(v, str) for v in info.values())
