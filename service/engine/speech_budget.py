"""How much speech one request may make: the official bound per sentence, a cap per sentence and one per request."""

from __future__ import annotations

from collections.abc import Sequence

from service.bundle import ModelConstants
from service.engine.llm import max_speech_tokens
from service.errors import TextTooLongError


def min_speech_tokens(text_len: int, constants: ModelConstants) -> int:
    """The official minimum (EOS is masked before it): int(2 * T_txt)."""
    return int(text_len * constants.min_token_text_ratio)


class SpeechBudget:
    """The speech tokens one request may still make (one per request, used by its generator only).

    A sentence's LLM stops at `limit(text_len)`: the official bound (max_token_text_ratio per text token), the
    per-sentence cap and what is left of the request's cap, whichever is smallest. Speech is counted in seconds at
    speed 1 (speech tokens / token_rate_hz), so a tempo change does not change what a text may cost. None: no cap.
    Work and memory per request follow from it: a sentence's flow caches and its full-attention flow pass grow with
    its speech tokens (docs/architecture.md, "Bounds per request").
    """

    def __init__(self, constants: ModelConstants, max_speech_s: float | None, max_sentence_speech_s: float | None) -> None:
        self.constants = constants
        self.max_speech_s = max_speech_s
        self.max_sentence_speech_s = max_sentence_speech_s
        rate = constants.token_rate_hz
        self.left = None if max_speech_s is None else int(max_speech_s * rate)
        self.sentence_cap = None if max_sentence_speech_s is None else int(max_sentence_speech_s * rate)

    def check(self, texts: Sequence[Sequence[int]]) -> None:
        """TextTooLongError, before any work, for texts whose official minimum speech is over a cap already."""
        rate = self.constants.token_rate_hz
        least = [min_speech_tokens(len(t), self.constants) for t in texts]
        if self.sentence_cap is not None and max(least) > self.sentence_cap:
            raise TextTooLongError(
                f"a sentence of this text needs at least {max(least) / rate:.0f} s of speech, more than the server's "
                f"limit of {self.max_sentence_speech_s:g} s per sentence: split it with punctuation",
                param="text",
            )
        if self.left is not None and sum(least) > self.left:
            raise TextTooLongError(
                f"this text needs at least {sum(least) / rate:.0f} s of speech, more than the server's limit of "
                f"{self.max_speech_s:g} s per request: send it in several requests",
                param="text",
            )

    def limit(self, text_len: int) -> int:
        """The most speech tokens the next sentence (of `text_len` text ids) may make."""
        caps = [max_speech_tokens(text_len, self.constants), self.sentence_cap, self.left]
        return min(c for c in caps if c is not None)

    def spent(self, tokens: int, text_len: int) -> None:
        """Account a finished sentence's `tokens`; TextTooLongError if a cap (not the official bound) stopped it, so
        that no text is cut short without a word."""
        limit = self.limit(text_len)
        if self.left is not None:
            self.left -= tokens
        if tokens < limit or limit == max_speech_tokens(text_len, self.constants):
            return
        if self.sentence_cap is not None and limit == self.sentence_cap:
            raise TextTooLongError(
                f"a sentence of this text reached the server's limit of {self.max_sentence_speech_s:g} s of speech "
                "per sentence before its end: split it with punctuation",
                param="text",
            )
        raise TextTooLongError(
            f"the speech of this text reached the server's limit of {self.max_speech_s:g} s per request before the "
            "text's end: send it in several requests",
            param="text",
        )
