"""HiFT vocoder runner: f0 graph, numpy SineGen, source graph, STFT, decode graph, iSTFT (spec §5)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.bundle import ModelConstants
from service.layers.dsp import hann_window, istft, stft

MAX_MAGNITUDE = 100.0  # the official decoder clips exp(log-magnitude) here before the iSTFT


@dataclass(frozen=True)
class HiFTNoise:
    """The random draws of one SineGen call.

    phase: (H,) float32 initial phase per harmonic in radians, phase[0] == 0 (H = nb_harmonics + 1).
    sine_noise: (H, L) float32 standard normal, one value per harmonic and output sample.
    """

    phase: np.ndarray
    sine_noise: np.ndarray


def draw_hift_noise(rng: np.random.Generator, n_harmonics: int, n_samples: int) -> HiFTNoise:
    """Draw SineGen's phase (uniform in [-pi, pi), fundamental fixed at 0) and Gaussian noise from `rng`."""
    phase = rng.uniform(-math.pi, math.pi, size=n_harmonics).astype(np.float32)
    phase[0] = 0.0
    noise = rng.standard_normal((n_harmonics, n_samples), dtype=np.float32)
    return HiFTNoise(phase=phase, sine_noise=noise)


def sine_excitation(f0: np.ndarray, samples_per_frame: int, constants: ModelConstants, noise: HiFTNoise) -> np.ndarray:
    """SineGen: harmonic sines of the frame-rate f0 contour plus noise, as (L, H) float32 with L = T * samples_per_frame.

    f0 (T,) in Hz is repeated per sample (nearest upsampling). The running phase is a cumulative sum
    accumulated in float64 and rounded to float32 per sample before `% 1`, as torch's CPU cumsum does;
    a float32 accumulation drifts by ~1e-2 over a few seconds of voiced audio.
    """
    n_harm = constants.nb_harmonics + 1
    f0u = np.repeat(np.asarray(f0, dtype=np.float32), samples_per_frame)  # (L,)
    mult = np.arange(1, n_harm + 1, dtype=np.float32)[:, None]
    freq = (f0u[None, :] * mult) / np.float32(constants.sample_rate)  # (H, L) cycles per sample
    cycles = np.cumsum(freq, axis=1, dtype=np.float64).astype(np.float32)
    theta = np.float32(2.0 * math.pi) * np.mod(cycles, np.float32(1.0))
    sines = np.float32(constants.sine_amp) * np.sin(theta + noise.phase[:, None])
    voiced = (f0u > np.float32(constants.voiced_threshold_hz)).astype(np.float32)[None, :]
    noise_amp = voiced * np.float32(constants.noise_std) + (np.float32(1.0) - voiced) * np.float32(constants.sine_amp / 3)
    waves = sines * voiced + noise_amp * noise.sine_noise
    return np.ascontiguousarray(waves.T, dtype=np.float32)


class HiFTRunner:
    """Runs the three HiFT graphs of a bundle with the numpy parts in between; batch 1, thread-safe."""

    def __init__(self, sessions: Mapping[str, Any], constants: ModelConstants) -> None:
        self._f0 = sessions["hift_f0"]
        self._source = sessions["hift_source"]
        self._decode = sessions["hift_decode"]
        self.constants = constants
        self.samples_per_frame = math.prod(constants.upsample_rates) * constants.istft_hop
        self.n_harmonics = constants.nb_harmonics + 1
        self._window = hann_window(constants.istft_n_fft)

    def predict_f0(self, mel: np.ndarray) -> np.ndarray:
        """f0 in Hz, (T,) float32, for a log-mel (n_mels, T)."""
        (f0,) = self._f0.run(["f0"], {"mel": _batch(mel)})
        return np.asarray(f0[0], dtype=np.float32)

    def source(self, sine: np.ndarray) -> np.ndarray:
        """Excitation tanh(l_linear(sine)) as (L,) float32 from SineGen output (L, H)."""
        (src,) = self._source.run(["source"], {"sine": _batch(sine)})
        return np.asarray(src[0, 0], dtype=np.float32)

    def decode(self, mel: np.ndarray, source: np.ndarray) -> np.ndarray:
        """Waveform (L,) float32 in ±audio_limit from mel (n_mels, T) and excitation (L,) with L = T * 256."""
        c = self.constants
        s = stft(source, c.istft_n_fft, c.istft_hop, self._window)  # (bins, frames)
        s_stft = np.concatenate([s.real, s.imag], axis=0).astype(np.float32)
        (x,) = self._decode.run(["x"], {"mel": _batch(mel), "s_stft": s_stft[None]})
        n_bins = c.istft_n_fft // 2 + 1
        magnitude = np.minimum(np.exp(x[0, :n_bins]), np.float32(MAX_MAGNITUDE))
        phase = np.sin(x[0, n_bins:])
        spec = magnitude * np.cos(phase) + 1j * (magnitude * np.sin(phase))
        wav = istft(spec, c.istft_n_fft, c.istft_hop, self._window)
        return np.asarray(np.clip(wav, -c.audio_limit, c.audio_limit).astype(np.float32), dtype=np.float32)

    def excitation(self, mel: np.ndarray, cache_source: np.ndarray, noise: HiFTNoise) -> np.ndarray:
        """Source (L,) for mel (n_mels, T); its first len(cache_source) samples are replaced by the cache."""
        f0 = self.predict_f0(mel)
        src = self.source(sine_excitation(f0, self.samples_per_frame, self.constants, noise))
        n = cache_source.shape[-1]
        if n:
            src[:n] = cache_source
        return src

    def inference(self, mel: np.ndarray, cache_source: np.ndarray, noise: HiFTNoise) -> tuple[np.ndarray, np.ndarray]:
        """Vocode mel (n_mels, T) -> (wav (L,), source (L,)), L = T * samples_per_frame.

        `cache_source` (n,) overwrites the head of the generated source (streaming continuity; n may be 0).
        `noise` must hold `n_harmonics` phases and (n_harmonics, L) noise (see `draw_hift_noise`).
        """
        src = self.excitation(mel, cache_source, noise)
        return self.decode(mel, src), src

    def n_samples(self, n_frames: int) -> int:
        """Output samples for n_frames mel frames."""
        return n_frames * self.samples_per_frame


def _batch(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)[None]
