"""Arithmetic read aloud: `1+1=2` -> 一加一等于二 / one plus one equals two.

A whole equation (numbers joined by + - × ÷ * / x, then `=` and a result) is read with operator words; the
`=` is what makes `-` a minus (not a range or a score) and `/` a division (not a date or a fraction), so
without it only `÷` is read (as 除以 / divided by); `+` and `×` are already read well by wetext.
"""

from __future__ import annotations

from collections.abc import Callable

import regex

from service.frontend.readings import en_digits, zh_decimal
from service.frontend.rules import Rule, rule

_NUMBER = r"-?+\d{1,15}+(?:\.\d{1,15}+)?+"
_OPERATOR = r"[ \t]*+[-+×÷*/xX][ \t]*+"
EQUATION = (
    rf"(?<![A-Za-z0-9_.,+\-×÷*/=])(?:{_NUMBER}(?:{_OPERATOR}{_NUMBER}){{1,20}}+[ \t]*+=[ \t]*+{_NUMBER})"
    r"(?![A-Za-z0-9_=]|[.,+×÷*/-]\d)"
)
_TOKEN = regex.compile(r"\d++(?:\.\d++)?+|[-+×÷*/xX=]")
_ZH_WORDS = {"+": "加", "-": "减", "×": "乘", "*": "乘", "x": "乘", "X": "乘", "÷": "除以", "/": "除以", "=": "等于"}
_EN_WORDS = {"+": "plus", "-": "minus", "×": "times", "*": "times", "x": "times", "X": "times", "÷": "divided by",
             "/": "divided by", "=": "equals"}  # fmt: skip


def read_equation(expr: str, number: Callable[[str], str], ops: dict[str, str], negative: str, glue: str) -> str:
    """Read `expr` token by token: numbers with `number`, operators with `ops`, a `-` with no number before
    it as `negative`."""
    spoken: list[str] = []
    after_number = False
    for item in _TOKEN.findall(expr):
        if item[0].isdigit():
            spoken.append(number(item))
        elif item == "-" and not after_number:
            spoken.append(negative)
        else:
            spoken.append(ops[item])
        after_number = item[0].isdigit()
    return glue.join(spoken)


def _en_number(words: Callable[[str], str]) -> Callable[[str], str]:
    def read(number: str) -> str:
        whole, _, frac = number.partition(".")
        return words(whole) + (f" point {en_digits(frac)}" if frac else "")

    return read


ZH_ARITHMETIC_RULES: tuple[Rule, ...] = (
    rule("equation", EQUATION, lambda m: read_equation(m.group(), zh_decimal, _ZH_WORDS, "负", "")),
    rule("divide", r"(?<=\d)[ \t]*+÷[ \t]*+(?=\d)", "除以"),
)


def en_arithmetic_rules(words: Callable[[str], str]) -> tuple[Rule, ...]:
    """Equation and division rules for the English path; `words` spells an ASCII digit string."""
    number = _en_number(words)
    return (
        rule("equation", EQUATION, lambda m: read_equation(m.group(), number, _EN_WORDS, "negative", " ")),
        rule("divide", r"(?<=\d)[ \t]*+÷[ \t]*+(?=\d)", " divided by "),
    )
