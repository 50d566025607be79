"""Chunk-causal flow caches: every estimator block's keys and values per guidance row and Euler step, appended in
place, so a streamed sequence solves each mel frame once (CosyVoice2's estimator; any flow that attends under chunk
masks with left-padded convolutions). Frames are kept as the graph reads them or narrower (`CachePrecision`), and a
voice's prompt frames once for all of its requests (`share_steps`, then `FrameCache.copy`)."""

from __future__ import annotations

import mmap
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

import numpy as np

from service.engine import native
from service.engine.pages import PAGE, SharedPages, anonymous, sharing_works

# How a cache stores its frames: as the graph reads them ("graph": float16 in quantized bundles, float32 in fp32 ones),
# float16, or int8 with one float32 scale per frame and head (max |x| / 127), widened for each graph call.
CachePrecision = Literal["graph", "float16", "int8"]
PRECISIONS: tuple[str, ...] = ("graph", "float16", "int8")
# The lever's values: a stored precision, or "auto" (`stored_precision`).
PrecisionLever = Literal["auto", "graph", "float16", "int8"]
INT8_MAX = 127.0
MAX_PROMPT_STATES = 64  # voices whose prompt state is kept (each shared state holds one memory file open)


def stored_precision(asked: PrecisionLever, graph_dtype: type[np.floating] | np.dtype[Any]) -> CachePrecision:
    """What "auto" stores: int8 where the graph reads float16 caches (a quantized bundle, which is already not the
    official float32; int8 frames add no error against fp32 that the window's output shows, docs/deviations.md), and
    the graph's own type in an fp32 bundle (the official computation)."""
    if asked != "auto":
        return asked
    return "int8" if np.dtype(graph_dtype) == np.float16 else "graph"


@dataclass(frozen=True)
class SharedSource:
    """Where a shared cache's stored arrays live in a memory file: the file and each array's byte offset in it."""

    pages: SharedPages
    offsets: tuple[int, ...]


class FrameCache:
    """One guidance row's keys (or values) of every estimator block, time-first and appended in place: a buffer
    (blocks, capacity, H, DK) whose first `frames` frames are filled, in the graph's type `graph_dtype` or narrower.

    Kept in the graph's type, a block's filled part `view(b)` (1,C,H,DK) is contiguous and fed to the graph as it is
    (no copy per call: a cache concatenated anew per call spent most of an Euler step's copying on page faults of
    freshly allocated arrays, docs/perf-log.md); a narrower cache widens the block's frames for each call (int8: times
    its `scales`, (blocks, capacity, H)). The buffer is an anonymous mapping sized for the whole sequence (`capacity`
    frames): its pages take memory only once a frame is written, it is unmapped when the cache is dropped, and it is
    kept out of transparent huge pages (numpy asks for them for its large arrays; compacting memory for them stalled
    an allocation for seconds). A sequence longer than `capacity` moves to a buffer twice as large.
    """

    def __init__(
        self,
        buffer: np.ndarray,
        frames: int = 0,
        *,
        graph_dtype: type[np.floating] | None = None,
        scales: np.ndarray | None = None,
    ) -> None:
        self.buffer = buffer
        self.frames = frames
        self.graph_dtype = np.dtype(graph_dtype or buffer.dtype)
        self.scales = scales
        self.source: SharedSource | None = None  # set on a shared state's caches (share_steps): copies view it
        self.viewing: SharedPages | None = None  # the shared file whose pages this cache's first frames view

    @classmethod
    def empty(
        cls, blocks: int, heads: int, dim: int, dtype: type[np.floating], capacity: int, precision: CachePrecision = "graph"
    ) -> FrameCache:
        """Room for `capacity` frames of a graph that reads `dtype`, stored as `precision` says."""
        stored = {"graph": dtype, "float16": np.float16, "int8": np.int8}[precision]
        scales = _mapped((blocks, capacity, heads), np.float32) if precision == "int8" else None
        return cls(_mapped((blocks, capacity, heads, dim), stored), graph_dtype=dtype, scales=scales)

    def view(self, block: int) -> np.ndarray:
        """Block `block`'s filled frames (1, C, H, DK) in the graph's type: in place, or widened for this call."""
        stored = self.buffer[block, : self.frames]
        if self.scales is not None:
            out = np.empty((1, *stored.shape), dtype=self.graph_dtype)
            codec = native.frame_codec()
            if codec is not None and codec.takes(self.graph_dtype):
                codec.widen(stored, self.scales[block, : self.frames], out[0])
            else:
                np.multiply(stored, self.scales[block, : self.frames, :, None], out=out[0], casting="same_kind")
            return out
        if stored.dtype != self.graph_dtype:
            return stored.astype(self.graph_dtype)[None]
        return stored[None]

    def append(self, new: np.ndarray) -> None:
        """new (blocks, 1, M, H, DK): the row's keys/values of M new frames (narrowed to the cache's type)."""
        frames = new.shape[2]
        if self.frames + frames > self.buffer.shape[1]:
            self._move(max(2 * self.buffer.shape[1], self.frames + frames))
        end = self.frames + frames
        if self.scales is None:
            self.buffer[:, self.frames : end] = new[:, 0]
        else:
            self._narrow(new[:, 0], self.frames, end)
        self.frames = end

    def _narrow(self, values: np.ndarray, start: int, end: int) -> None:
        """values (blocks, M, H, DK) into int8 frames start..end-1 and their scales (max |x| / 127 per frame and head,
        the division rounded half to even): with the library's codec where it takes the type, else numpy (same bits)."""
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
        """Forget frames start..start+count-1: the later frames move down in place (a window that keeps its first
        `start` frames, a prompt, and the latest ones)."""
        end = self.frames
        if count <= 0:
            return
        if not 0 <= start <= start + count <= end:
            raise ValueError(f"cannot drop frames {start}..{start + count - 1} of {end}")
        for array in self.arrays():
            array[:, start : end - count] = array[:, start + count : end]
        self.frames = end - count

    def copy(self, capacity: int) -> FrameCache:
        """An independent cache with the same frames and room for `capacity` (a request continuing from a voice's
        shared prompt state). From a shared state's cache (`share_steps`) the frames' whole pages are a copy-on-write
        view of the state's memory file, not a copy: they take memory once however many requests continue from them."""
        capacity = max(capacity, self.frames)
        if self.source is None or self.frames == 0:
            return self._like(capacity, filled=True)
        twin = self._like(page_aligned(capacity, self.frame_strides()), filled=False)
        _view_shared(twin, self, self.source)
        return twin

    def nbytes(self) -> int:
        return self.frames * self.bytes_per_frame()

    def bytes_per_frame(self) -> int:
        """What one frame takes in the stored arrays: every block's keys (or values), and an int8 cache's scales."""
        return int(self.buffer.shape[0]) * sum(self.frame_strides())

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The stored arrays: the buffer, and the scales of an int8 cache."""
        return (self.buffer,) if self.scales is None else (self.buffer, self.scales)

    def frame_strides(self) -> tuple[int, ...]:
        """Bytes of one frame of one block in each stored array."""
        return tuple(_frame_nbytes(a) for a in self.arrays())

    def _like(self, capacity: int, *, filled: bool) -> FrameCache:
        """A cache of this one's shapes and types with room for `capacity` frames: this one's frames copied if
        `filled`, else `frames` set and nothing written (the caller provides them)."""
        arrays = [_mapped((a.shape[0], capacity, *a.shape[2:]), a.dtype.type) for a in self.arrays()]
        if filled:
            for new, old in zip(arrays, self.arrays(), strict=True):
                new[:, : self.frames] = old[:, : self.frames]
        scales = arrays[1] if self.scales is not None else None
        return FrameCache(arrays[0], self.frames, graph_dtype=self.graph_dtype.type, scales=scales)

    def _move(self, capacity: int) -> None:
        """Go on in a buffer of its own with room for `capacity` frames (a view of shared pages ends here)."""
        moved = self._like(capacity, filled=True)
        self.buffer, self.scales = moved.buffer, moved.scales
        if self.viewing is not None:
            self.viewing.detach()
            self.viewing = None


def share_caches(caches: Sequence[FrameCache]) -> list[FrameCache]:
    """The caches' frames kept once, in one memory file (each with room for its own frames only): a `copy` of any of
    them views the file's whole pages copy-on-write. The caches themselves where files cannot be shared here."""
    if not caches or not sharing_works() or all(c.frames == 0 for c in caches):
        return list(caches)
    layout: list[tuple[FrameCache, int, list[int]]] = []
    size = 0
    for cache in caches:
        capacity = page_aligned(cache.frames, cache.frame_strides())
        offsets = []
        for array in cache.arrays():
            offsets.append(size)
            size += -(-(array.shape[0] * capacity * _frame_nbytes(array)) // PAGE) * PAGE
        layout.append((cache, capacity, offsets))
    pages = SharedPages(size)
    return [_in_file(cache, capacity, SharedSource(pages, tuple(offsets))) for cache, capacity, offsets in layout]


def _in_file(cache: FrameCache, capacity: int, source: SharedSource) -> FrameCache:
    """A copy of `cache` whose arrays live in `source`'s file at its offsets, with room for `capacity` frames."""
    arrays = []
    for old, offset in zip(cache.arrays(), source.offsets, strict=True):
        shape = (old.shape[0], capacity, *old.shape[2:])
        new = np.frombuffer(source.pages.region, dtype=old.dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)
        new[:, : cache.frames] = old[:, : cache.frames]
        arrays.append(new)
    scales = arrays[1] if len(arrays) > 1 else None
    shared = FrameCache(arrays[0], cache.frames, graph_dtype=cache.graph_dtype.type, scales=scales)
    shared.source = source
    return shared


def _view_shared(twin: FrameCache, shared: FrameCache, source: SharedSource) -> None:
    """Make `twin`'s first `shared.frames` frames (its blocks page-aligned) a copy-on-write view of the whole pages of
    `shared`'s file, and copy what is left of them (each block's last partial page)."""
    for new, old, offset in zip(twin.arrays(), shared.arrays(), source.offsets, strict=True):
        region = _region_of(new)
        used = shared.frames * _frame_nbytes(old)
        whole = used // PAGE * PAGE
        for block in range(new.shape[0]):
            mine, theirs = block * new.shape[1] * _frame_nbytes(new), offset + block * old.shape[1] * _frame_nbytes(old)
            source.pages.map_over(region, mine, theirs, whole)
        mine = new.reshape(new.shape[0], -1).view(np.uint8)
        theirs = old.reshape(old.shape[0], -1).view(np.uint8)
        mine[:, whole:used] = theirs[:, whole:used]
    source.pages.attach()
    twin.viewing = source.pages
    weakref.finalize(twin, _detach, weakref.ref(twin), source.pages)


def _detach(twin: weakref.ref[FrameCache], pages: SharedPages) -> None:
    cache = twin()
    if cache is None or cache.viewing is pages:  # one that moved to a buffer of its own has detached then
        pages.detach()


def _frame_nbytes(array: np.ndarray) -> int:
    """Bytes of one frame of one block of a stored (blocks, capacity, ...) array (from its shape: a zero-size array's
    strides say nothing)."""
    return int(np.prod(array.shape[2:])) * array.itemsize


def page_aligned(capacity: int, frame_bytes: tuple[int, ...]) -> int:
    """The least capacity >= `capacity` at which every block of arrays with these bytes per frame starts on a page."""
    step = 1
    for nbytes in frame_bytes:
        need = PAGE // int(np.gcd(PAGE, nbytes))
        step = step * need // int(np.gcd(step, need))
    return -(-capacity // step) * step


def _region_of(array: np.ndarray) -> mmap.mmap:
    """The anonymous mapping `_mapped` made for `array`."""
    base: object = array
    while not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
        if base is None:
            raise ValueError("the array does not live in a mapping of its own")
    return base


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


def share_steps(steps: Sequence[EstimatorState]) -> list[EstimatorState]:
    """The steps' caches kept once in one memory file (`share_caches`): the state of a voice's prompt, which every
    request of the voice continues from by `copy`."""
    caches = share_caches([c for s in steps for c in (*s.k, *s.v)])
    rows = len(steps[0].k) if steps else 0
    out = []
    for i, step in enumerate(steps):
        mine = caches[2 * rows * i : 2 * rows * (i + 1)]
        out.append(EstimatorState(step.tails, mine[:rows], mine[rows:]))
    return out


class Sized(Protocol):
    def nbytes(self) -> int: ...


S = TypeVar("S", bound=Sized)
K = TypeVar("K", bound=Hashable)


class PromptStates(Generic[K, S]):
    """A voice's flow state after its prompt-only chunks, by key (voice fingerprint, steps, prompt tokens), least
    recently used dropped first, at most `max_bytes` and `max_states` in all.

    States are shared, never written: a request continues from a copy (the caches that grow in place are copied, or
    viewed copy-on-write when the state was shared: `share_steps`). A state dropped while requests still view it lives
    until the last of them ends.
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
