"""Long text (split + hard cap, nothing dropped or repeated), robustness on arbitrary Unicode, cache and report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.errors import EmptyTextError
from service.frontend import TextFrontend
from service.frontend.lru import LRUCache
from service.frontend.split import cap_tokens
from service.frontend.steps import is_only_punctuation
from service.frontend.tokenizer import WhisperTokenizer

MAX_TOKENS = 24
HAN = "天地人你我他山水火木金土日月星风云雨雪花"
LETTERS = "abcdefgXYZ"
PUNCT = '，。！？；：、,.!?;: “”"（）【】—…'


@pytest.fixture(scope="module")
def tokenizer(ref_dir: Path) -> WhisperTokenizer:
    return WhisperTokenizer.load(ref_dir / "multilingual.tiktoken")


@pytest.fixture(scope="module")
def capped(ref_dir: Path) -> TextFrontend:
    # No lexicon defaults, so characters are never substituted and can be counted.
    return TextFrontend.load(ref_dir / "multilingual.tiktoken", lexicon_defaults={}, max_sentence_tokens=MAX_TOKENS)


def _count(tokenizer: WhisperTokenizer):  # type: ignore[no-untyped-def]
    return lambda s: len(tokenizer.encode(s))


def test_cap_prefers_commas_then_blanks(tokenizer: WhisperTokenizer) -> None:
    count = _count(tokenizer)
    text = "，".join(["天地人你我他山水火木"] * 6) + "。"
    pieces = cap_tokens(text, 40, count)
    assert "".join(pieces) == text and len(pieces) > 1
    assert all(count(p) <= 40 for p in pieces)
    assert all(p.endswith(("，", "。")) for p in pieces)  # every cut is at a comma
    words = " ".join(["alpha", "beta", "gamma", "delta"] * 20)
    pieces = cap_tokens(words, 16, count)
    assert "".join(pieces) == words and all(count(p) <= 16 for p in pieces)
    assert all(p.startswith(" ") for p in pieces[1:])  # cut before a blank, not inside a word
    assert cap_tokens("短句。", 16, count) == ["短句。"]
    with pytest.raises(ValueError):
        cap_tokens("x", 4, count)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=300), max_tokens=st.integers(8, 48))
def test_cap_is_a_partition(tokenizer: WhisperTokenizer, text: str, max_tokens: int) -> None:
    text = text.encode("utf-8", "ignore").decode("utf-8")  # the pipeline removes lone surrogates before this
    count = _count(tokenizer)
    pieces = cap_tokens(text, max_tokens, count)
    assert "".join(pieces) == text
    assert all(count(p) <= max_tokens for p in pieces)


def test_long_text_without_terminators_is_capped(capped: TextFrontend) -> None:
    text = "，".join(HAN[i % len(HAN)] * (3 + i % 5) for i in range(300))  # ~1,800 characters, no sentence end
    sentences = capped.sentences(text)
    assert len(sentences) > 10
    assert all(0 < len(s.ids) <= MAX_TOKENS for s in sentences)
    assert "".join(c for s in sentences for c in s.text if c in HAN) == "".join(c for c in text if c in HAN)


# A Thai letter with stacked combining marks, from the Big List of Naughty Strings (issue 40: kept a server busy)
NAUGHTY_THAI = "ด้้้้้็็็็็้้้้้็็็็็้้้้้้้้็็็็็้้้้้็็็็็้้้้้้้้็็็็็้้้้้็็็็็้้้้้้้้็็็็็้้้้้็็็็็"


@pytest.mark.parametrize(
    "text",
    [
        (NAUGHTY_THAI * 60)[:4096],  # "words" of dozens of combining marks, no blank, no punctuation
        " ".join(["alpha", "beta", "gamma", "delta"] * 300),  # words without a single punctuation mark
        HAN * 200,  # characters without one
    ],
    ids=["combining-marks", "words", "han"],
)
def test_text_without_punctuation_is_cut_into_bounded_sentences(capped: TextFrontend, text: str) -> None:
    sentences = capped.sentences(text)
    assert len(sentences) > 10
    assert all(0 < len(s.ids) <= MAX_TOKENS for s in sentences)
    spoken = "".join(s.text for s in sentences).replace(" ", "")
    assert spoken.rstrip("。.") == text.replace(" ", "")  # nothing dropped or repeated (the split adds a full stop)


@pytest.mark.parametrize("tags", ["<|en|>", "<|en|><|laughter|>"])
def test_tagged_text_over_the_cap_is_cut_and_each_piece_keeps_its_tags(capped: TextFrontend, tags: str) -> None:
    """Text with `<|...|>` tags skips normalization (the official bypass) but not the cap: an LLM reply tagged
    `<|en|>` of a thousand words, or the naughty string behind a tag, becomes sentences within the cap, each told
    its language."""
    for body in (" ".join(["alpha", "beta", "gamma", "delta"] * 250), (NAUGHTY_THAI * 40)[:2000]):
        sentences = capped.sentences(tags + body)
        assert len(sentences) > 10
        assert all(0 < len(s.ids) <= MAX_TOKENS and s.text.startswith(tags) for s in sentences)
        assert "".join(s.text[len(tags) :] for s in sentences) == body
    short = capped.sentences(tags + "Hello there, friend.")
    assert [s.text for s in short] == [tags + "Hello there, friend."]  # within the cap: one piece, as before


def _speakable_chars(text: str) -> str:
    return "".join(c for c in text if c in HAN or c in LETTERS)


@settings(max_examples=120, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(HAN + LETTERS + PUNCT), max_size=400))
def test_nothing_dropped_or_repeated(capped: TextFrontend, text: str) -> None:
    try:
        sentences = capped.sentences(text)
    except EmptyTextError:
        assert _speakable_chars(text) == ""
        return
    # Sentences come in order and together hold every speakable character exactly once.
    assert "".join(_speakable_chars(s.text) for s in sentences) == _speakable_chars(text)
    assert all(0 < len(s.ids) <= MAX_TOKENS for s in sentences)


MIXED = st.text(
    alphabet=st.one_of(
        st.characters(),
        st.sampled_from("0123456789０１２３.,-:%/¥$€@ 年月日点号电话"),
        st.sampled_from(HAN + "重庆行长儿呃啊😀👍🏽\u200d\ufe0f\x00\u200b\r\n\t<|>"),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(text=MIXED)
def test_arbitrary_unicode_never_raises_nor_yields_empty_sentences(capped: TextFrontend, text: str) -> None:
    try:
        sentences = capped.sentences(text)
    except EmptyTextError:
        return
    assert sentences
    for s in sentences:
        assert s.ids and s.text.strip() and not is_only_punctuation(s.text.strip())
        assert s.ids == tuple(capped.encode(s.text))
        assert len(s.ids) <= MAX_TOKENS  # tagged text (the bypass) too: it is cut when over the cap


def test_lru_cache_evicts_and_counts() -> None:
    cache: LRUCache[str, int] = LRUCache(2)
    calls: list[str] = []

    def compute(key: str) -> int:
        calls.append(key)
        return len(key)

    assert cache.get_or_compute("a", lambda: compute("a"))[:2] == (1, False)
    assert cache.get_or_compute("a", lambda: compute("a"))[:2] == (1, True)
    cache.get_or_compute("bb", lambda: compute("bb"))
    cache.get_or_compute("a", lambda: compute("a"))  # a becomes most recent
    cache.get_or_compute("ccc", lambda: compute("ccc"))  # evicts bb
    assert cache.get_or_compute("bb", lambda: compute("bb"))[1] is False
    assert calls == ["a", "bb", "ccc", "bb"]
    stats = cache.stats()
    assert (stats.size, stats.capacity, stats.hits, stats.misses) == (2, 2, 2, 4) and stats.miss_seconds >= 0
    off: LRUCache[str, int] = LRUCache(0)
    off.get_or_compute("a", lambda: 1)
    assert off.get_or_compute("a", lambda: 1)[1] is False


def test_report_is_timed_cached_and_serializable(ref_dir: Path) -> None:
    fe = TextFrontend.load(ref_dir / "multilingual.tiktoken")
    text = "重庆的GPT-4售价$25.50，联系电话13800138000。"
    first = fe.normalize_report(text)
    assert not first.cache_hit and first.elapsed_ms > 0
    second = fe.normalize_report(text)
    assert second.cache_hit and second.elapsed_ms == 0 and second.sentences == first.sentences
    assert first.language == "zh" and first.enhanced
    assert {"money", "word_hyphen_number", "code_after_keyword"} <= set(first.rules)
    assert [r.word for r in first.rewrites] == ["重庆"]
    assert first.token_counts == tuple(len(s.ids) for s in first.sentences)
    data = json.loads(json.dumps(first.as_dict(), ensure_ascii=False))
    assert data["total_tokens"] == sum(first.token_counts) and data["sentences"][0]["text"] == first.sentences[0].text
    assert data["rewrites"][0]["replacement"] == "崇庆"
    stats = fe.cache_stats()
    assert stats.hits >= 1 and stats.misses >= 1


def test_empty_report_does_not_raise(capped: TextFrontend) -> None:
    report = capped.normalize_report("😀 。。")
    assert report.sentences == () and report.token_counts == ()
    with pytest.raises(EmptyTextError):
        capped.sentences("😀 。。")
