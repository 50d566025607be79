"""Sentence boundaries in text that arrives piece by piece (an LLM's reply): release a sentence once it is complete."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.errors import TextTooLongError

# Where a sentence ends. The HTTP path cuts after every terminator of `split.ZH_TERMINATORS` and then merges short
# pieces up to 60-80 units; a stream cannot merge with text that has not arrived without holding speech back, so it
# ends sentences only at full stops, question and exclamation marks, semicolons and line breaks (the enumeration
# comma 、 and colons, which the HTTP path merges away in practice, do not end one). Each released sentence is then
# normalized, split and capped by the same frontend as an HTTP request.
WIDE_ENDS = frozenset("。？！；…\n")  # end a sentence as soon as they arrive
ASCII_ENDS = frozenset(".?!;")  # end one only once the next character shows it was not "3.5", "e.g." or "a.m."
CLOSERS = frozenset("\"'”’）)」』】")  # stay with the sentence they close
# Words whose trailing "." is no sentence end (English titles and Latin abbreviations); single letters (initials) too.
# fmt: off
ABBREVIATIONS = frozenset((
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "a.m", "p.m", "fig", "approx", "dept",
    "inc", "ltd", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec", "mt", "ave", "rd",
    "blvd",
))
# fmt: on
LANGUAGES = ("auto", "zh", "en", "ja", "ko", "yue")


@dataclass
class IncrementalSegmenter:
    """Feed text deltas, get the sentences they complete; `flush()` releases the rest.

    `max_chars` bounds the text held back (a sentence that never ends is refused with TextTooLongError rather than
    buffered without limit). With `language` "zh", "ja" or "yue" an ASCII "." right after a CJK character ends a
    sentence at once (such text has no abbreviations); otherwise ASCII terminators wait for the next character.
    """

    max_chars: int = 4096
    language: str = "auto"
    _buffer: str = field(default="", init=False)

    @property
    def pending(self) -> str:
        """Text received but not yet released."""
        return self._buffer

    def feed(self, delta: str) -> list[str]:
        """Add `delta`; returns the sentences now complete (stripped, never empty), in order."""
        self._buffer += delta
        out: list[str] = []
        while (end := self._boundary()) is not None:
            sentence, self._buffer = self._buffer[:end].strip(), self._buffer[end:]
            if sentence:
                out.append(sentence)
        if len(self._buffer) > self.max_chars:
            raise TextTooLongError(
                f"{len(self._buffer)} characters arrived without a sentence end; the limit is {self.max_chars} "
                "(send a flush, or punctuation)",
                param="text",
            )
        return out

    def flush(self) -> list[str]:
        """Release whatever is held back (a flush or close message: the client says the text is complete)."""
        rest, self._buffer = self._buffer.strip(), ""
        return [rest] if rest else []

    def discard(self) -> None:
        """Forget whatever is held back (a cancel: the text will never be spoken)."""
        self._buffer = ""

    def _boundary(self) -> int | None:
        """Index just past the first confirmed sentence end in the buffer (closing quotes included), or None."""
        text = self._buffer
        for i, ch in enumerate(text):
            if ch in WIDE_ENDS:
                end = _past_closers(text, i + 1)
                if end < len(text) or ch == "\n":  # a closer may still follow a wide end: wait one character
                    return end
            elif ch in ASCII_ENDS and (ascii_end := self._ascii_end(text, i)) is not None:
                return ascii_end
        return None

    def _ascii_end(self, text: str, i: int) -> int | None:
        """Index past the sentence end starting with the ASCII terminator at `i` ("?!", "...", closing quotes
        included), or None when what follows (or precedes) says it is none, or nothing follows yet."""
        j = i + 1
        while j < len(text) and (text[j] in ASCII_ENDS or text[j] in CLOSERS):
            j += 1
        if j >= len(text):
            return None  # nothing after it yet: the next delta may continue "3." into "3.5"
        nxt = text[j]
        if nxt.isspace():
            return j if text[j - 1] != "." or j - i > 1 or not is_abbreviation(text[:i], text[j : j + 4]) else None
        if is_cjk(nxt):
            return j
        wide = self.language in ("zh", "ja", "yue") and i > 0 and is_cjk(text[i - 1]) and not nxt.isdigit()
        return j if wide else None


def is_abbreviation(before: str, after: str = "") -> bool:
    """Whether the word before a "." is an abbreviation or initials ("Mr", "e.g", "J", "U.S"), not a sentence end;
    `after` (what follows the blank) makes "No." before a number one too."""
    words = before[-16:].split()  # abbreviations are short: a bounded tail keeps this linear in the text
    word = words[-1].lstrip("\"'“‘([（「").lower() if words and before[-1:].strip() else ""
    initials = word.split(".")  # "j", "u.s", "e.g": single letters between dots
    number_sign = word == "no" and after.lstrip()[:1].isdigit()
    return all(len(w) == 1 and w.isalpha() for w in initials) or word in ABBREVIATIONS or number_sign


def _past_closers(text: str, j: int) -> int:
    while j < len(text) and text[j] in CLOSERS:
        j += 1
    return j


def is_cjk(ch: str) -> bool:
    code = ord(ch)
    return 0x3000 <= code <= 0x9FFF or 0xAC00 <= code <= 0xD7AF or 0xF900 <= code <= 0xFAFF or 0xFF00 <= code <= 0xFFEF
