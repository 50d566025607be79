"""Chunk-causal flow caches: every estimator block's keys and values per guidance row and Euler step, appended in
place, so a streamed sequence solves each mel frame once (CosyVoice2's estimator; any flow that attends under chunk
masks with left-padded convolutions). Frames are kept as the graph reads them or narrower (`CachePrecision`), and a
voice's prompt frames once for all of its requests (`freeze_steps`, then `FrameCache.copy`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

import numpy as np

from service.engine import native
from service.engine.pages import anonymous

# How a cache stores its frames: as the graph reads them ("graph": float16 in quantized bundles, float32 in fp32 ones),
# float16, or int8 with one float32 scale per frame and head (max |x| / 127), widened for each graph call.
CachePrecision = Literal["graph", "float16", "int8"]
PRECISIONS: tuple[str, ...] = ("graph", "float16", "int8")
# The lever's values: a stored precision, or "auto" (`stored_precision`).
PrecisionLever = Literal["auto", "graph", "float16", "int8"]
INT8_MAX = 127.0
MAX_PROMPT_STATES = 64  # voices whose prompt state is kept


def stored_precision(
    asked: PrecisionLever, graph_dtype: type[np.floating] | np.dtype[Any], reads_int8: bool = False
) -> CachePrecision:
    """What "auto" stores: int8 where the graph reads float16 caches (a quantized bundle, which is already not the
    official float32; int8 frames add no error against fp32 that the window's output shows, docs/deviations.md), and
    the graph's own type in an fp32 bundle (the official computation). A graph that reads int8 frames with their scales
    (`reads_int8`: a native twin's, export/native_twin.int8_block_caches) takes them as they are kept: int8. The
    engine runs the core graph instead where "graph" or "float16" is asked (runtimes.float_caches_asked), so a twin
    that reads int8 never meets them; "float16" with one is refused (ValueError), "graph" means its int8."""
    if reads_int8:
        if asked == "float16":
            raise ValueError("flow_cache_precision=float16: this estimator graph reads its caches in int8")
        return "int8"
    if asked != "auto":
        return asked
    return "int8" if np.dtype(graph_dtype) == np.float16 else "graph"


class FrameCache:
    """One guidance row's keys (or values) of every estimator block, time-first: the frames it reads are those of its
    `head` (a frozen cache shared with other caches: a voice's prompt state; None for a cache of its own) and then its
    own, appended in place in a buffer (blocks, capacity, H, DK) in the graph's type `graph_dtype` or narrower.

    A cache of its own kept in the graph's type feeds a block's frames `view(b)` (1,C,H,DK) to the graph as they are
    (no copy per call: a cache concatenated anew per call spent most of an Euler step's copying on page faults of
    freshly allocated arrays, docs/perf-log.md); a cache with a head, or a narrower one, writes them into one array for
    each call (int8: widened, times its `scales`, (blocks, capacity, H)). The buffer is an anonymous mapping sized for
    the whole sequence (`capacity` frames of its own): its pages take memory only once a frame is written, it is
    unmapped when the cache is dropped, and it is kept out of transparent huge pages (numpy asks for them for its large
    arrays; compacting memory for them stalled an allocation for seconds). A sequence longer than `capacity` moves to a
    buffer twice as large.

    A graph that reads int8 frames (`reads_int8`, int8 precision) takes a cache's own frames and scales in place
    (`feeds`), or, with a head, one int8 copy of the head's and its own per call: no float16 widening.

    A frozen cache (`freeze`: a voice's prompt state, kept for every request of the voice) is never written again: a
    `copy` of it reads its frames as the copy's head instead of copying them, so they take memory once however many
    requests continue from them, in one mapping (a page several mappings of one process show is counted once per
    mapping in its resident size, though it takes memory once).
    """

    def __init__(
        self,
        buffer: np.ndarray,
        frames: int = 0,
        *,
        graph_dtype: type[np.floating] | None = None,
        scales: np.ndarray | None = None,
        head: FrameCache | None = None,
        reads_int8: bool = False,
    ) -> None:
        self.buffer = buffer
        self.head = head
        self.frames = frames  # frames it reads: its head's, then its own
        self.graph_dtype = np.dtype(graph_dtype or buffer.dtype)
        self.scales = scales
        self.reads_int8 = reads_int8
        self.frozen = False

    @classmethod
    def empty(
        cls,
        blocks: int,
        heads: int,
        dim: int,
        dtype: type[np.floating],
        capacity: int,
        precision: CachePrecision = "graph",
        *,
        reads_int8: bool = False,
    ) -> FrameCache:
        """Room for `capacity` frames of a graph whose new frames come in `dtype` and which reads `dtype` frames, or
        (`reads_int8`, int8 precision only) int8 frames with their scales; stored as `precision` says."""
        if reads_int8 and precision != "int8":
            raise ValueError(f"a graph that reads int8 frames takes them as they are kept: precision int8, not {precision}")
        stored = {"graph": dtype, "float16": np.float16, "int8": np.int8}[precision]
        scales = _mapped((blocks, capacity, heads), np.float32) if precision == "int8" else None
        return cls(_mapped((blocks, capacity, heads, dim), stored), graph_dtype=dtype, scales=scales, reads_int8=reads_int8)

    @property
    def base(self) -> int:
        """Frames its head holds (the first of those it reads)."""
        return 0 if self.head is None else self.head.frames

    def feeds(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """What the graph reads of every block: its frames (1, C, H, DK), and for a graph that reads int8 frames their
        scales (1, C, H) (else no scales): in place where the frames are its own, else written out for this call."""
        if not self.reads_int8:
            return self.views(), []
        assert self.scales is not None
        if self.head is None:
            blocks = range(self.buffer.shape[0])
            return [self.buffer[b, : self.frames][None] for b in blocks], [self.scales[b, : self.frames][None] for b in blocks]
        frames = np.empty((self.buffer.shape[0], 1, self.frames, *self.buffer.shape[2:]), dtype=np.int8)
        scales = np.empty((self.buffer.shape[0], 1, self.frames, self.buffer.shape[2]), dtype=np.float32)
        self._copy_int8(frames[:, 0], scales[:, 0])
        return list(frames), list(scales)

    def _copy_int8(self, frames: np.ndarray, scales: np.ndarray) -> None:
        """Every block's int8 frames and scales into `frames` (blocks, C, H, DK) and `scales` (blocks, C, H): the
        head's, then its own."""
        assert self.scales is not None
        base = self.base
        if self.head is not None:
            self.head._copy_int8(frames[:, :base], scales[:, :base])
        frames[:, base:] = self.buffer[:, : self.frames - base]
        scales[:, base:] = self.scales[:, : self.frames - base]

    def views(self) -> list[np.ndarray]:
        """Every block's frames, block b's (1, C, H, DK) in the graph's type: in place, or written out for this call
        into one array (int8 widened for all blocks in one native call: one view at a time cost ~30 µs of Python and
        allocation per block, 3-4 ms per CosyVoice2 estimator call, docs/perf-log.md)."""
        if self._in_place:
            return [self.buffer[b, : self.frames][None] for b in range(self.buffer.shape[0])]
        out = np.empty((self.buffer.shape[0], 1, self.frames, *self.buffer.shape[2:]), dtype=self.graph_dtype)
        self._write(out[:, 0])
        return list(out)

    def view(self, block: int) -> np.ndarray:
        """Block `block`'s frames (1, C, H, DK) in the graph's type (`views`' for one block)."""
        return self.buffer[block, : self.frames][None] if self._in_place else self.views()[block]

    @property
    def _in_place(self) -> bool:
        """Whether the graph reads its frames as they are stored: its own only, in the graph's float type."""
        return self.head is None and self.scales is None and self.buffer.dtype == self.graph_dtype

    def _write(self, out: np.ndarray) -> None:
        """Every block's frames into `out` (blocks, frames, H, DK) of the graph's type, each block contiguous: the
        head's, then its own (int8 widened with the library's codec where it takes the type, else numpy: the same
        bits)."""
        base = self.base
        if self.head is not None:
            self.head._write(out[:, :base])
        stored, mine = self.buffer[:, : self.frames - base], out[:, base:]
        if self.scales is None:
            mine[...] = stored
            return
        scales = self.scales[:, : self.frames - base]
        codec = native.frame_codec()
        if codec is not None and codec.takes(self.graph_dtype):
            codec.widen_blocks(stored, scales, mine)
        else:
            np.multiply(stored, scales[..., None], out=mine, casting="same_kind")

    def append(self, new: np.ndarray, dropping: tuple[int, int] = (0, 0)) -> None:
        """new (blocks, 1, M, H, DK): the row's keys/values of M new frames (narrowed to the cache's type).

        `dropping` (first, count): frames to forget, counted in the cache with the new ones appended (a window's
        drop, `WindowedFrames.dropping`). They go before the new frames come in, so the cache never holds (nor
        touches the pages of) more frames than it keeps: the same frames as appending and then dropping."""
        if self.frozen:
            raise ValueError("a frozen cache is read, never written (continue from a copy)")
        first, count = dropping
        if count:
            if not self.base <= first <= first + count <= self.frames + new.shape[2]:
                raise ValueError(f"cannot drop frames {first}..{first + count - 1} of {self.frames + new.shape[2]}")
            old = min(count, self.frames - first)
            self.drop(first, old)
            new = new[:, :, count - old :]
        frames, own = new.shape[2], self.frames - self.base
        if own + frames > self.buffer.shape[1]:
            self._move(max(2 * self.buffer.shape[1], own + frames))
        if self.scales is None:
            self.buffer[:, own : own + frames] = new[:, 0]
        else:
            self._narrow(new[:, 0], own, own + frames)
        self.frames += frames

    def _narrow(self, values: np.ndarray, start: int, end: int) -> None:
        """values (blocks, M, H, DK) into its own int8 frames start..end-1 and their scales (max |x| / 127 per frame
        and head, the division rounded half to even): with the library's codec where it takes the type, else numpy
        (same bits)."""
        assert self.scales is not None
        codec = native.frame_codec()
        if codec is not None and codec.takes(values.dtype) and values.strides[0] % values.itemsize == 0:
            blocks = values if values[0].flags.c_contiguous else np.ascontiguousarray(values)
            codec.narrow_blocks(blocks, self.buffer[:, start:end], self.scales[:, start:end])
            return
        values = np.asarray(values, dtype=np.float32)
        scale = np.abs(values).max(axis=-1) / np.float32(INT8_MAX)
        scale[scale == 0] = 1.0
        self.scales[:, start:end] = scale
        self.buffer[:, start:end] = np.rint(values / scale[..., None])

    def drop(self, start: int, count: int) -> None:
        """Forget frames start..start+count-1 (its own, not its head's): the later frames move down in place (a window
        that keeps its first `start` frames, a prompt, and the latest ones)."""
        if self.frozen:
            raise ValueError("a frozen cache is read, never written (continue from a copy)")
        end, base = self.frames, self.base
        if count <= 0:
            return
        if not base <= start <= start + count <= end:
            raise ValueError(f"cannot drop frames {start}..{start + count - 1} of {end} (the first {base} are shared)")
        for array in self.arrays():
            array[:, start - base : end - base - count] = array[:, start - base + count : end - base]
        self.frames = end - count

    def freeze(self) -> FrameCache:
        """Never written again from now on: copies read its frames instead of copying them (a voice's prompt state)."""
        self.frozen = True
        return self

    def copy(self, capacity: int) -> FrameCache:
        """An independent cache with the same frames and room for `capacity` in all (a request continuing from a
        voice's prompt state). A frozen cache's frames are read by the copy, not copied (its head)."""
        capacity = max(capacity, self.frames)
        if self.frozen and self.frames:
            return self._like(capacity - self.frames, head=self, copied=0)
        return self._like(capacity - self.base, head=self.head, copied=self.frames - self.base)

    def nbytes(self) -> int:
        """Bytes of the frames it reads (its head's included: what a stream holds at most, whoever else reads them)."""
        return self.frames * self.bytes_per_frame()

    def bytes_per_frame(self) -> int:
        """What one frame takes in the stored arrays: every block's keys (or values), and an int8 cache's scales."""
        return int(self.buffer.shape[0]) * sum(_frame_nbytes(a) for a in self.arrays())

    def arrays(self) -> tuple[np.ndarray, ...]:
        """Its own stored arrays: the buffer, and the scales of an int8 cache."""
        return (self.buffer,) if self.scales is None else (self.buffer, self.scales)

    def _like(self, capacity: int, *, head: FrameCache | None, copied: int) -> FrameCache:
        """A cache of this one's frames, `head`'s first, in new arrays of this one's shapes and types with room for
        `capacity` frames of its own, the first `copied` of them copied from this one's own."""
        arrays = [_mapped((a.shape[0], capacity, *a.shape[2:]), a.dtype.type) for a in self.arrays()]
        for new, old in zip(arrays, self.arrays(), strict=True):
            new[:, :copied] = old[:, :copied]
        scales = arrays[1] if self.scales is not None else None
        return FrameCache(
            arrays[0], self.frames, graph_dtype=self.graph_dtype.type, scales=scales, head=head, reads_int8=self.reads_int8
        )

    def _move(self, capacity: int) -> None:
        """Go on in arrays of its own with room for `capacity` frames of its own."""
        moved = self._like(capacity, head=self.head, copied=self.frames - self.base)
        self.buffer, self.scales = moved.buffer, moved.scales


def _frame_nbytes(array: np.ndarray) -> int:
    """Bytes of one frame of one block of a stored (blocks, capacity, ...) array (from its shape: a zero-size array's
    strides say nothing)."""
    return int(np.prod(array.shape[2:])) * array.itemsize


def _mapped(shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
    """An uninitialised array on its own anonymous private mapping (no swap reserved; unmapped with the array)."""
    count = int(np.prod(shape))
    if count == 0:
        return np.empty(shape, dtype=dtype)
    return np.frombuffer(anonymous(count * np.dtype(dtype).itemsize), dtype=dtype, count=count).reshape(shape)


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


def freeze_steps(steps: Sequence[EstimatorState]) -> list[EstimatorState]:
    """The steps with every cache frozen (`FrameCache.freeze`): the state of a voice's prompt, which every request of
    the voice continues from by `copy`, reading its frames without copying them."""
    for step in steps:
        for cache in (*step.k, *step.v):
            cache.freeze()
    return list(steps)


class Sized(Protocol):
    def nbytes(self) -> int: ...


S = TypeVar("S", bound=Sized)
K = TypeVar("K", bound=Hashable)


class PromptStates(Generic[K, S]):
    """A voice's flow state after its prompt-only chunks, by key (voice fingerprint, steps, prompt tokens), least
    recently used dropped first, at most `max_bytes` and `max_states` in all.

    States are shared, never written: a request continues from a copy (a frozen state's caches, `freeze_steps`, are
    read by the copy, not copied). A state dropped while requests still read it lives until the last of them ends.
    """

    def __init__(self, max_bytes: int, max_states: int = MAX_PROMPT_STATES) -> None:
        self.max_bytes = max_bytes
        self.max_states = max_states
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
            while len(self._states) > self.max_states or self._held() > self.max_bytes:
                self._states.popitem(last=False)

    def nbytes(self) -> int:
        """Bytes the kept states hold."""
        with self._lock:
            return self._held()

    def _held(self) -> int:
        return sum(s.nbytes() for s in self._states.values())

    def __len__(self) -> int:
        return len(self._states)


def frame_bytes(blocks: int, heads: int, dim: int, dtype: type[np.floating], precision: CachePrecision) -> int:
    """What one frame of one FrameCache (every block's keys or values) takes at `precision` for a graph of `dtype`."""
    if precision == "int8":
        return blocks * heads * (dim + np.dtype(np.float32).itemsize)
    itemsize = 2 if precision == "float16" else np.dtype(dtype).itemsize
    return blocks * heads * dim * itemsize
