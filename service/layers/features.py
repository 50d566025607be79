"""Prompt-audio features of the official v1 frontend in numpy: sinc resampler, Kaldi fbank, whisper and Matcha mels."""

from __future__ import annotations

import functools
import math

import numpy as np

# torchaudio.transforms.Resample defaults used by the official load_wav.
RESAMPLE_ZERO_CROSSINGS = 6  # lowpass_filter_width
RESAMPLE_ROLLOFF = 0.99
_RESAMPLE_BLOCK = 2048  # output frames per matmul block: bounds the strided copy to a few MB

FBANK_FRAME = 400  # 25 ms at 16 kHz
FBANK_SHIFT = 160  # 10 ms
FBANK_NFFT = 512
FBANK_MELS = 80
FBANK_LOW_HZ = 20.0
FBANK_PREEMPHASIS = 0.97
FBANK_EPS = float(np.finfo(np.float32).eps)

WHISPER_NFFT = 400
WHISPER_HOP = 160
WHISPER_RATE = 16_000

MEL80_NFFT = 1024
MEL80_HOP = 256
MEL80_MELS = 80
MEL80_FMAX_HZ = 8000.0


# ---- resampling -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _resample_kernel(orig: int, new: int) -> tuple[np.ndarray, int]:
    """Windowed-sinc kernels (K, new) float32, one column per output phase, and the padding `width`.

    `orig` and `new` are already divided by their gcd. Built in float64 and cast once to float32, except
    the phase offsets j / new, which the reference divides in float32 before promoting them: with exact
    offsets the 16 -> 22.05 kHz fixture is missed by 3e-6, with float32 offsets it is met within 1.2e-7.
    """
    cutoff = RESAMPLE_ROLLOFF * min(orig, new)
    width = math.ceil(RESAMPLE_ZERO_CROSSINGS * orig / cutoff)
    k = np.arange(-width, width + orig, dtype=np.float64) / orig
    j = (np.arange(new, dtype=np.float32) / np.float32(new)).astype(np.float64)
    t = np.clip((k[None, :] - j[:, None]) * cutoff, -RESAMPLE_ZERO_CROSSINGS, RESAMPLE_ZERO_CROSSINGS)
    window = np.cos(t * math.pi / (2 * RESAMPLE_ZERO_CROSSINGS)) ** 2
    kernel = np.sinc(t) * window * (cutoff / orig)  # np.sinc(t) = sin(pi t) / (pi t), 1 at t = 0
    kernel_t = np.ascontiguousarray(kernel.T.astype(np.float32))
    kernel_t.setflags(write=False)
    return kernel_t, width


def resample(x: np.ndarray, orig_hz: int, new_hz: int) -> np.ndarray:
    """Band-limited resampling of a mono signal like `torchaudio.transforms.Resample(orig_hz, new_hz)`.

    `x` (N,) float; returns float32 (ceil(new_hz * N / orig_hz),). Hann-windowed sinc, 6 zero crossings,
    rolloff 0.99, float32 polyphase convolution; no clipping (the result may exceed [-1, 1] slightly).
    Kernels are cached per rate pair. Equal rates return a float32 copy.
    """
    if orig_hz <= 0 or new_hz <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_hz} -> {new_hz}")
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if orig_hz == new_hz:
        return x.copy()
    g = math.gcd(int(orig_hz), int(new_hz))
    orig, new = int(orig_hz) // g, int(new_hz) // g
    kernel_t, width = _resample_kernel(orig, new)
    taps = kernel_t.shape[0]
    n = x.shape[0]
    padded = np.zeros(n + 2 * width + orig, dtype=np.float32)
    padded[width : width + n] = x
    frames_total = n // orig + 1  # conv1d outputs with stride orig over the padded signal
    frames = np.lib.stride_tricks.as_strided(
        padded, shape=(frames_total, taps), strides=(orig * padded.strides[0], padded.strides[0]), writeable=False
    )
    out = np.empty((frames_total, new), dtype=np.float32)
    for start in range(0, frames_total, _RESAMPLE_BLOCK):
        stop = min(start + _RESAMPLE_BLOCK, frames_total)
        np.matmul(frames[start:stop], kernel_t, out=out[start:stop])
    target = -(-new * n // orig)  # ceil(new * n / orig)
    return out.reshape(-1)[:target]


# ---- mel scales and filter banks --------------------------------------------------------------


def _slaney_hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's auditory-toolbox mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    linear = f / (200.0 / 3.0)
    log_step = math.log(6.4) / 27.0
    logarithmic = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / log_step
    return np.where(f >= 1000.0, logarithmic, linear)


def _slaney_mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    linear = m * (200.0 / 3.0)
    log_step = math.log(6.4) / 27.0
    logarithmic = 1000.0 * np.exp(log_step * (m - 15.0))
    return np.where(m >= 15.0, logarithmic, linear)


@functools.lru_cache(maxsize=8)
def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """Triangular mel filters on the Slaney scale with Slaney area normalisation: float32 (n_mels, n_fft // 2 + 1).

    Band edges are n_mels + 2 points equally spaced in Slaney mel between fmin and fmax (default Nyquist);
    filter i rises from edge i to edge i + 1, falls to edge i + 2, and is scaled by 2 / (edge[i+2] - edge[i]) Hz.
    (The filters of whisper's `mel_filters.npz` and of Matcha's `librosa_mel_fn`.)
    """
    fmax = sample_rate / 2.0 if fmax is None else fmax
    fft_hz = np.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1)
    mel_edges = np.linspace(_slaney_hz_to_mel(np.array(fmin)), _slaney_hz_to_mel(np.array(fmax)), n_mels + 2)
    edges = _slaney_mel_to_hz(mel_edges)
    widths = np.diff(edges)
    rising = (fft_hz[None, :] - edges[:-2, None]) / widths[:-1, None]
    falling = (edges[2:, None] - fft_hz[None, :]) / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling)) * (2.0 / (edges[2:] - edges[:-2]))[:, None]
    filters = weights.astype(np.float32)
    filters.setflags(write=False)
    return np.asarray(filters, dtype=np.float32)


def _kaldi_mel(f: np.ndarray) -> np.ndarray:
    return 1127.0 * np.log1p(np.asarray(f, dtype=np.float64) / 700.0)


@functools.lru_cache(maxsize=2)
def kaldi_mel_banks(n_mels: int = FBANK_MELS, sample_rate: int = 16_000, n_fft: int = FBANK_NFFT) -> np.ndarray:
    """Kaldi's triangular mel banks (mel = 1127 ln(1 + f/700)), 20 Hz to Nyquist: float64 (n_mels, n_fft // 2 + 1).

    Triangles are built in the mel domain on FFT bins 0 .. n_fft/2 - 1; the last (Nyquist) bin gets weight 0.
    """
    mel_low, mel_high = _kaldi_mel(np.array(FBANK_LOW_HZ)), _kaldi_mel(np.array(sample_rate / 2.0))
    delta = (mel_high - mel_low) / (n_mels + 1)
    left = mel_low + delta * np.arange(n_mels)[:, None]
    center, right = left + delta, left + 2 * delta
    mel = _kaldi_mel(sample_rate / n_fft * np.arange(n_fft // 2))[None, :]
    banks = np.maximum(0.0, np.minimum((mel - left) / (center - left), (right - mel) / (right - center)))
    banks = np.concatenate([banks, np.zeros((n_mels, 1))], axis=1)
    banks.setflags(write=False)
    return banks


# ---- features ---------------------------------------------------------------------------------


def _frames(x: np.ndarray, size: int, hop: int) -> np.ndarray:
    """Read-only view (1 + (N - size) // hop, size) of the frames of `x` (no padding)."""
    return np.lib.stride_tricks.sliding_window_view(x, size)[::hop]


def kaldi_fbank(x16k: np.ndarray) -> np.ndarray:
    """`torchaudio.compliance.kaldi.fbank(x, num_mel_bins=80, dither=0, sample_frequency=16000)`: float32 (T, 80).

    `x16k` (N,) float in [-1, 1] at 16 kHz (no int16 scaling), N >= 400. T = 1 + (N - 400) // 160 (snip_edges).
    Per frame: DC removal, pre-emphasis 0.97, povey window, 512-point power spectrum, Kaldi mel banks,
    natural log floored at float32 eps. Raw log energies; see `subtract_mean` for the campplus input.
    """
    x = np.asarray(x16k, dtype=np.float64).reshape(-1)
    if x.shape[0] < FBANK_FRAME:
        raise ValueError(f"kaldi_fbank needs at least {FBANK_FRAME} samples, got {x.shape[0]}")
    frames = _frames(x, FBANK_FRAME, FBANK_SHIFT)
    frames = frames - frames.mean(axis=1, keepdims=True)
    previous = np.concatenate([frames[:, :1], frames[:, :-1]], axis=1)
    frames = frames - FBANK_PREEMPHASIS * previous
    povey = (0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(FBANK_FRAME) / (FBANK_FRAME - 1))) ** 0.85
    spectrum = np.fft.rfft(frames * povey, n=FBANK_NFFT, axis=1)
    power = spectrum.real**2 + spectrum.imag**2
    energies = power @ kaldi_mel_banks().T
    return np.asarray(np.log(np.maximum(energies, FBANK_EPS)).astype(np.float32), dtype=np.float32)


def subtract_mean(fbank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The frontend's per-utterance normalisation: (fbank - mean over frames, that mean), both float32."""
    mean = fbank.astype(np.float64).mean(axis=0)
    return (fbank - mean).astype(np.float32), mean.astype(np.float32)


def whisper_log_mel(x16k: np.ndarray, n_mels: int = 128) -> np.ndarray:
    """`whisper.log_mel_spectrogram(x, n_mels)` (openai-whisper 20231117): float32 (n_mels, N // 160).

    `x16k` (N,) float at 16 kHz, N > 200. Periodic Hann(400) STFT, hop 160, centred with reflect padding,
    last frame dropped; power; Slaney mel filters (16 kHz, n_fft 400); log10 floored at 1e-10 and at
    (max - 8); then (x + 4) / 4.
    """
    x = np.asarray(x16k, dtype=np.float64).reshape(-1)
    pad = WHISPER_NFFT // 2
    if x.shape[0] <= pad:
        raise ValueError(f"whisper_log_mel needs more than {pad} samples, got {x.shape[0]}")
    padded = np.pad(x, pad, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(WHISPER_NFFT) / WHISPER_NFFT)
    frames = _frames(padded, WHISPER_NFFT, WHISPER_HOP)[: x.shape[0] // WHISPER_HOP]
    spectrum = np.fft.rfft(frames * window, axis=1)
    power = spectrum.real**2 + spectrum.imag**2
    mel = slaney_mel_filters(WHISPER_RATE, WHISPER_NFFT, n_mels).astype(np.float64) @ power.T
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return np.asarray(((log_spec + 4.0) / 4.0).astype(np.float32), dtype=np.float32)


def prompt_mel80(x: np.ndarray, sample_rate: int = 22_050) -> np.ndarray:
    """Matcha's `mel_spectrogram` with the v1 yaml values, transposed: float32 (N // 256, 80).

    `x` (N,) float, N > 384. Reflect padding of 384 samples per side, periodic Hann(1024) STFT with hop 256
    and no centring, magnitude sqrt(re^2 + im^2 + 1e-9), Slaney mel filters for `sample_rate` / n_fft 1024
    between 0 and 8000 Hz, natural log floored at 1e-5. The official code always builds the filters for
    22,050 Hz (its yaml rate), whatever rate the samples were taken at; pass 22050 to reproduce it.
    """
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    pad = (MEL80_NFFT - MEL80_HOP) // 2
    if x.shape[0] <= pad:
        raise ValueError(f"prompt_mel80 needs more than {pad} samples, got {x.shape[0]}")
    padded = np.pad(x, pad, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(MEL80_NFFT) / MEL80_NFFT)
    spectrum = np.fft.rfft(_frames(padded, MEL80_NFFT, MEL80_HOP) * window, axis=1)
    magnitude = np.sqrt(spectrum.real**2 + spectrum.imag**2 + 1e-9)
    filters = slaney_mel_filters(int(sample_rate), MEL80_NFFT, MEL80_MELS, 0.0, MEL80_FMAX_HZ).astype(np.float64)
    return np.log(np.maximum(magnitude @ filters.T, 1e-5)).astype(np.float32)
