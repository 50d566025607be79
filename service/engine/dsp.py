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
    return (xf[..., i0] * (np.float32(1.0) - lam) + xf[..., i1] * lam).astype(np.float32)


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
    return (out[..., kept] / env[kept]).astype(np.float32)


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
