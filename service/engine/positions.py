"""Relative-position table of the LLM: espnet sinusoids, projected once per layer through `llm_pos`."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import numpy as np


def espnet_pe(rows: int, dim: int) -> np.ndarray:
    """Sinusoids for relative distances 0..rows-1, shape (rows, dim) float32.

    Row r: `pe[r, 2j] = sin(r * w_j)`, `pe[r, 2j+1] = cos(r * w_j)`, `w_j = exp(2j * -(ln(10000)/dim))`,
    with float32 exponent, frequency and angle as in the official torch table. The exp itself is taken
    in float64 and rounded: that equals torch's float32 exp on all but 2-3 of 512 frequencies, where
    numpy's float32 exp differs on ~200 (each 1-ulp frequency error grows with r in the angle).
    """
    if dim % 2:
        raise ValueError(f"positional dimension must be even, got {dim}")
    exponent = np.arange(0, dim, 2, dtype=np.float32) * np.float32(-(math.log(10000.0) / dim))
    w = np.exp(exponent.astype(np.float64)).astype(np.float32)
    angle = np.arange(rows, dtype=np.float32)[:, None] * w[None, :]
    pe = np.empty((rows, dim), dtype=np.float32)
    pe[:, 0::2] = np.sin(angle)
    pe[:, 1::2] = np.cos(angle)
    return pe


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
        pos = np.ascontiguousarray(self._project(espnet_pe(rows, self._dim)), dtype=np.float32)
        if pos.ndim != 4 or pos.shape[2] != rows:
            raise ValueError(f"llm_pos returned shape {pos.shape}, expected (NL, H, {rows}, DK)")
        return pos

    @property
    def rows(self) -> int:
        return self._pos.shape[2]

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
