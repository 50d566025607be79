"""The fixed uniform noise of CosyVoice3's causal HiFT (SineGen2.sine_waves), regenerated from the mt19937 position the
bundle states (the exporter checked it against torch's draws): sample n of a sentence's source gets row n."""

from __future__ import annotations

import threading

import numpy as np

from service.errors import InvalidInputError

_BLOCK_ROWS = 1 << 16  # rows generated at a time when a longer sentence needs more of the buffer


class SineNoise:
    """Rows [0, n) of the (samples, harmonics) float32 buffer, generated once and extended as longer sentences need
    them (a minute of audio: 52 MB). Thread-safe: a reader gets an array that is never written after it is shared."""

    def __init__(self, seed: int, offset: int, samples: int, harmonics: int) -> None:
        # numpy's legacy seeding (RandomState) is torch's manual_seed (init_genrand); its bit generator gives the raw draws
        legacy = np.random.RandomState(seed)
        self._bits = np.random.MT19937()
        self._bits.state = legacy.get_state(legacy=False)  # type: ignore[assignment]  # the same MT19937 state mapping
        self._bits.random_raw(offset, output=False)
        self.samples, self.harmonics = samples, harmonics
        self._rows = np.zeros((0, harmonics), dtype=np.float32)
        self._lock = threading.Lock()

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows start..stop-1 (samples of a sentence from its first one); InvalidInputError past the buffer's end (the
        official buffer holds 300 s)."""
        if stop > self.samples:
            raise InvalidInputError(f"a sentence longer than {self.samples} samples has no vocoder noise left")
        rows = self._rows
        if stop > rows.shape[0]:
            rows = self._extend(stop)
        return rows[start:stop]

    def _extend(self, stop: int) -> np.ndarray:
        with self._lock:
            have = self._rows.shape[0]
            if stop > have:
                need = min(self.samples, max(stop, have + _BLOCK_ROWS)) - have
                raw = self._bits.random_raw(need * self.harmonics)
                new = ((raw & 0xFFFFFF).astype(np.float64) * 2.0**-24).astype(np.float32).reshape(need, self.harmonics)
                self._rows = np.concatenate([self._rows, new])
            return self._rows
