"""Chunk-causal flow caches: every estimator block's keys and values per guidance row and Euler step, appended in
place, so a streamed sequence solves each mel frame once (CosyVoice2's estimator; any flow that attends under chunk
masks with left-padded convolutions)."""

from __future__ import annotations

import mmap
import sys
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

# Python's mmap module names MAP_NORESERVE from 3.13; 0x4000 is Linux's value (elsewhere: no flag, pages reserved)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


class FrameCache:
    """One guidance row's keys (or values) of every estimator block, time-first and appended in place: a buffer
    (blocks, capacity, H, DK) whose first `frames` frames are filled.

    A block's filled part `view(b)` (1,C,H,DK) is contiguous, so it is fed to the graph as it is, and appending a
    chunk writes only its frames, where a cache concatenated anew per call spent most of an Euler step's copying on page
    faults of freshly allocated arrays (docs/perf-log.md). The buffer is an
    anonymous mapping sized for the whole sequence (`capacity` frames): its pages are not reserved and take memory
    only once a frame is written, it is unmapped when the cache is dropped, and it is kept out of transparent huge
    pages (numpy asks for them for its large arrays; compacting memory for them stalled an allocation for seconds).
    A sequence longer than `capacity` moves to a buffer twice as large.
    """

    def __init__(self, buffer: np.ndarray, frames: int = 0) -> None:
        self.buffer = buffer
        self.frames = frames

    @classmethod
    def empty(cls, blocks: int, heads: int, dim: int, dtype: type[np.floating], capacity: int) -> FrameCache:
        return cls(_mapped((blocks, capacity, heads, dim), dtype))

    def view(self, block: int) -> np.ndarray:
        return self.buffer[block, : self.frames][None]

    def append(self, new: np.ndarray) -> None:
        """new (blocks, 1, M, H, DK): the row's keys/values of M new frames (cast to the cache's type)."""
        frames = new.shape[2]
        if self.frames + frames > self.buffer.shape[1]:
            self.buffer = self._filled_copy(max(2 * self.buffer.shape[1], self.frames + frames))
        self.buffer[:, self.frames : self.frames + frames] = new[:, 0]
        self.frames += frames

    def drop(self, start: int, count: int) -> None:
        """Forget frames start..start+count-1: the later frames move down in place (a window that keeps its first
        `start` frames, a prompt, and the latest ones)."""
        end = self.frames
        if count <= 0:
            return
        if not 0 <= start <= start + count <= end:
            raise ValueError(f"cannot drop frames {start}..{start + count - 1} of {end}")
        self.buffer[:, start : end - count] = self.buffer[:, start + count : end]
        self.frames = end - count

    def copy(self, capacity: int) -> FrameCache:
        """An independent cache with the same frames and room for `capacity` (a request continuing from a voice's
        shared prompt state)."""
        return FrameCache(self._filled_copy(max(capacity, self.frames)), self.frames)

    def _filled_copy(self, capacity: int) -> np.ndarray:
        blocks, _, heads, dim = self.buffer.shape
        buffer = _mapped((blocks, capacity, heads, dim), self.buffer.dtype.type)
        buffer[:, : self.frames] = self.buffer[:, : self.frames]
        return buffer

    def nbytes(self) -> int:
        return self.frames * self.bytes_per_frame()

    def bytes_per_frame(self) -> int:
        blocks, _, heads, dim = self.buffer.shape
        return int(blocks * heads * dim * self.buffer.itemsize)


def _mapped(shape: tuple[int, int, int, int], dtype: type[np.floating]) -> np.ndarray:
    """An uninitialised array on its own anonymous private mapping (no swap reserved; unmapped with the array)."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if size == 0:
        return np.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    return np.frombuffer(region, dtype=dtype).reshape(shape)


@dataclass
class EstimatorState:
    """One Euler step's estimator context: conv tails (2,SC,2) and each CFG row's keys and values (FrameCache)."""

    tails: np.ndarray
    k: list[FrameCache]  # per guidance row
    v: list[FrameCache]

    def nbytes(self) -> int:
        return int(self.tails.nbytes + sum(c.nbytes() for c in (*self.k, *self.v)))

    def copy(self, capacity: int) -> EstimatorState:
        return EstimatorState(self.tails.copy(), [c.copy(capacity) for c in self.k], [c.copy(capacity) for c in self.v])


class Sized(Protocol):
    def nbytes(self) -> int: ...


S = TypeVar("S", bound=Sized)
K = TypeVar("K", bound=Hashable)


class PromptStates(Generic[K, S]):
    """A voice's flow state after its prompt-only chunks, by key (voice fingerprint, steps, prompt tokens), least
    recently used dropped first, at most `max_bytes` in all.

    States are shared, never written: a request continues from a copy (the caches that grow in place are copied).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._states: OrderedDict[K, S] = OrderedDict()

    def get(self, key: K) -> S | None:
        with self._lock:
            state = self._states.get(key)
            if state is not None:
                self._states.move_to_end(key)
            return state

    def put(self, key: K, state: S) -> None:
        size = state.nbytes()
        if size > self.max_bytes:
            return
        with self._lock:
            self._states[key] = state
            self._states.move_to_end(key)
            while sum(s.nbytes() for s in self._states.values()) > self.max_bytes:
                self._states.popitem(last=False)

    def __len__(self) -> int:
        return len(self._states)
