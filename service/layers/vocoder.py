"""The 24 kHz HiFT vocoder of CosyVoice2 and later families: its graphs with the SineGen2 source in numpy, and the
official streaming caches."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from service.bundle import ModelConstants
from service.layers.dsp import fade_in_out, interpolate_linear
from service.layers.hift import HiFTRunner


def _round(x: np.ndarray) -> np.ndarray:
    return np.asarray(x.astype(np.float32), dtype=np.float32)


def sine_phase(f0: np.ndarray, constants: ModelConstants) -> np.ndarray:
    """Instantaneous phase (L, H) float32 of the harmonics 1..H of the frame-rate f0 (T,), L = T * samples per frame.

    SineGen2 (the official source at rates other than 22,050 Hz): per-sample cycles (f0 * h / rate) % 1 taken
    once per frame, accumulated over frames (torch's CPU cumsum: float64 sum, float32 values), scaled to
    radians and to samples, then linearly interpolated back to the sample rate. Torch's CPU kernels use fused
    multiply-adds for the interpolation's source positions and blends; they are emulated here (one rounding
    each): a float32 evaluation in two roundings drifts by 1e-3 within a minute of audio.
    """
    up = math.prod(constants.upsample_rates) * constants.istft_hop
    n_frames = f0.shape[0]
    harmonics = np.arange(1, constants.nb_harmonics + 2, dtype=np.float32)
    cycles = np.mod(_round(f0[:, None] * harmonics[None, :]) / np.float32(constants.sample_rate), np.float32(1.0))
    total = np.cumsum(cycles, axis=0, dtype=np.float64).astype(np.float32)
    scaled = _round(_round(total * np.float32(2.0)) * np.float32(math.pi)) * np.float32(up)
    scale = np.float64(np.float32(1.0 / up))
    dst = (np.arange(n_frames * up, dtype=np.int64).astype(np.float32) + np.float32(0.5)).astype(np.float64)
    src = np.maximum(_round(scale * dst - 0.5), np.float32(0.0))
    i0 = np.minimum(np.floor(src).astype(np.int64), n_frames - 1)
    i1 = i0 + (i0 < n_frames - 1)
    lam1 = np.clip(src - i0.astype(np.float32), np.float32(0.0), np.float32(1.0))[:, None]
    lam0 = np.float32(1.0) - lam1
    far = _round(scaled[i1] * lam1)
    return _round(scaled[i0].astype(np.float64) * lam0 + far)


def sine_excitation2(f0: np.ndarray, constants: ModelConstants, noise: np.ndarray) -> np.ndarray:
    """SineGen2's noisy harmonic stack (L, H) float32 for f0 (T,) Hz and standard-normal `noise` (L, H).

    (Its random initial phases change no output sample: the interpolation never reads the first sample.)
    """
    up = math.prod(constants.upsample_rates) * constants.istft_hop
    f0_up = np.repeat(np.asarray(f0, dtype=np.float32), up)
    sines = np.sin(sine_phase(f0, constants)) * np.float32(constants.sine_amp)
    voiced = (f0_up > np.float32(constants.voiced_threshold_hz)).astype(np.float32)[:, None]
    amp = voiced * np.float32(constants.noise_std) + (np.float32(1.0) - voiced) * np.float32(constants.sine_amp / 3)
    return np.ascontiguousarray(sines * voiced + amp * noise, dtype=np.float32)


class Vocoder:
    """`HiFTGenerator.inference` of CosyVoice2: f0 graph, SineGen2 in numpy, source graph, decode graph.

    `wide`: the same graphs with a decode session on both cores (two intra-op threads), for the calls the chunk
    schedule gives the cores to (`inference(wide=True)`); the decode graph is most of a call's time.
    """

    def __init__(self, runner: HiFTRunner, wide: HiFTRunner | None = None) -> None:
        self.runner = runner
        self.wide = wide
        self.constants = runner.constants
        self.samples_per_frame = runner.samples_per_frame

    def noise_shape(self, frames: int) -> tuple[int, int]:
        """Shape of the standard-normal draw one call of `frames` mel frames consumes."""
        return frames * self.samples_per_frame, self.constants.nb_harmonics + 1

    def excitation(self, mel: np.ndarray, noise: np.ndarray) -> np.ndarray:
        """Source (L,) of mel (80, T): f0 graph, SineGen2 with `noise` (L, H), source graph."""
        return self.runner.source(sine_excitation2(self.runner.predict_f0(mel), self.constants, noise))

    def inference(
        self,
        mel: np.ndarray,
        cache_source: np.ndarray,
        noise: np.ndarray | None,
        source: np.ndarray | None = None,
        *,
        wide: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Mel (80, T) -> (wav (L,), source (L,)); the source's first len(cache_source) samples are the cache's.

        A given `source` (L,) is used as it is (parity checks replay a recorded excitation); else `noise` drives it.
        `wide` decodes on the wide session where there is one.
        """
        decoder = self.wide if wide and self.wide is not None else self.runner
        if source is not None:
            return decoder.decode(mel, np.ascontiguousarray(source, dtype=np.float32)), source
        if noise is None:
            raise ValueError("the vocoder needs noise or a source")
        source = self.excitation(mel, noise)
        n = cache_source.shape[-1]
        if n:
            source[:n] = cache_source
        return decoder.decode(mel, source), source


@dataclass
class VocoderCache:
    """What the streaming vocoder carries to the next chunk (official hift_cache_dict)."""

    mel: np.ndarray  # (80, mel_cache_len) the last mel frames, vocoded again in front of the next chunk
    source: np.ndarray  # (mel_cache_len * samples,) their source
    speech: np.ndarray  # (mel_cache_len * samples,) their audio, cross-faded into the next chunk's head


class VocoderStream:
    """Official CosyVoice2Model.token2wav's vocoder half: mel cache, source cache and a Hamming cross-fade.

    Each non-final chunk re-vocodes the previous chunk's last `mel_cache_len` frames in front of its own and
    holds back as many frames of audio; the final chunk returns everything left. `speed` != 1 (final,
    uncached call only, as the official) resizes the mel linearly, to at least one frame.

    The official code assumes every non-final piece has at least `mel_cache_len` frames (its caches and the
    cross-fade are that long). A streamed tempo change breaks that: at speed 4 a 10-token first chunk is 5 mel
    frames. So while nothing has been vocoded yet, a shorter non-final piece is held and vocoded with the next one
    (no audio for it yet); at speed 1 every non-final chunk is long enough and nothing changes.
    """

    def __init__(self, vocoder: Vocoder, rng: np.random.Generator) -> None:
        self.vocoder = vocoder
        c = vocoder.constants
        self.keep_frames = c.mel_cache_len
        self.keep_samples = c.mel_cache_len * vocoder.samples_per_frame
        self.window = np.hamming(2 * self.keep_samples)
        self.rng = rng
        self.cache: VocoderCache | None = None
        self._held: np.ndarray | None = None  # mel (80, < keep_frames) waiting for more before the first call

    def push(
        self, mel: np.ndarray, *, final: bool, speed: float = 1.0, source: np.ndarray | None = None, wide: bool = False
    ) -> np.ndarray:
        """Audio (N,) float32 for the next chunk's mel (80, T); `source` replays a recorded excitation (parity checks);
        `wide` decodes it on both cores (Vocoder.inference)."""
        cache = self.cache
        if self._held is not None:
            mel, self._held = np.concatenate([self._held, mel], axis=1), None
        if cache is not None:
            mel = np.concatenate([cache.mel, mel], axis=1)
        elif not final and mel.shape[1] < self.keep_frames:
            self._held = mel  # too short to fill the caches: vocoded with the next piece
            return np.zeros(0, dtype=np.float32)
        elif final and speed != 1.0:
            mel = interpolate_linear(mel, max(1, int(mel.shape[1] / speed)))
        noise = None
        if source is None:
            noise = self.rng.standard_normal(self.vocoder.noise_shape(mel.shape[1]), dtype=np.float32)
        cached_source = cache.source if cache is not None else np.zeros(0, dtype=np.float32)
        wav, source = self.vocoder.inference(mel, cached_source, noise, source, wide=wide)
        if cache is not None:
            wav = fade_in_out(wav, cache.speech, self.window)
        if final:
            self.cache = None
            return wav
        self.cache = VocoderCache(mel[:, -self.keep_frames :], source[-self.keep_samples :], wav[-self.keep_samples :])
        return wav[: -self.keep_samples]
