"""Relative-position table of the LLM: espnet sinusoids, projected once per layer through `llm_pos`."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from service.families.cosyvoice1.contract import relative_pe

# Maps pe (R, D) float32 to the per-layer projection (NL, H, R, DK): a call of the `llm_pos` graph.
Projector = Callable[[np.ndarray], np.ndarray]
# The decode graph scores a query against every row it is given, and reads them all: it gets the first
# multiple of this many rows that covers the distances in use, not the whole (512+ row) table.
WINDOW_ROWS = 64
_WINDOWS_KEPT = 2  # one for the decode batch, one for a prefill of another length
# A table grows to the next multiple of this many rows (14 MB full size) when a sequence needs more distances.
GROWTH_ROWS = 256


class PositionTable:
    """Per-layer projected positions `pos` (NL, H, R, DK) shared by every request of one runner.

    Grown when a sequence needs more than R relative distances, to the next multiple of GROWTH_ROWS: only the new
    rows are projected (a row's projection depends on its distance alone) and appended. Growth is serialised by a
    lock and publishes a new array, so readers holding the old one are never disturbed.
    `windowed` is for a step graph that scores every row it is given (ONNX Runtime's): its feeds are contiguous
    copies of the first rows in use (`window`), since a whole table would make each step slower (docs/perf-log.md),
    and rows past the distances in use never reach a gathered score. The native step twin reads only the rows of
    the distances in use, so without `windowed` it gets views of the whole table: no copies (two windows were 87 MB
    next to a 56 MB table for a 10 s voice, full size).
    """

    def __init__(self, project: Projector, dim: int, *, rows: int = 256, windowed: bool = True) -> None:
        self._project = project
        self._dim = dim
        self.windowed = windowed
        self._lock = threading.Lock()
        self._dtype: type[np.floating] = np.float32
        self._pos = self._build(0, max(1, rows))
        self._windows: dict[int, np.ndarray] = {}  # rows -> (NL, H, rows, DK) copy of the current table

    def _build(self, start: int, rows: int) -> np.ndarray:
        """Projected rows start .. rows-1."""
        pe = relative_pe(rows, self._dim)[start:]
        pos = np.asarray(self._project(pe), dtype=np.float32)
        if pos.ndim != 4 or pos.shape[2] != rows - start:
            raise ValueError(f"llm_pos returned shape {pos.shape}, expected (NL, H, {rows - start}, DK)")
        return np.ascontiguousarray(pos, dtype=self._dtype)

    @property
    def dtype(self) -> type[np.floating]:
        return self._dtype

    def hold_as(self, dtype: type[np.floating]) -> None:
        """Keep the table (and what it grows by) in `dtype`, the step graph's `pos_i` type: float16 for a native step
        twin that reads them so (half the bytes a decode step reads per cached position for them, and half the table)."""
        with self._lock:
            if dtype != self._dtype:
                self._dtype = dtype
                self._pos = np.ascontiguousarray(self._pos, dtype=dtype)
                self._windows = {}

    @property
    def rows(self) -> int:
        return int(self._pos.shape[2])

    def table(self, needed: int) -> np.ndarray:
        """A table with at least `needed` rows (relative distances 0..needed-1)."""
        pos = self._pos
        if pos.shape[2] >= needed:
            return pos
        with self._lock:
            old = self._pos
            if old.shape[2] < needed:
                rows = -(-needed // GROWTH_ROWS) * GROWTH_ROWS
                self._pos = np.concatenate([old, self._build(old.shape[2], rows)], axis=2)
                self._windows = {}
            return self._pos

    def window(self, needed: int) -> np.ndarray:
        """The table's first rows, a multiple of WINDOW_ROWS >= `needed` (the whole table if that is shorter)."""
        pos = self.table(needed)
        rows = min(pos.shape[2], -(-needed // WINDOW_ROWS) * WINDOW_ROWS)
        if rows == pos.shape[2]:
            return pos
        found = self._windows.get(rows)
        if found is not None:  # rows depend on their distance only, so a window of an older table is still right
            return found
        window = np.ascontiguousarray(pos[:, :, :rows])
        with self._lock:  # publish a new dict (readers holding the old one are undisturbed), newest last
            kept = list(self._windows.items())[-(_WINDOWS_KEPT - 1) :]
            self._windows = dict(kept) | {rows: window}
        return window

    def feeds(self, needed: int) -> dict[str, np.ndarray]:
        """Decode-graph inputs pos_{i} (H, R, DK), R >= needed: contiguous views of `window(needed)`, or of the whole
        table when not `windowed`."""
        pos = self.window(needed) if self.windowed else self.table(needed)
        return {f"pos_{i}": pos[i] for i in range(pos.shape[0])}
