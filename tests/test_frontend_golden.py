"""Golden tables for the enhanced normalization rules (zh and en), checked line by line."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import inflect
import pytest

from service.frontend import TextFrontend
from service.frontend.rules import apply_rules
from service.frontend.rules_en import en_rules
from service.frontend.rules_zh import ZH_LATE_RULES, ZH_RULES
from service.frontend.steps import inflect_number_words

DATA = Path(__file__).parent / "data" / "frontend"


def _load(name: str) -> list[dict[str, str]]:
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


ZH = _load("golden_zh.jsonl")
EN = _load("golden_en.jsonl")
# Chinese and English in one text: zh then en, en then zh, English inside a Chinese sentence, phone numbers.
MIXED = _load("golden_mixed.jsonl")


@pytest.fixture(scope="module")
def frontend(ref_dir: Path) -> TextFrontend:
    # No lexicon defaults: these tables test normalization only (lexicon rewriting has its own tests).
    return TextFrontend.load(ref_dir / "multilingual.tiktoken", lexicon_defaults={})


def test_table_sizes() -> None:
    assert len(ZH) + len(EN) >= 150
    assert len(ZH) >= 100 and len(EN) >= 50
    topics = {c["rule"] for c in ZH + EN}
    required = {
        "phone", "id", "year", "quantity", "decimal", "negative", "percent", "fraction", "currency", "unit", "time",
        "date", "ratio", "range", "version", "url", "email", "english", "width", "emoji", "control", "interjection",
        "erhua",
    }  # fmt: skip
    assert required <= topics


@pytest.mark.parametrize("case", ZH, ids=[f"zh-{i}-{c['rule']}" for i, c in enumerate(ZH)])
def test_golden_zh(frontend: TextFrontend, case: dict[str, str]) -> None:
    assert frontend.normalize(case["text"], split=False) == [case["expected"]]


@pytest.mark.parametrize("case", EN, ids=[f"en-{i}-{c['rule']}" for i, c in enumerate(EN)])
def test_golden_en(frontend: TextFrontend, case: dict[str, str]) -> None:
    assert frontend.normalize(case["text"], split=False) == [case["expected"]]


@pytest.mark.parametrize("case", MIXED, ids=[f"mixed-{i}-{c['rule']}" for i, c in enumerate(MIXED)])
def test_golden_mixed(frontend: TextFrontend, case: dict[str, str]) -> None:
    """Each sentence (or English run of a Chinese sentence) is read by its own language's rules; a phone number is
    never read as a subtraction (减) or a sum."""
    assert frontend.normalize(case["text"], split=False) == [case["expected"]]


def test_mixed_tables_cover_both_orders() -> None:
    counts = Counter(c["rule"] for c in MIXED)
    assert set(counts) == {"zh-en", "en-zh", "inside", "phone"} and min(counts.values()) >= 4


def test_every_rule_fires_in_the_tables(frontend: TextFrontend) -> None:
    fired = {name for case in ZH + EN + MIXED for name in frontend.normalize_report(case["text"]).rules}
    names = {r.name for r in ZH_RULES} | {r.name for r in en_rules(inflect_number_words(inflect.engine()))}
    assert names - fired == set()


def test_leftover_digits_safety_net() -> None:
    # wetext reads every digit in the tables; this late rule only catches what it might leave (e.g. when it fails).
    assert apply_rules(ZH_LATE_RULES, "第3页共120页") == ("第三页共一百二十页", ["leftover_digits"])
    assert apply_rules(ZH_LATE_RULES, "没有数字") == ("没有数字", [])


def test_interjections_and_erhua_survive_with_digits(frontend: TextFrontend) -> None:
    for word in ("呃", "啊", "嗯", "哪儿", "一会儿", "玩儿"):
        text = f"{word}，我们有3个人"
        assert word in frontend.normalize(text, split=False)[0]


def test_official_mode_keeps_the_misreadings(ref_dir: Path) -> None:
    official = TextFrontend.load(ref_dir / "multilingual.tiktoken", enhanced=False)
    # Without the fixes wetext reads the hyphen as a minus and the version's first dot as a sentence end.
    assert official.normalize("GPT-4很强", split=False) == ["GPT负四很强"]
    assert official.normalize("版本v1.2.3", split=False) == ["版本v一。二点三"]
