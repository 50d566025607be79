"""IncrementalSegmenter: sentences released as soon as they are complete, independent of how the text was cut."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.errors import TextTooLongError
from service.frontend.incremental import IncrementalSegmenter


def run(deltas: list[str], **kw: object) -> tuple[list[str], list[str]]:
    seg = IncrementalSegmenter(**kw)  # type: ignore[arg-type]
    out = [s for d in deltas for s in seg.feed(d)]
    return out, seg.flush()


@pytest.mark.parametrize(
    ("deltas", "released", "rest"),
    [
        (["今天天气", "很好。我们", "一起去"], ["今天天气很好。"], ["我们一起去"]),
        (["It costs 3", ".5 dollars. Mr", ". Smith said", " hi. OK"], ["It costs 3.5 dollars.", "Mr. Smith said hi."], ["OK"]),
        (['He said "yes."', " Then left."], ['He said "yes."'], ["Then left."]),
        (["Wait...", " what? Yes!"], ["Wait...", "what?"], ["Yes!"]),
        (["Visit example.com today. Or e.g. now.", " x"], ["Visit example.com today.", "Or e.g. now."], ["x"]),
        (["J. Doe came. ", "ok"], ["J. Doe came."], ["ok"]),
        (["第一句话！", "」"], [], ["第一句话！」"]),  # a closing quote may follow a wide end: it waits one character
        (["line one\nline two"], ["line one"], ["line two"]),
        (["好的。"], [], ["好的。"]),  # nothing after the end yet: a closing quote could still come
    ],
)
def test_sentence_ends(deltas: list[str], released: list[str], rest: list[str]) -> None:
    assert run(deltas) == (released, rest)


def test_a_dot_after_cjk_ends_a_sentence_with_a_cjk_language_hint() -> None:
    assert run(["你好.我们走吧"], language="zh") == (["你好."], ["我们走吧"])
    assert run(["版本3.5发布"], language="zh") == ([], ["版本3.5发布"])  # a decimal stays whole
    assert run(["你好.x"], language="en") == ([], ["你好.x"])


def test_text_without_an_end_is_bounded() -> None:
    seg = IncrementalSegmenter(max_chars=20)
    seg.feed("a" * 20)
    with pytest.raises(TextTooLongError):
        seg.feed("b")


TEXT = '今天天气很好。我们去公园吧！It costs 3.5 dollars. Mr. Smith said "hi." Then he left; we stayed.\n新的一行？好。'


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(TEXT)), max_size=25))
def test_the_sentences_do_not_depend_on_where_the_deltas_were_cut(cuts: list[int]) -> None:
    points = sorted({0, len(TEXT), *cuts})
    deltas = [TEXT[a:b] for a, b in itertools.pairwise(points)]
    by_char = run(list(TEXT))
    assert run(deltas) == by_char
    released, rest = by_char
    assert "".join(released + rest).replace(" ", "").replace("\n", "") == TEXT.replace(" ", "").replace("\n", "")
