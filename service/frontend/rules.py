"""Rewrite rules applied before wetext (enhanced mode) and the language-neutral clean-up of raw input."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import regex

Replacement = str | Callable[[regex.Match[str]], str]

# Emoji, their modifiers and joiners, and decorative symbol blocks (arrows, shapes, dingbats, box drawing).
_EMOJI_CLASS = (
    r"[\p{Extended_Pictographic}\p{Emoji_Modifier}\u200d\ufe0e\ufe0f\u20e3"
    r"\U000E0020-\U000E007F\U0001F1E6-\U0001F1FF\u2190-\u21FF\u2500-\u25FF\u2600-\u27BF\u2B00-\u2BFF]"
)
_EMOJI = regex.compile(_EMOJI_CLASS)
# Emoji right before punctuation or the end take the blanks before them along ("nice 👍!" -> "nice!").
_EMOJI_BEFORE_PUNCT = regex.compile(rf"(?<![ \t])[ \t]*+{_EMOJI_CLASS}++(?=[.,!?;:。，！？；：]|$)")
# Control, format, private-use, surrogate and unassigned code points; newline is kept.
_CONTROL = regex.compile(r"[^\S\n]|[\p{Cc}\p{Cf}\p{Co}\p{Cs}\p{Cn}--[\n]]", flags=regex.V1)
_CRLF = regex.compile(r"\r\n?")
# Full-width ASCII (U+FF01..U+FF5E) except the CJK punctuation that Chinese text keeps full-width.
_KEEP_FULL_WIDTH = frozenset("，。！？；：（）")
_FULL_WIDTH_COLON_OR_DOT = regex.compile(r"(?<=\d)[：．](?=\d)")


@dataclass(frozen=True)
class Rule:
    """One named rewrite: every match of `pattern` becomes `replacement` (a template or a function)."""

    name: str
    pattern: regex.Pattern[str]
    replacement: Replacement

    def apply(self, text: str) -> tuple[str, int]:
        """Rewritten text and the number of matches found (0 when nothing matched)."""
        out, n = self.pattern.subn(self.replacement, text)
        return str(out), int(n)


def rule(name: str, pattern: str, replacement: Replacement, flags: int = 0) -> Rule:
    """Compile a Rule (the `regex` module, so possessive quantifiers and atomic groups are available)."""
    return Rule(name, regex.compile(pattern, flags), replacement)


def apply_rules(rules: tuple[Rule, ...], text: str) -> tuple[str, list[str]]:
    """Apply `rules` in order; also return the names of the rules that matched (for reports)."""
    fired: list[str] = []
    for r in rules:
        out, n = r.apply(text)
        if n and out != text:
            fired.append(r.name)
        text = out
    return text, fired


def _to_half_width(ch: str) -> str:
    code = ord(ch)
    if 0xFF01 <= code <= 0xFF5E and ch not in _KEEP_FULL_WIDTH:
        return chr(code - 0xFEE0)
    return ch


def clean_input(text: str) -> str:
    """Drop emoji and invisible/control characters, unify blanks and newlines, fold full-width ASCII."""
    text = _CRLF.sub("\n", text)
    text = _EMOJI_BEFORE_PUNCT.sub("", text)
    text = _EMOJI.sub("", text)
    text = _CONTROL.sub(lambda m: " " if m.group().isspace() else "", text)
    text = "".join(_to_half_width(ch) for ch in text)
    text = _FULL_WIDTH_COLON_OR_DOT.sub(lambda m: ":" if m.group() == "：" else ".", text)
    return text
