"""Preallocated per-layer K/V cache shared by the rows of a batched LLM decode step."""

from __future__ import annotations

import numpy as np


def _round_up_pow2(n: int, minimum: int) -> int:
    size = max(1, minimum)
    while size < n:
        size *= 2
    return size


class KVCache:
    """Per-layer K and V buffers of shape (rows_cap, H, C, DK), zero-initialised, in the decode graph's K/V type:
    float32, or float16 for quantized bundles (half the bytes; the graph widens each layer as it reads it).

    Row r holds one sequence; its first `lengths[r]` columns are valid. Active rows are always
    0..n_rows-1, so `k[i][:n_rows]` is a contiguous view the decode graph can read without a copy.
    rows_cap grows by doubling; capacity C (time) by doubling, or with `column_step` > 0 to the next
    multiple of it: the decode graph reads all C columns of every row (masked), so at batch 8 a cache
    kept near the longest row is ~20% faster per step than a doubled one, for one copy per
    `column_step` steps. A step writes one column per row in place.
    Columns past a row's length are ignored by the graph but must stay finite: a masked weight of 0
    times NaN would still poison the attention output, hence zeros rather than np.empty.
    """

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        *,
        rows: int = 1,
        capacity: int = 64,
        column_step: int = 0,
        dtype: type[np.floating] = np.float32,
    ) -> None:
        if column_step < 0:
            raise ValueError("column_step must be >= 0")
        self.column_step = column_step
        self.dtype = np.dtype(dtype)
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.n_rows = 0
        self.lengths = np.zeros(max(1, rows), dtype=np.int64)
        self.k = [self._zeros(max(1, rows), max(1, capacity)) for _ in range(num_layers)]
        self.v = [self._zeros(max(1, rows), max(1, capacity)) for _ in range(num_layers)]

    def _zeros(self, rows: int, capacity: int) -> np.ndarray:
        return np.zeros((rows, self.num_heads, capacity, self.head_dim), dtype=self.dtype)

    @property
    def capacity(self) -> int:
        """Time capacity C of every buffer (columns)."""
        return int(self.k[0].shape[2])

    @property
    def row_capacity(self) -> int:
        return int(self.k[0].shape[0])

    def nbytes(self) -> int:
        """Bytes held by all K and V buffers."""
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def _reallocate(self, rows: int, capacity: int) -> None:
        old_rows, old_cap = self.row_capacity, self.capacity
        for buffers in (self.k, self.v):
            for i, old in enumerate(buffers):
                new = self._zeros(rows, capacity)
                new[: self.n_rows, :, : min(old_cap, capacity)] = old[: self.n_rows, :, : min(old_cap, capacity)]
                buffers[i] = new
        lengths = np.zeros(rows, dtype=np.int64)
        lengths[: min(old_rows, rows)] = self.lengths[: min(old_rows, rows)]
        self.lengths = lengths

    def reserve(self, columns: int, rows: int | None = None) -> None:
        """Make room for `columns` time steps per row and `rows` rows (doubling; never shrinks)."""
        rows = self.n_rows if rows is None else rows
        if columns <= self.capacity and rows <= self.row_capacity:
            return
        if self.column_step and columns > self.capacity:
            capacity = -(-columns // self.column_step) * self.column_step
        else:
            capacity = _round_up_pow2(columns, self.capacity)
        self._reallocate(_round_up_pow2(rows, self.row_capacity), capacity)

    def add_row(self, k: np.ndarray, v: np.ndarray) -> int:
        """Append a sequence from prefill K/V of shape (NL, H, L, DK); returns its row index."""
        expected = (self.num_layers, self.num_heads, k.shape[2], self.head_dim)
        if k.shape != expected or v.shape != expected:
            raise ValueError(f"prefill K/V must be {expected}, got {k.shape} and {v.shape}")
        length = k.shape[2]
        # One spare column so the first decode step can write without growing.
        self.reserve(length + 1, self.n_rows + 1)
        row = self.n_rows
        for i in range(self.num_layers):
            self.k[i][row, :, :length] = k[i]
            self.v[i][row, :, :length] = v[i]
        self.lengths[row] = length
        self.n_rows += 1
        return row

    def remove_row(self, row: int) -> int | None:
        """Free `row` by moving the last active row into it; returns the moved row's old index (or None).

        Costs one row copy per removal instead of a gather of every row at every step.
        """
        if not 0 <= row < self.n_rows:
            raise IndexError(f"row {row} is not active (n_rows={self.n_rows})")
        last = self.n_rows - 1
        moved = None
        if row != last:
            used = int(self.lengths[last])
            for buffers in (self.k, self.v):
                for buf in buffers:
                    buf[row, :, :used] = buf[last, :, :used]
            self.lengths[row] = used
            moved = last
        self.lengths[last] = 0
        self.n_rows -= 1
        return moved

    def append(self, new_k: np.ndarray, new_v: np.ndarray) -> None:
        """Write one step's K/V, shape (NL, n_rows, H, DK), at column `lengths[r]` of each row r."""
        n = self.n_rows
        if new_k.shape != (self.num_layers, n, self.num_heads, self.head_dim) or new_v.shape != new_k.shape:
            raise ValueError(f"step K/V must be {(self.num_layers, n, self.num_heads, self.head_dim)}, got {new_k.shape}")
        lengths = self.lengths[:n].copy()
        self.reserve(int(lengths.max(initial=0)) + 1)
        rows = np.arange(n)
        for i in range(self.num_layers):
            self.k[i][rows, :, lengths, :] = new_k[i]
            self.v[i][rows, :, lengths, :] = new_v[i]
        self.lengths[:n] = lengths + 1

    def feeds(self) -> dict[str, np.ndarray]:
        """Decode-graph inputs for the active rows: past_len and past_k_{i} / past_v_{i} views."""
        n = self.n_rows
        out: dict[str, np.ndarray] = {"past_len": self.lengths[:n].copy()}
        for i in range(self.num_layers):
            out[f"past_k_{i}"] = self.k[i][:n]
            out[f"past_v_{i}"] = self.v[i][:n]
        return out

    def row_view(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """Valid K and V of one row as (NL, H, length, DK) copies (for tests and debugging)."""
        length = int(self.lengths[row])
        k = np.stack([b[row, :, :length] for b in self.k])
        v = np.stack([b[row, :, :length] for b in self.v])
        return k, v
