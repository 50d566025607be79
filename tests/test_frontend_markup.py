"""Markdown and pause markup in the enhanced frontend: golden cases, pauses as silence, and properties."""

from __future__ import annotations

from pathlib import Path

import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.errors import EmptyTextError, InvalidInputError
from service.frontend import Sentence, TextFrontend
from service.frontend.markup import strip_markdown
from service.frontend.pauses import MAX_PAUSE_S, MAX_TOTAL_PAUSE_S, mark_pauses


@pytest.fixture(scope="module")
def enhanced(ref_dir: Path) -> TextFrontend:
    return TextFrontend.load(ref_dir / "multilingual.tiktoken", lexicon_defaults={})


@pytest.fixture(scope="module")
def official(ref_dir: Path) -> TextFrontend:
    return TextFrontend.load(ref_dir / "multilingual.tiktoken", enhanced=False)


MARKDOWN = [
    ("# Title\nSome text\n- item one\n- item two", "Title.\nSome text.\nitem one.\nitem two."),
    ("Intro\n## Sub ##\n1. first\n2) second", "Intro.\nSub.\nfirst.\nsecond."),
    (
        "**bold**, *it*, __b__, _i_ and ~~gone~~ stay; snake_case and 2*3 too",
        "bold, it, b, i and gone stay; snake underscore case and two times three too.",
    ),
    ("See [the docs](https://example.com/a_b) and ![a cat](cat.png).", "See the docs and a cat."),
    ("Run `make_it_so` now.", "Run make_it_so now."),
    ("Before\n```python\nprint('x')\n```\nAfter", "Before.\nAfter."),
    ("> quoted words\n> - quoted item", "quoted words.\nquoted item."),
    ("| name | age |\n|---|:--:|\n| Ann | 5 |", "name, age.\nAnn, five."),  # each row is a sentence, read on its own
    ("Title\n=====\nbody\n\n---\n\n- [x] done", "Title.\nbody.\n\n\ndone."),
    ("<speak>Hello <emphasis>there</emphasis></speak>", "Hello there."),
    ("## 标题\n正文**加粗**，`代码`。\n- 苹果\n- 香蕉", "标题。正文加粗，代码。苹果。香蕉。"),
    ("中文**粗体**中文", "中文粗体中文。"),
]


@pytest.mark.parametrize(("text", "expected"), MARKDOWN)
def test_markdown_is_not_read(enhanced: TextFrontend, text: str, expected: str) -> None:
    assert "".join(enhanced.normalize(text)) == expected


def test_official_mode_reads_markup_as_before(official: TextFrontend) -> None:
    # enhanced=False is the official frontend: no markup handling, no pauses.
    assert official.normalize("# Title **x** [pause]", split=False) == ["# Title **x** [pause]"]
    assert all(s.pause_after_s == 0.0 for s in official.sentences('你好<break time="1s"/>世界'))


def _shape(sentences: list[Sentence]) -> list[tuple[str, float, bool]]:
    return [(s.text, s.pause_after_s, bool(s.ids)) for s in sentences]


PAUSES = [
    ('Hello <break time="500ms"/> world.', [("Hello.", 0.5, True), ("world.", 0.0, True)]),
    ("Hello <break time='1.5s'/>world.", [("Hello.", 1.5, True), ("world.", 0.0, True)]),
    ('Hi<break/>world<BREAK strength="strong" />again', [("Hi.", 0.5, True), ("world.", 1.0, True), ("again.", 0.0, True)]),
    ("你好[pause 300ms]世界[Pause 2s]", [("你好。", 0.3, True), ("世界。", 2.0, True)]),
    ("[pause 1s]你好", [("", 1.0, False), ("你好。", 0.0, True)]),
    ('<break time="1s"/> <break time="2s"/>Hi', [("", 3.0, False), ("Hi.", 0.0, True)]),
    ("Hi[pause 99s]there", [("Hi.", MAX_PAUSE_S, True), ("there.", 0.0, True)]),
    ('Hi<break time="soon"/>there[pause]', [("Hi.", 0.5, True), ("there.", 0.5, True)]),
    ("你好。[pause 1s]。[pause 1s]世界", [("你好。", 2.0, True), ("世界。", 0.0, True)]),
    ("- one [pause 1s]\n- two", [("one.", 1.0, True), ("two.", 0.0, True)]),
    ("```\n[pause 1s]\n```\nHi", [("", 1.0, False), ("Hi.", 0.0, True)]),
]


@pytest.mark.parametrize(("text", "expected"), PAUSES)
def test_pause_markup_becomes_silence(enhanced: TextFrontend, text: str, expected: list[tuple[str, float, bool]]) -> None:
    assert _shape(enhanced.sentences(text)) == expected


def test_pause_report_and_empty_text(enhanced: TextFrontend) -> None:
    report = enhanced.normalize_report("[pause 1s]Hi[pause 2s]there")
    assert [s["pause_after_s"] for s in report.as_dict()["sentences"]] == [1.0, 2.0, 0.0]
    assert report.normalized == "Hi there"  # before sentence splitting
    with pytest.raises(EmptyTextError):
        enhanced.sentences("[pause 1s]<break/>")


def test_total_pause_is_bounded() -> None:
    _, pauses = mark_pauses("a[pause 10s]" * 20)
    assert sum(pauses) == MAX_TOTAL_PAUSE_S and max(pauses) == MAX_PAUSE_S and pauses[-1] == 0.0


def test_plain_text_keeps_its_sentences(enhanced: TextFrontend) -> None:
    # Characters that are markup only in position stay text elsewhere (and wetext reads them as before).
    text = "Use a_b_c and 3 * 4 or #tag."
    assert strip_markdown(text) == text
    assert "".join(enhanced.normalize(text)) == "Use a underscore b underscore c and three times four or hash tag."


# ---- markup that changes the reading: [pinyin], <sub>, <prosody rate>; what is refused -------------------------
@pytest.mark.parametrize(
    ("text", "said", "shown"),
    [
        ("重庆[chong2]到了。", "崇庆到了。", "重庆到了。"),  # 重 (zhong4/chong2) is the character that reads chong2
        ("重庆[chong2 qing4]到了。", "崇庆到了。", "重庆到了。"),
        ("银行[hang2]到了。", "银航到了。", "银行到了。"),  # hang2 goes to 行, not to the last character by position
        ("银行[háng]到了。", "银航到了。", "银行到了。"),  # tone marks too
        ("重[chong2]新开始。", "崇新开始。", "重新开始。"),
    ],
)
def test_pinyin_markup_gives_the_reading_and_its_digits_are_never_numbers(
    enhanced: TextFrontend, text: str, said: str, shown: str
) -> None:
    (sentence,) = enhanced.sentences(text, captions=True)
    assert (sentence.text, sentence.source) == (said, shown)
    assert not any(n in sentence.text for n in "一二"), "a tone number was read as a number"


@pytest.mark.parametrize(
    ("text", "named"), [("重庆[chong9]到了", "chong9"), ("重庆[xyz2]到了", "xyz2"), ("好[ni3 hao3]", "2 syllables")]
)
def test_pinyin_markup_that_is_no_pinyin_is_refused(enhanced: TextFrontend, text: str, named: str) -> None:
    with pytest.raises(InvalidInputError, match=named):
        enhanced.sentences(text)


def test_brackets_that_are_no_pinyin_stay_text(enhanced: TextFrontend) -> None:
    # capitals that fit no character before them are a code or a citation; capitals that fit one are pinyin
    assert enhanced.normalize("见表[A1]，文献[1]，第[Q3]季度", split=False) == ["见表[A一]，文献[一]，第[Q三]季度"]
    assert enhanced.normalize("重庆[Chong2]到了", split=False) == ["崇庆到了"]


def test_sub_reads_the_alias_and_captions_show_the_written_text(enhanced: TextFrontend) -> None:
    (zh,) = enhanced.sentences('<sub alias="世界贸易组织">WTO</sub>成立于1995年。', captions=True)
    assert (zh.text, zh.source) == ("世界贸易组织成立于一九九五年。", "WTO成立于1995年。")
    (en,) = enhanced.sentences("<speak><sub alias='World Health Organization'>WHO</sub> said so.</speak>")
    assert (en.text, en.source) == ("World Health Organization said so.", "WHO said so.")


@pytest.mark.parametrize(
    ("text", "rate"),
    [
        ('<prosody rate="x-fast">你好。</prosody>', 2.0),
        ("<speak><prosody rate='150%'>Hello.</prosody> <prosody rate='150%'>World.</prosody></speak>", 1.5),
        ('<prosody rate="-20%">慢一点。</prosody>', 0.8),
        ('<prosody rate="1.2">Hi.</prosody>', 1.2),
        ("<prosody>Hi.</prosody>", 1.0),
        ("Hi.", 1.0),
    ],
)
def test_prosody_rate_covering_the_whole_text_sets_its_speed(enhanced: TextFrontend, text: str, rate: float) -> None:
    sentences = enhanced.sentences(text)
    assert [s.rate for s in sentences] == [rate] * len(sentences)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('Hi <prosody rate="slow">there</prosody>.', "<prosody rate> must cover all the text"),
        ('<prosody rate="slow">Hi.</prosody><prosody rate="fast">There.</prosody>', "<prosody rate> must cover"),
        ('<prosody pitch="high">Hi.</prosody>', "<prosody pitch>"),
        ('<prosody rate="fast" volume="loud">Hi.</prosody>', "<prosody volume>"),
        ('<prosody rate="9">Hi.</prosody>', "factor of 9"),
        ('<prosody rate="quick">Hi.</prosody>', "is not a rate"),
        ('<phoneme alphabet="py" ph="chong2">重</phoneme>庆', "<phoneme>"),
    ],
)
def test_ssml_that_cannot_be_honoured_is_refused_naming_the_element(enhanced: TextFrontend, text: str, named: str) -> None:
    with pytest.raises(InvalidInputError, match=regex.escape(named)):
        enhanced.sentences(text)


# ---- properties ---------------------------------------------------------------------------------
WORD = st.one_of(
    st.text(alphabet="abcdefghjkmnopqrstuwyz", min_size=1, max_size=8),
    st.text(alphabet="你好世界我们天气今日学习中文朋友音乐", min_size=1, max_size=6),
)
INLINE = ["{}", "**{}**", "*{}*", "__{}__", "_{}_", "`{}`", "~~{}~~", "[{}](https://example.com/x)", "![{}](pic.png)"]
LINE = ["{}", "# {}", "### {} ###", "- {}", "* {}", "1. {}", "> {}", "| {} |"]
PAUSE = ["", " [pause 1s] ", '<break time="300ms"/>', "<break/>", " [pause 200ms]"]


@st.composite
def marked_up(draw: st.DrawFn) -> tuple[str, list[str]]:
    """Markdown lines of words wrapped in inline markup and pause markers; also the bare words in order."""
    lines: list[str] = []
    words: list[str] = []
    for _ in range(draw(st.integers(1, 4))):
        parts = []
        for _ in range(draw(st.integers(1, 3))):
            word = draw(WORD)
            words.append(word)
            parts.append(draw(st.sampled_from(INLINE)).format(word) + draw(st.sampled_from(PAUSE)))
        lines.append(draw(st.sampled_from(LINE)).format(" ".join(parts)))
    if draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), "```\ncode **here**\n```")
    return "\n".join(lines), words


LEAKS = ("**", "](", "<break", "[pause", "`", "~~", "|")
_CONTENT = regex.compile(r"[a-z\p{Han}]")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=marked_up())
def test_markup_never_leaks_and_no_content_is_dropped(enhanced: TextFrontend, case: tuple[str, list[str]]) -> None:
    text, words = case
    report = enhanced.normalize_report(text)
    spoken = [s.text for s in report.sentences]
    for out in [report.normalized, *spoken]:
        assert not any(leak in out for leak in LEAKS), out
        assert not any(line.lstrip().startswith("#") for line in out.split("\n")), out
    expected = "".join(_CONTENT.findall("".join(words)))
    assert "".join(_CONTENT.findall("".join(spoken))) == expected
