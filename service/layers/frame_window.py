"""A bound on a streamed sentence's flow caches: the prompt's frames and at most a window of the latest generated ones
(CosyVoice2 and CosyVoice3 keep every Euler step's keys and values per frame; without a window they grow with the
sentence)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Protocol, Self

import numpy as np

from service.layers.chunk_schedule import HopSchedule
from service.layers.frame_cache import CachePrecision, EstimatorState, frame_bytes, freeze_steps

GUIDANCE_ROWS = 2  # an Euler step's estimator runs a conditioned and an unconditioned row, each with its own caches


class ChunkCausalFlow(Protocol):
    """The constants a chunk-causal flow's cache bound reads (CosyVoice2Constants, CosyVoice3Constants)."""

    @property
    def chunk_tokens(self) -> int: ...

    @property
    def pre_lookahead(self) -> int: ...

    @property
    def token_mel_ratio(self) -> int: ...

    @property
    def estimator_blocks(self) -> int: ...

    @property
    def estimator_heads(self) -> int: ...

    @property
    def estimator_head_dim(self) -> int: ...


def window_frames(seconds: float | None, chunk_frames: int, frame_rate_hz: float) -> int | None:
    """Generated mel frames a streamed flow keeps attending to for `seconds` (None: all), in whole attention chunks of
    `chunk_frames` and at least two of them (the window drops half of itself at a time)."""
    if seconds is None:
        return None
    return max(2, math.ceil(seconds * frame_rate_hz / chunk_frames)) * chunk_frames


def most_cached(prompt_frames: int, window: int | None, sentence_frames: int) -> int:
    """The most frames a windowed stream's caches hold at once: the prompt's and the window (a call's new frames go in
    after the window has let go of what they would push out, `WindowedFrames.dropping`); a sentence shorter than that
    holds its own frames at most."""
    whole = prompt_frames + sentence_frames
    return whole if window is None else min(whole, prompt_frames + window)


def call_tokens(flow: ChunkCausalFlow, prompt_tokens: int, schedule: HopSchedule) -> int:
    """The most tokens one streamed call solves: the first hop with the prompt tokens no prompt state holds (it holds
    the prompt's whole chunks whose look-ahead is still prompt), or a later hop, each with the look-ahead a sentence's
    last chunk takes along."""
    held = max(0, (prompt_tokens - flow.pre_lookahead) // flow.chunk_tokens) * flow.chunk_tokens
    later = schedule.chunk if schedule.scale == 1 else schedule.most
    return max(prompt_tokens - held + schedule.first_hop(prompt_tokens), later) + schedule.look_ahead


def streamed_frames(flow: ChunkCausalFlow, prompt_tokens: int, speech_tokens: int, window: int | None, look_ahead: int) -> int:
    """The most frames a streamed sentence's estimator caches hold at once (`most_cached` in mel frames) after a flow
    prompt of `prompt_tokens` tokens, for at most `speech_tokens` speech tokens and a last chunk's `look_ahead`."""
    ratio = flow.token_mel_ratio
    return most_cached(ratio * prompt_tokens, window, ratio * (speech_tokens + look_ahead))


def call_frames(flow: ChunkCausalFlow, prompt_tokens: int, speech_tokens: int, schedule: HopSchedule) -> int:
    """The most new frames one streamed call solves (`call_tokens`, at most the sentence's) in mel frames."""
    return flow.token_mel_ratio * min(call_tokens(flow, prompt_tokens, schedule), speech_tokens + schedule.look_ahead)


def call_frame_bytes(flow: ChunkCausalFlow, dtype: type[np.floating]) -> int:
    """What one new frame of a call holds until the caches take it: one Euler step's keys and values of every block
    and guidance row, as the graph returns them (steps run one after the other)."""
    return GUIDANCE_ROWS * 2 * frame_bytes(flow.estimator_blocks, flow.estimator_heads, flow.estimator_head_dim, dtype, "graph")


def estimator_frame_bytes(flow: ChunkCausalFlow, steps: int, dtype: type[np.floating], precision: CachePrecision) -> int:
    """What one cached frame takes in a stream's state: keys and values of every block, guidance row and Euler step."""
    shape = (flow.estimator_blocks, flow.estimator_heads, flow.estimator_head_dim)
    return steps * GUIDANCE_ROWS * 2 * frame_bytes(*shape, dtype, precision)


class WindowedFrames(ABC):
    """What a chunk-causal flow state with a window does: `steps` (EstimatorState per Euler step) hold the first
    `prompt_frames` frames and the latest generated ones, at most `window` of those (None: all, the official
    computation); when a call's new frames would exceed it, the oldest generated frames go, in whole attention chunks,
    down to half of it or fewer (`dropping`), so a frame keeps seeing the prompt and up to `window` frames before its
    chunk. A frame's chunk is then counted the same from the caches as from the sequence's start."""

    steps: list[EstimatorState]
    prompt_frames: int
    window: int | None

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the state's caches hold now (each family's frames know their own layout)."""

    def freeze(self) -> Self:
        """This state kept for copies (a voice's prompt state): its caches are never written again, and every copy
        reads their frames instead of copying them (frame_cache.freeze_steps)."""
        freeze_steps(self.steps)
        return self

    @property
    def cached(self) -> int:
        """Frames the caches hold now."""
        return self.steps[0].k[0].frames if self.steps else 0

    def bytes_per_frame(self) -> int:
        """What one more cached frame adds (every step's rows, keys and values)."""
        return sum(c.bytes_per_frame() for s in self.steps for c in (*s.k, *s.v))

    def bytes_after(self, new: int, chunk_frames: int) -> int:
        """What the state holds once a call of `new` frames has run (and the window has let go of what they push out)."""
        fixed = self.nbytes() - self.cached * self.bytes_per_frame()
        return fixed + (self.cached + new - self.dropping(new, chunk_frames)[1]) * self.bytes_per_frame()

    def dropping(self, new: int, chunk_frames: int) -> tuple[int, int]:
        """(first, count): the frames the window lets go of as a call's `new` frames go in (whole chunks of
        `chunk_frames`), counted in the caches with those frames appended. The caches let go of them before taking the
        new ones (`FrameCache.append`), so they never hold more than the prompt and the window; a frame sees the same
        frames as when the window was made room in before each call."""
        generated = self.cached + new - self.prompt_frames
        if self.window is None or generated <= self.window:
            return self.prompt_frames, 0
        excess = generated - self.window // 2
        return self.prompt_frames, -(-excess // chunk_frames) * chunk_frames


def family_window_s(lever: float | str | None, default_s: float) -> float | None:
    """The seconds of window a family streams with: `default_s` (its own) for the lever's "auto", else the lever's
    seconds (None: every frame, the official computation)."""
    if lever == "auto":
        return default_s
    return None if lever is None else float(lever)
