"""Pronunciation lexicon: validation, stores, jieba whole-word matching, single-reading rewrites, cache keys."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from pypinyin.pinyin_dict import pinyin_dict

from service.errors import InvalidInputError
from service.frontend import TextFrontend
from service.frontend.homophones import gb2312_level, tone3
from service.frontend.lexicon import DEFAULT_ENTRIES, InMemoryLexiconStore, Lexicon, LexiconStore, parse_entry


def _only_reading(ch: str) -> str | None:
    """The single tone-numbered reading of `ch` in pypinyin's data, None if it has several."""
    readings = {tone3(r) for r in pinyin_dict.get(ord(ch), "").split(",") if r}
    return readings.pop() if len(readings) == 1 else None


def _lexicon(fe: TextFrontend) -> Lexicon:
    assert fe.lexicon is not None
    return fe.lexicon


@pytest.fixture(scope="module")
def frontend(ref_dir: Path) -> TextFrontend:
    return TextFrontend.load(ref_dir / "multilingual.tiktoken")


def test_parse_entry_canonicalizes_and_validates() -> None:
    assert parse_entry(" 重庆 ", "Chóng Qìng") == ("重庆", "chong2 qing4")
    assert parse_entry("绿", "lü4") == ("绿", "lv4")
    assert parse_entry("行长", "hang2,zhang3") == ("行长", "hang2 zhang3")
    for word, pinyin in [("", "a1"), ("ab", "a1 b1"), ("重庆", "chong2"), ("重庆", "chong2 qing9"), ("重" * 17, "a1 " * 17)]:
        with pytest.raises(InvalidInputError):
            parse_entry(word, pinyin)
    with pytest.raises(InvalidInputError):
        parse_entry("重", "zzz2", known_syllables=frozenset({"chong2"}))


def test_in_memory_store_is_a_lexicon_store() -> None:
    store = InMemoryLexiconStore()
    assert isinstance(store, LexiconStore)
    v0 = store.version()
    store.put("重庆", "chong2 qing4")
    v1 = store.version()
    assert v1 != v0 and store.get_all() == {"重庆": "chong2 qing4"}
    assert store.delete("重庆") and not store.delete("重庆")
    assert store.version() not in (v0, v1) and store.get_all() == {}


def test_lexicon_defaults_overrides_and_versions() -> None:
    lex = Lexicon()
    assert lex.get("重庆") == "chong2 qing4" and len(lex.defaults) >= 24
    v0 = lex.version()
    lex.put("重庆", "zhong4 qing4")  # an operator entry overrides the default
    assert lex.get("重庆") == "zhong4 qing4" and lex.version() != v0
    assert lex.delete("重庆")
    assert lex.get("重庆") == "chong2 qing4"  # the default applies again
    assert not lex.delete("重庆")
    lex.store.put("坏", "not pinyin")  # bad data from elsewhere is ignored, not fatal
    assert lex.get("坏") is None


def test_defaults_are_well_formed() -> None:
    assert 24 <= len(DEFAULT_ENTRIES) <= 80
    for word, pinyin in DEFAULT_ENTRIES.items():
        assert parse_entry(word, pinyin) == (word, pinyin)


def test_issue_examples(frontend: TextFrontend) -> None:
    report = frontend.normalize_report("重庆银行的行长来了。")
    assert report.normalized == "崇庆银行的航掌来了。"
    assert [(r.word, r.replacement, r.start) for r in report.rewrites] == [("重庆", "崇庆", 0), ("行长", "航掌", 5)]
    assert report.sentences[0].ids == tuple(frontend.encode("崇庆银行的航掌来了。"))


def test_every_default_is_rewritten_with_single_reading_characters(frontend: TextFrontend) -> None:
    for word, pinyin in DEFAULT_ENTRIES.items():
        report = frontend.normalize_report(f"我说{word}。")
        hits = [r for r in report.rewrites if r.word == word]
        assert hits, word
        rewrite = hits[0]
        assert len(rewrite.replacement) == len(word)
        for orig, new, syllable in zip(word, rewrite.replacement, pinyin.split(), strict=True):
            if new != orig:  # a substitute is never polyphonic, always GB2312, and reads the wanted syllable
                assert _only_reading(new) == syllable, (word, new)
                assert gb2312_level(new) > 0
            elif _only_reading(orig) != syllable:  # kept for want of a single-reading substitute: flagged
                assert not rewrite.complete, (word, orig)
        # Every default can be fixed: each syllable is either forced or at least the character's default reading.
        for orig, new, syllable in zip(word, rewrite.replacement, pinyin.split(), strict=True):
            assert _only_reading(new) == syllable or tone3(pinyin_dict[ord(orig)].split(",")[0]) == syllable, word


def test_new_word_added_to_jieba_matches_as_a_whole(ref_dir: Path) -> None:
    fe = TextFrontend.load(ref_dir / "multilingual.tiktoken", lexicon_defaults={})
    text = "我们去长乐坊看看。"
    assert fe.normalize_report(text).rewrites == ()
    _lexicon(fe).put("长乐坊", "chang2 le4 fang1")
    report = fe.normalize_report(text)
    assert [r.word for r in report.rewrites] == ["长乐坊"]
    # A word inside a longer dictionary word is found too (重庆 in 重庆市), but not across jieba words.
    _lexicon(fe).put("重庆", "chong2 qing4")
    assert [r.word for r in fe.normalize_report("重庆市到了。").rewrites] == ["重庆"]
    _lexicon(fe).put("庆银", "qing4 yin2")
    assert "庆银" not in [r.word for r in fe.normalize_report("重庆银行到了。").rewrites]


def test_lexicon_change_takes_effect_at_once_despite_the_cache(frontend: TextFrontend) -> None:
    text = "他是我们的会长。"
    before = frontend.normalize_report(text)
    assert before.rewrites == () and frontend.normalize_report(text).cache_hit
    _lexicon(frontend).put("会长", "hui4 zhang3")
    after = frontend.normalize_report(text)
    assert not after.cache_hit and after.lexicon_version != before.lexicon_version
    assert [r.word for r in after.rewrites] == ["会长"] and after.sentences[0].ids != before.sentences[0].ids
    _lexicon(frontend).delete("会长")
    again = frontend.normalize_report(text)
    assert again.normalized == before.normalized and again.rewrites == ()


def test_two_instances_sharing_a_store_see_each_others_entries(ref_dir: Path) -> None:
    store = InMemoryLexiconStore()  # stands in for the shared Redis store
    a = TextFrontend.load(ref_dir / "multilingual.tiktoken", lexicon_store=store)
    b = TextFrontend.load(ref_dir / "multilingual.tiktoken", lexicon_store=store)
    text = "这位校长很好。"
    ids_before = b.sentences(text)[0].ids
    _lexicon(a).put("校长", "xiao4 zhang3")
    assert a.lexicon_version == b.lexicon_version
    assert b.sentences(text)[0].ids != ids_before
    assert b.normalize(text) == ["这位笑掌很好。"]  # 校 also reads jiao4, so it is replaced too


def test_official_mode_has_no_lexicon(ref_dir: Path) -> None:
    official = TextFrontend.load(ref_dir / "multilingual.tiktoken", enhanced=False)
    assert official.lexicon is None and official.lexicon_version == "off"
    assert official.normalize("重庆的行长。") == ["重庆的行长。"]


def test_concurrent_puts_and_reads(frontend: TextFrontend) -> None:
    errors: list[BaseException] = []

    def writer() -> None:
        for i in range(30):
            _lexicon(frontend).put("院长", "yuan4 zhang3" if i % 2 else "yuan4 chang2")

    def reader() -> None:
        try:
            for _ in range(30):
                out = frontend.normalize("我们的院长和处长。")[0]
                assert len(out) == len("我们的院长和处长。")
        except BaseException as e:  # collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    _lexicon(frontend).delete("院长")


class _FlakyStore(InMemoryLexiconStore):
    """An in-memory store that can be switched to fail like an unreachable Redis."""

    down = False

    def version(self) -> str:
        if self.down:
            raise ConnectionError("store unreachable")
        return super().version()

    def put(self, word: str, pinyin: str) -> None:
        if self.down:
            raise ConnectionError("store unreachable")
        super().put(word, pinyin)


def test_unreadable_store_keeps_last_entries() -> None:
    store = _FlakyStore()
    lex = Lexicon(store, defaults={"重庆": "chong2 qing4"})
    store.down = True
    assert lex.snapshot().entries == {"重庆": "chong2 qing4"}  # defaults only, no exception
    store.down = False
    lex.put("会长", "hui4 zhang3")
    assert lex.snapshot().entries["会长"] == "hui4 zhang3"
    store.down = True
    assert lex.snapshot().entries["会长"] == "hui4 zhang3"  # last entries read
    with pytest.raises(ConnectionError):
        lex.put("院长", "yuan4 zhang3")  # writes report the failure


def test_options_are_validated(ref_dir: Path) -> None:
    with pytest.raises(ValueError):
        TextFrontend.load(ref_dir / "multilingual.tiktoken", enhanced=False, max_sentence_tokens=4)
