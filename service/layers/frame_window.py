"""A bound on a streamed sentence's flow caches: the prompt's frames and at most a window of the latest generated ones
(CosyVoice2 and CosyVoice3 keep every Euler step's keys and values per frame; without a window they grow with the
sentence)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from service.layers.frame_cache import EstimatorState


def window_frames(seconds: float | None, chunk_frames: int, frame_rate_hz: float) -> int | None:
    """Generated mel frames a streamed flow keeps attending to for `seconds` (None: all), in whole attention chunks of
    `chunk_frames` and at least two of them (the window drops half of itself at a time)."""
    if seconds is None:
        return None
    return max(2, math.ceil(seconds * frame_rate_hz / chunk_frames)) * chunk_frames


def most_cached(prompt_frames: int, window: int | None, call_frames: int, sentence_frames: int) -> int:
    """The most frames a windowed stream's caches hold at once: the prompt's, the window and one call's (the window is
    made room in before a call); a sentence shorter than that holds its own frames at most."""
    whole = prompt_frames + sentence_frames
    return whole if window is None else min(whole, prompt_frames + window + call_frames)


class WindowedFrames:
    """What a chunk-causal flow state with a window does: `steps` (EstimatorState per Euler step) hold the first
    `prompt_frames` frames and the latest generated ones, at most `window` of those (None: all, the official
    computation) before each call; when a call would exceed it, the oldest generated frames go, in whole attention
    chunks, down to half of it, so a frame keeps seeing the prompt and between window / 2 and window frames before its
    chunk. A frame's chunk is then counted the same from the caches as from the sequence's start."""

    steps: list[EstimatorState]
    prompt_frames: int
    window: int | None

    def nbytes(self) -> int:
        raise NotImplementedError

    @property
    def cached(self) -> int:
        """Frames the caches hold now."""
        return self.steps[0].k[0].frames if self.steps else 0

    def bytes_per_frame(self) -> int:
        """What one more cached frame adds (every step's rows, keys and values)."""
        return sum(c.bytes_per_frame() for s in self.steps for c in (*s.k, *s.v))

    def bytes_after(self, new: int, chunk_frames: int) -> int:
        """What the state holds once a call of `new` frames has run (the window's drop first)."""
        fixed = self.nbytes() - self.cached * self.bytes_per_frame()
        return fixed + (self.cached - self._drop(chunk_frames) + new) * self.bytes_per_frame()

    def make_room(self, chunk_frames: int) -> None:
        """Drop what the window says must go before the next call (whole chunks of `chunk_frames` frames)."""
        drop_frames(self.steps, self.prompt_frames, self._drop(chunk_frames))

    def _drop(self, chunk_frames: int) -> int:
        generated = self.cached - self.prompt_frames
        if self.window is None or generated <= self.window:
            return 0
        excess = generated - self.window // 2
        return -(-excess // chunk_frames) * chunk_frames


def drop_frames(steps: Sequence[EstimatorState], start: int, count: int) -> None:
    """Forget frames start..start+count-1 of every step's caches."""
    if count:
        for step in steps:
            for cache in (*step.k, *step.v):
                cache.drop(start, count)


def family_window_s(lever: float | str | None, default_s: float) -> float | None:
    """The seconds of window a family streams with: `default_s` (its own) for the lever's "auto", else the lever's
    seconds (None: every frame, the official computation)."""
    if lever == "auto":
        return default_s
    return None if lever is None else float(lever)
