"""What one request may hold in memory at most, by part: the bound admission reserves before a request runs, and the
per-stream worst case the start-up log and /metrics state (docs/memory.md has the formulas and the full-size table)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from service.bundle import ModelConstants
from service.engine.speech_budget import SpeechBudget
from service.engine.types import SynthesisOptions

MiB = 1 << 20
ATTENTION_TENSORS = 7  # float32 H x T x T tensors one full-attention node chain keeps at once (scores, mask, softmax)
LONGEST_SENTENCE_TOKENS = 200  # the text frontend cuts every sentence to at most this many text tokens
SAMPLE_BYTES = 8  # a whole-file answer keeps its float32 samples and one joined copy
BATCH_ROWS_SLACK = 2  # the decode batch's K/V rows grow in powers of two: a row may take up to twice its own


@dataclass(frozen=True)
class Footprint:
    """The most a request holds at once, by part (bytes): its largest sentence's state (sentences run one after
    another and each frees its own when it ends) and what it keeps throughout. `speech_s`: the most seconds of speech
    it may make at speed 1 (what a whole-file answer's samples are sized by)."""

    parts: tuple[tuple[str, int], ...]
    speech_s: float

    @property
    def total(self) -> int:
        return sum(n for _, n in self.parts)

    def plus(self, name: str, nbytes: int) -> Footprint:
        return Footprint((*self.parts, (name, nbytes)), self.speech_s)

    def describe(self) -> str:
        """ "flow caches 371 MB + LLM K/V 30 MB = 401 MB"."""
        shown = " + ".join(f"{name} {n / MiB:.0f} MB" for name, n in self.parts if n)
        return f"{shown or 'nothing'} = {self.total / MiB:.0f} MB"


def speech_tokens(texts: Sequence[int], constants: ModelConstants, options: SynthesisOptions) -> list[int]:
    """The most speech tokens each sentence of `texts` text tokens may make under the request's caps (SpeechBudget's
    limit as the first sentence would get it: an upper bound for every sentence)."""
    budget = SpeechBudget(constants, options.max_speech_s, options.max_sentence_speech_s)
    return [budget.limit(t) for t in texts]


def request_speech_s(texts: Sequence[int], constants: ModelConstants, options: SynthesisOptions) -> float:
    """The most seconds of speech (speed 1) a request of sentences of `texts` text tokens may make."""
    total = sum(speech_tokens(texts, constants, options)) / constants.token_rate_hz
    return total if options.max_speech_s is None else min(total, options.max_speech_s)


def llm_kv_bytes(constants: ModelConstants, itemsize: int, positions: int) -> int:
    """A decode row's K/V cache over `positions` positions (keys and values of every layer and K/V head, `itemsize`
    bytes each), with the batch's slack (BATCH_ROWS_SLACK)."""
    c = constants
    return BATCH_ROWS_SLACK * 2 * c.llm_num_layers * c.llm_num_heads * c.llm_head_dim * itemsize * positions


def largest_sentence(
    texts: Sequence[int],
    constants: ModelConstants,
    options: SynthesisOptions,
    sentence: Callable[[int, int], Sequence[tuple[str, int]]],
) -> Footprint:
    """A request's footprint from its largest sentence's parts: `sentence(text_tokens, speech_tokens)` gives one
    sentence's (sentences run one after another and each frees its own state when it ends)."""
    parts = [sentence(t, s) for t, s in zip(texts, speech_tokens(texts, constants, options), strict=True)]
    largest = max(parts, key=lambda p: sum(n for _, n in p))
    return Footprint(tuple(largest), request_speech_s(texts, constants, options))


def attention_bytes(heads: int, frames: int) -> int:
    """A full-attention flow pass over `frames` frames in ONNX Runtime: ATTENTION_TENSORS float32 (heads, T, T)."""
    return ATTENTION_TENSORS * 4 * heads * frames * frames


def output_bytes(footprint: Footprint, sample_rate: int, speed: float, *, whole_file: bool) -> int:
    """What the answer itself keeps: a whole-file answer its float32 samples and a joined copy; a stream nothing beyond
    its bounded queue of encoded pieces."""
    return int(SAMPLE_BYTES * sample_rate * footprint.speech_s / speed) if whole_file else 0
