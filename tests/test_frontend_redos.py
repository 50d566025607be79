"""Regular-expression denial of service: every frontend regex and the whole pipeline stay linear on 100 kB inputs."""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import regex

from service.frontend import (
    TextFrontend,
    annotate,
    arithmetic,
    frontend,
    lexicon,
    markup,
    mixed,
    normalize,
    pauses,
    pipeline,
    roman,
    rules,
    steps,
)
from service.frontend.normalize import OfficialNormalizer
from service.frontend.rules_en import en_rules
from service.frontend.rules_zh import ZH_LATE_RULES, ZH_RULES

SIZE = 100_000
# Repeated to 100 kB, these seeds hit the quantifiers, alternations and lookarounds of the patterns.
SEEDS = (
    "1", "1,", "1.", "1-", "1:", "1%", "1 ", "a", "a.", "a@", "a-1", "v1.", "www.", "http://a", "电话1", "¥1,",
    "$1.", "1%-", " ", "\t", "😀 ", "，", "<|", "好", "儿", "。", "12345678901", "1x", "1^", "零下-", "a1", "%",
    "**a", "*a ", "_a", "__a ", "~~a", "`a", "``", "[a](", "![a](b", "[a][", "<break ", "<break time='1", "[pause ",
    "[pause 1", "# ", "- ", "1. ", "> ", "| a ", "|-", "---", "```\n", "<https://a", "<speak ", "第I", "Ⅲ", "Henry I",
    "Chapter X", "1+1=", "1 + ", "-1-", "555-", "(555) ", "+1 5", "Dr. ", "A.", "Main St. ", "1 A B ",
    "1.5-", "1,000.5 ", "1,0", "1000.5k", "1 km/", "$1-$", "¥1,0-", "$1.5M-", "-1.5%", "1.5% ", "1.5-2.", "1-1.",
    "好[", "好[a1 ", "好[a1]", "<sub alias='", "<sub a>", "<prosody rate='", "<prosody a='1' ", "a b ", "a'b ", "+1 2",
    "+1 (2", "555 1",
)  # fmt: skip
EN_RULES = en_rules(OfficialNormalizer().number_words)  # with the memoized inflect the service uses
BUDGET_S = 1.5  # a linear pass over 100 kB takes milliseconds; a quadratic one takes minutes


def _adversarial(seed: str) -> str:
    return (seed * (SIZE // len(seed) + 1))[:SIZE]


def _named_patterns() -> dict[str, Callable[[str], object]]:
    """Every compiled regex of the frontend, each with the operation the code performs with it."""
    ops: dict[str, Callable[[str], object]] = {}
    all_rules = ZH_RULES + ZH_LATE_RULES + EN_RULES
    for i, r in enumerate(all_rules):
        ops[f"rule:{i}:{r.name}"] = r.apply
    for module in (steps, rules, normalize, pipeline, frontend, lexicon, markup, pauses, arithmetic, roman, annotate, mixed):
        for name, value in vars(module).items():
            if isinstance(value, re.Pattern | regex.Pattern):
                fullmatched = {"_ONLY_PUNCT", "_HAN_WORD", "_SYLLABLE", "_TIME", "_VALID", "_RULE_LINE", "_TABLE_SEPARATOR",
                               "_NUMBERED", "_RATE"}  # fmt: skip
                if name in fullmatched:
                    ops[f"{module.__name__}.{name}"] = value.fullmatch
                else:
                    ops[f"{module.__name__}.{name}"] = partial(value.sub, "")
    return ops


PATTERNS = _named_patterns()


def test_every_module_regex_is_covered() -> None:
    names = set(PATTERNS)
    for expected in ("steps._ONLY_PUNCT", "rules._EMOJI_BEFORE_PUNCT", "rules._CONTROL", "pipeline._SURROGATES", "markup._STARS",
                     "pauses._MARKER", "arithmetic._TOKEN", "roman._VALID", "annotate._PINYIN", "mixed._TWO_WORDS"):  # fmt: skip
        assert f"service.frontend.{expected}" in names
    assert sum(n.startswith("rule:") for n in names) == len(ZH_RULES) + len(ZH_LATE_RULES) + len(EN_RULES)


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_regex_linear_on_adversarial_input(name: str) -> None:
    op = PATTERNS[name]
    worst = 0.0
    for seed in SEEDS:
        text = _adversarial(seed)
        start = time.perf_counter()
        op(text)
        worst = max(worst, time.perf_counter() - start)
    assert worst < BUDGET_S, f"{name}: {worst:.2f}s on a 100 kB input"


@pytest.fixture(scope="module")
def enhanced(ref_dir: Path) -> TextFrontend:
    return TextFrontend.load(ref_dir / "multilingual.tiktoken", cache_size=0)


# Inputs that wetext leaves alone (no digits survive the rules), so the whole 100 kB run stays cheap.
PIPELINE_SEEDS = ("1", "好" + "1" * 13, "好，", "a ", "。", "😀", "，", "<", "儿", "a@b.", "重庆的行长", "好" * 7, "x" * 9,
                  "**a ", "_a_ ", "- a\n", "# a\n", "| a |\n", "> ", "```\n", "[a](b) ", "a[pause 1s]", "好<break/>",
                  "好[hao3]", "<sub alias='x'>y</sub>", "好 a b ", "a. b. ", "好。a b.")  # fmt: skip


@pytest.mark.parametrize("seed", PIPELINE_SEEDS)
def test_pipeline_100kb_linear(enhanced: TextFrontend, seed: str) -> None:
    small, big = _adversarial(seed)[: SIZE // 4], _adversarial(seed)
    t_small, t_big = _growth(enhanced, small, big, lambda s, b: b < 4 * max(s, 0.05) * 2.5)
    assert t_big < 20.0, f"{seed!r}: {t_big:.1f}s for 100 kB"
    assert t_big < 4 * max(t_small, 0.05) * 2.5, f"{seed!r}: {t_small:.2f}s for 25 kB but {t_big:.2f}s for 100 kB"


def test_pipeline_digit_dense_linear(enhanced: TextFrontend) -> None:
    """wetext itself runs on these (about 0.1 ms per character), so the sizes are smaller; the ratio is what counts."""
    seed = "1a，"
    small, big = _adversarial(seed)[:4_000], _adversarial(seed)[:16_000]
    t_small, t_big = _growth(enhanced, small, big, lambda s, b: b < 4 * s * 2.0)
    assert t_big < 4 * t_small * 2.0, f"{t_small:.2f}s for 4 kB but {t_big:.2f}s for 16 kB"


def _growth(fe: TextFrontend, small: str, big: str, linear: Callable[[float, float], bool]) -> tuple[float, float]:
    """Seconds for `small` and `big`, each the least of up to 3 runs: other work on the host (or in this process)
    only ever adds time to a run, so a ratio that looks super-linear once is measured again before it counts."""
    t_small, t_big = _timed(fe, small), _timed(fe, big)
    for _ in range(2):
        if linear(t_small, t_big):
            break
        t_small, t_big = min(t_small, _timed(fe, small)), min(t_big, _timed(fe, big))
    return t_small, t_big


def _timed(fe: TextFrontend, text: str) -> float:
    """One run's seconds with the cyclic garbage collector held: a full collection scans every object the test session
    holds, a cost that grows with the session, not with the text."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        report = fe.normalize_report(text)
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    assert all(len(s.ids) <= fe.options.max_sentence_tokens for s in report.sentences)
    return elapsed
