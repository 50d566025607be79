"""Relative-position table of the LLM: espnet sinusoids, projected once per layer through `llm_pos`."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from service.bundle import relative_pe

# Maps pe (R, D) float32 to the per-layer projection (NL, H, R, DK): a call of the `llm_pos` graph.
Projector = Callable[[np.ndarray], np.ndarray]


class PositionTable:
    """Per-layer projected positions `pos` (NL, H, R, DK) shared by every request of one runner.

    Grown (doubling) when a sequence needs more than R relative distances. Growth is serialised by
    a lock and publishes a new array, so readers holding the old one are never disturbed.
    """

    def __init__(self, project: Projector, dim: int, *, rows: int = 256) -> None:
        self._project = project
        self._dim = dim
        self._lock = threading.Lock()
        self._pos = self._build(max(1, rows))

    def _build(self, rows: int) -> np.ndarray:
        pos = np.ascontiguousarray(self._project(relative_pe(rows, self._dim)), dtype=np.float32)
        if pos.ndim != 4 or pos.shape[2] != rows:
            raise ValueError(f"llm_pos returned shape {pos.shape}, expected (NL, H, {rows}, DK)")
        return pos

    @property
    def rows(self) -> int:
        return int(self._pos.shape[2])

    def table(self, needed: int) -> np.ndarray:
        """A table with at least `needed` rows (relative distances 0..needed-1)."""
        pos = self._pos
        if pos.shape[2] >= needed:
            return pos
        with self._lock:
            if self._pos.shape[2] < needed:
                rows = self._pos.shape[2]
                while rows < needed:
                    rows *= 2
                self._pos = self._build(rows)
            return self._pos

    def feeds(self, needed: int) -> dict[str, np.ndarray]:
        """Decode-graph inputs pos_{i} (H, R, DK), contiguous views of one table with R >= needed."""
        pos = self.table(needed)
        return {f"pos_{i}": pos[i] for i in range(pos.shape[0])}
