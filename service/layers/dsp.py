"""Signal helpers matching the official torch ops: linear resize, n_fft-16 STFT/iSTFT, Hamming cross-fade."""

from __future__ import annotations

import numpy as np


def interpolate_linear(x: np.ndarray, size: int) -> np.ndarray:
    """Resize `x` along its last axis to `size` samples like torch `F.interpolate(mode='linear', align_corners=False)`.

    Source position of output sample d is `(d + 0.5) * n_in / size - 0.5`, clamped at 0. The scale is the
    float32 quotient and the position is rounded to float32 once (torch's CPU kernel uses a fused
    multiply-add), which reproduces torch's sample positions bit for bit.
    Returns float32 with shape `x.shape[:-1] + (size,)`.
    """
    n_in = x.shape[-1]
    if size < 0 or (n_in == 0 and size > 0):
        raise ValueError(f"cannot resize {n_in} samples to {size}")
    if size == 0:
        return np.zeros((*x.shape[:-1], 0), dtype=np.float32)
    scale = np.float64(np.float32(n_in) / np.float32(size))
    src = ((np.arange(size, dtype=np.float64) + 0.5) * scale - 0.5).astype(np.float32)
    src = np.maximum(src, np.float32(0.0))
    i0 = np.minimum(src.astype(np.int64), n_in - 1)
    i1 = np.minimum(i0 + 1, n_in - 1)
    lam = src - i0.astype(np.float32)
    xf = x.astype(np.float32, copy=False)
    return np.asarray((xf[..., i0] * (np.float32(1.0) - lam) + xf[..., i1] * lam).astype(np.float32), dtype=np.float32)


def hann_window(n: int) -> np.ndarray:
    """Periodic Hann window of length n (scipy `get_window('hann', n, fftbins=True)`), float32."""
    k = np.arange(n, dtype=np.float64)
    return (0.5 - 0.5 * np.cos(2.0 * np.pi * k / n)).astype(np.float32)


def stft(x: np.ndarray, n_fft: int, hop: int, window: np.ndarray) -> np.ndarray:
    """One-sided STFT of the last axis, torch `stft(center=True, pad_mode='reflect')` conventions.

    `x` (..., L) float; returns complex64 (..., n_fft // 2 + 1, 1 + L // hop), unnormalized.
    """
    pad = n_fft // 2
    widths = [(0, 0)] * (x.ndim - 1) + [(pad, pad)]
    xp = np.pad(x.astype(np.float32, copy=False), widths, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(xp, n_fft, axis=-1)[..., ::hop, :]
    spec = np.fft.rfft(frames * window, n=n_fft, axis=-1)
    return np.swapaxes(spec, -1, -2).astype(np.complex64)


def istft(spec: np.ndarray, n_fft: int, hop: int, window: np.ndarray) -> np.ndarray:
    """Inverse of `stft` with torch `istft(center=True)` semantics; returns float32 (..., hop * (frames - 1)).

    Frames are inverse-FFT'd (imaginary parts of DC/Nyquist ignored), windowed, overlap-added, divided by
    the overlap-added squared window, and `n_fft // 2` samples are trimmed from each end.
    """
    n_frames = spec.shape[-1]
    frames = np.fft.irfft(np.swapaxes(spec, -1, -2), n=n_fft, axis=-1).astype(np.float32) * window
    total = n_fft + hop * (n_frames - 1)
    out = _overlap_add(frames, hop, total)
    env = _overlap_add(np.broadcast_to(window * window, (n_frames, n_fft)), hop, total)
    pad = n_fft // 2
    kept = slice(pad, total - pad)
    return np.asarray((out[..., kept] / env[kept]).astype(np.float32), dtype=np.float32)


def _overlap_add(frames: np.ndarray, hop: int, total: int) -> np.ndarray:
    """Sum frames (..., F, n_fft) placed every `hop` samples into (..., total)."""
    n_frames, n_fft = frames.shape[-2:]
    out = np.zeros((*frames.shape[:-2], total), dtype=np.float32)
    if n_fft % hop == 0:
        # n_fft / hop interleaved groups whose frames do not overlap: one reshape-add per group
        span = hop * n_frames
        for g in range(n_fft // hop):
            seg = frames[..., g * hop : (g + 1) * hop].reshape(*frames.shape[:-2], span)
            out[..., g * hop : g * hop + span] += seg
        return out
    for f in range(n_frames):
        out[..., f * hop : f * hop + n_fft] += frames[..., f, :]
    return out


def fade_in_out(fade_in: np.ndarray, fade_out: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Cross-fade the head of `fade_in` with the tail of `fade_out` along the last axis (official v1 rule).

    With n = len(window) // 2: `out[..., :n] = fade_in[..., :n] * window[:n] + fade_out[..., -n:] * window[n:]`,
    computed in float64 (the official code multiplies by a float64 numpy window) and stored as float32.
    Returns a new array; the inputs are not modified.
    """
    n = window.shape[0] // 2
    out = np.array(fade_in, dtype=np.float32, copy=True)
    head = fade_in[..., :n].astype(np.float64) * window[:n] + fade_out[..., -n:].astype(np.float64) * window[n:]
    out[..., :n] = head.astype(np.float32)
    return out


class StreamingStretch:
    """Linear tempo change of a mel fed in pieces along its last axis: frames out = frames in / speed.

    Output frame j is read at input position `(j + 0.5) * speed - 0.5` (clamped to the available range),
    the rule of `interpolate_linear` with the scale fixed to `speed` instead of `n_in / size`, so the
    concatenated outputs equal one resize of the whole input up to that scale difference (under one
    frame over a sentence). A frame is emitted once both neighbours of its position have arrived, so
    a non-final piece holds back at most one output frame; `final=True` flushes the rest and brings
    the total to `max(1, int(n_in / speed))`, the official frame count.
    """

    def __init__(self, speed: float) -> None:
        if not speed > 0:
            raise ValueError(f"speed must be positive, got {speed}")
        self.speed = float(speed)
        self._tail: np.ndarray | None = None  # input frames still needed, starting at global index _base
        self._base = 0
        self._emitted = 0

    def push(self, x: np.ndarray, *, final: bool) -> np.ndarray:
        """Stretched frames made available by `x` (..., n) float32; after `final` the object is spent."""
        buf = x if self._tail is None else np.concatenate([self._tail, x], axis=-1)
        n_in = self._base + buf.shape[-1]  # input frames seen so far
        if final:
            end = max(self._emitted, 1 if n_in > 0 else 0, int(n_in / self.speed))
        else:  # frames whose right neighbour (floor(pos) + 1) has arrived
            end = max(self._emitted, int(np.floor((n_in - 1 + 0.5) / self.speed - 0.5)) + 1)
            while end > self._emitted and int(self._position(end - 1)) + 1 > n_in - 1:
                end -= 1
        out = self._read(buf, self._emitted, end, n_in)
        self._emitted = end
        keep = min(int(self._position(end)), n_in - 1) if n_in else 0  # first input frame the next output needs
        keep = max(keep, self._base)
        self._tail = buf[..., keep - self._base :]
        self._base = keep
        return out

    def _position(self, j: float) -> float:
        return max((j + 0.5) * self.speed - 0.5, 0.0)

    def _read(self, buf: np.ndarray, start: int, end: int, n_in: int) -> np.ndarray:
        if end <= start:
            return np.zeros((*buf.shape[:-1], 0), dtype=np.float32)
        pos = np.maximum((np.arange(start, end, dtype=np.float64) + 0.5) * self.speed - 0.5, 0.0)
        i0 = np.minimum(pos.astype(np.int64), n_in - 1)
        i1 = np.minimum(i0 + 1, n_in - 1)
        lam = (pos - i0).astype(np.float32)
        xf = buf.astype(np.float32, copy=False)
        a, b = xf[..., i0 - self._base], xf[..., i1 - self._base]
        return np.asarray((a * (np.float32(1.0) - lam) + b * lam).astype(np.float32), dtype=np.float32)
