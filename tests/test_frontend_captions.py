"""What captions show: each sentence the engine speaks keeps the written text it was read from (markup removed), one
written sentence per piece when captions are asked for, and the finer pieces of a sentence that had to be cut."""

from __future__ import annotations

from pathlib import Path

import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.errors import EmptyTextError
from service.frontend import TextFrontend
from service.frontend.align import written_cuts
from service.frontend.markup import strip_markdown
from service.frontend.units import cut_sentences

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def frontend(ref_dir: Path) -> TextFrontend:
    return TextFrontend.load(ref_dir / "multilingual.tiktoken", lexicon_defaults={})


@pytest.fixture(scope="module")
def capped(ref_dir: Path) -> TextFrontend:
    return TextFrontend.load(ref_dir / "multilingual.tiktoken", lexicon_defaults={}, max_sentence_tokens=MAX_TOKENS)


@pytest.mark.parametrize(
    ("text", "sentences"),
    [
        (
            "Dr. Smith paid $3.50 at 10:30 a.m. in the U.S. today. Then he left!",
            ["Dr. Smith paid $3.50 at 10:30 a.m. in the U.S. today.", " Then he left!"],
        ),
        ("你好。It is 3.5 km.再见！", ["你好。", "It is 3.5 km.", "再见！"]),
        ("他说：“走。”然后走了", ["他说：“走。”", "然后走了"]),
        ("第一行\n第二行。", ["第一行", "\n第二行。"]),
        ("See No. 5 on Main St. tomorrow. OK.", ["See No. 5 on Main St. tomorrow.", " OK."]),
        ("下午3 p.m. 史密斯来了。", ["下午3 p.m.", " 史密斯来了。"]),
        ("苹果、香蕉：都有。", ["苹果、香蕉：都有。"]),
    ],
)
def test_sentences_end_where_a_reader_ends_them(text: str, sentences: list[str]) -> None:
    assert cut_sentences(text) == sentences


def test_with_captions_each_written_sentence_is_its_own_piece_shown_as_written(frontend: TextFrontend) -> None:
    text = "[pause 200ms]今天是2024年3月5日。**明天**要下雨。It costs $3.50. 记得带2把伞！"
    got = [(s.source, s.text) for s in frontend.sentences(text, captions=True) if s.ids]
    assert got == [
        ("今天是2024年3月5日。", "今天是二零二四年三月五日。"),
        ("明天要下雨。", "明天要下雨。"),
        ("It costs $3.50.", "It costs three dollars and fifty cents."),
        ("记得带2把伞！", "记得带两把伞！"),
    ]
    merged = frontend.sentences(text)  # without captions: the official merge of short sentences
    assert [s.source for s in merged if s.ids] == ["今天是2024年3月5日。明天要下雨。It costs $3.50. 记得带2把伞！"]


def test_a_sentence_cut_for_synthesis_gives_pieces_that_rebuild_it(frontend: TextFrontend, capped: TextFrontend) -> None:
    long = (
        "第一部分写得比较长，里面有很多很多的汉字，用来凑够六十多个字的长度，我们一直写下去，直到长度足够为止，还要再多写几个字才行："
        "第二部分也要写得足够长，超过二十个字，这样才不会被并回前面去。"
    )
    pieces = frontend.sentences(long, captions=True)
    assert [s.source for s in pieces] == [long[: long.index("：") + 1], long[long.index("：") + 1 :]]
    numbers = "我们有12345个苹果，67890个梨，还有13579个桃子和24680个橙子，以及11111个西瓜，一共很多水果。"
    capped_pieces = capped.sentences(numbers, captions=True)
    assert len(capped_pieces) > 1 and "".join(s.source for s in capped_pieces) == numbers
    for s in capped_pieces:  # a number is never cut: each piece shows the digits of what it reads
        assert all(n in numbers for n in regex.findall(r"\d+", s.source))


def test_a_cut_inside_a_number_read_as_words_keeps_the_number_before_it() -> None:
    written, reading = "共1,234人，其中", "共一千二百三十四人，其中"
    assert written_cuts(written, reading, [3, reading.index("人"), reading.index("，") + 1]) == [6, 6, 8]


SPEAKABLE = regex.compile(r"[\p{Han}A-Za-z0-9]")
ALPHABET = "天地人你我他山水好的是" + "abcXY" + "0123" + '，。！？；：、,.!?; “”"（）\n'


def test_a_capped_piece_read_as_punctuation_only_passes_its_written_text_on(capped: TextFrontend) -> None:
    """The cap cut this reading so that one piece read only "，" while its written text was "，1" (a case the property
    below found): the piece is not synthesized, and its text now goes to the next piece instead of vanishing."""
    text = '水b“山山"他他天a0!“的32X，1'
    shown = "".join(s.source for s in capped.sentences(text, captions=True))
    assert "".join(SPEAKABLE.findall(shown)) == "".join(SPEAKABLE.findall(text))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.sampled_from(ALPHABET), max_size=200))
def test_captions_show_every_written_character_once_in_order(capped: TextFrontend, text: str) -> None:
    """Every letter, digit and Han character of the text once, in order, as Markdown leaves it: "2. " at a line's start
    is a list marker, which is neither read nor shown (test_frontend_markup.py), the only markup this alphabet spells."""
    try:
        sentences = capped.sentences(text, captions=True)
    except EmptyTextError:
        return
    shown = "".join(s.source for s in sentences)
    assert "".join(SPEAKABLE.findall(shown)) == "".join(SPEAKABLE.findall(strip_markdown(text)))


def test_a_list_marker_is_neither_read_nor_shown_in_captions(capped: TextFrontend) -> None:
    """The case the property above drew before it compared against the text as Markdown leaves it."""
    assert "".join(s.source for s in capped.sentences("2. 是", captions=True)) == "是。"
