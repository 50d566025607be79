"""What every family's engine takes and gives: per-request options, the LLM's side of a voice, and self-describing
audio chunks with their stage timings."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


def _floats(x: np.ndarray | None) -> np.ndarray | None:
    return None if x is None else np.ascontiguousarray(x, dtype=np.float32)


@dataclass(frozen=True, eq=False)
class LLMPrompt:
    """The LLM's side of a voice (official `llm.inference` inputs besides the text).

    embedding: raw x-vector (spk_embed_dim,) for the speaker slot of the prefill; None leaves the slot out
        (instruct mode). prompt_text_ids: text ids encoded in front of the text (zero-shot prompt text,
        or an instruct text). speech_tokens: prompt speech tokens appended after the task token (zero-shot).
    """

    embedding: np.ndarray | None
    prompt_text_ids: tuple[int, ...] = ()
    speech_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "embedding", _floats(self.embedding))


def as_llm_prompt(prompt: LLMPrompt | np.ndarray) -> LLMPrompt:
    """An LLMPrompt, given one or a bare x-vector (a built-in speaker: its slot and nothing else)."""
    return prompt if isinstance(prompt, LLMPrompt) else LLMPrompt(np.asarray(prompt, dtype=np.float32).reshape(-1))


class TokenGenerator(Protocol):
    """What the synthesizer needs from the LLM (LLMRunner, or a fake in tests)."""

    def generate(
        self,
        text_ids: Sequence[int],
        prompt: LLMPrompt,
        rng: np.random.Generator,
        *,
        min_tokens: int | None = None,
        max_tokens: int | None = None,
        cancel: threading.Event | None = None,
        urgent_tokens: int = 0,
    ) -> Iterator[int]: ...


@dataclass(frozen=True)
class SynthesisOptions:
    """Per-request options; None means the model or engine default.

    speed: tempo factor; the mel is stretched to int(frames / speed) before the vocoder. Without
        streaming this is the official whole-sentence resize; with `stream=True` each chunk's mel is
        stretched as it comes (service.engine.dsp.StreamingStretch), so streaming keeps its first-audio
        latency (the first hop grows a few tokens above speed 1.28, see first_hop_for_speed).
    seed: same seed, same options and same input give the same audio; None draws fresh entropy.
    stream: True yields chunks of `hop + overlap` tokens as the LLM produces them; False yields one
        chunk per sentence.
    first_hop_tokens: tokens consumed by the first streaming chunk (must exceed token_overlap_len);
        None uses the engine's schedule (see service.engine.chunking).
    n_timesteps: Euler steps of the flow solver; None uses the manifest value.
    max_speech_s, max_sentence_speech_s: seconds of speech (at speed 1) the request and each of its sentences may
        make; None: only the official bound (20 speech tokens per text token). See speech_budget.SpeechBudget.
    """

    speed: float = 1.0
    seed: int | None = None
    stream: bool = False
    first_hop_tokens: int | None = None
    n_timesteps: int | None = None
    max_speech_s: float | None = None
    max_sentence_speech_s: float | None = None


@dataclass(frozen=True)
class StageTimings:
    """Seconds each stage spent producing one chunk."""

    llm_s: float
    flow_s: float
    hift_s: float


@dataclass(frozen=True)
class AudioChunk:
    """A piece of synthesized audio that says what it is: float32 (N,) within ±audio_limit at `sample_rate` Hz,
    made from `speech_tokens` speech tokens of sentence `sentence_index`."""

    audio: np.ndarray
    sentence_index: int
    is_final: bool  # last chunk of the whole request
    timings: StageTimings
    sentence_end: bool = False  # last chunk of its sentence
    sample_rate: int = 22050
    speech_tokens: int = 0

    @property
    def seconds(self) -> float:
        return self.audio.size / self.sample_rate
