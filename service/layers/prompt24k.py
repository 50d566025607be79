"""Prompt analysis of the 24 kHz families (official frontend_zero_shot): x-vector, 25 Hz speech tokens, 24 kHz prompt mel."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from service.errors import EngineError
from service.layers.features import kaldi_fbank, resample, slaney_mel_filters, subtract_mean, whisper_log_mel
from service.layers.prompt import PROMPT_RATE_HZ, PromptAnalyzer

MEL_RATE_HZ = 24_000  # the yaml's feat_extractor: matcha mel_spectrogram at the model's rate
MEL_NFFT = 1920
MEL_HOP = 480
MEL_BINS = 80
MEL_FMAX_HZ = 8000.0
SPEECH_TOKENS = 6561


def prompt_mel(x24k: np.ndarray, fmax_hz: float | None = MEL_FMAX_HZ) -> np.ndarray:
    """Matcha's `mel_spectrogram` with the CosyVoice2 yaml values, transposed: float32 (frames, 80), 50 frames/s.

    `x24k` (N,) float at 24 kHz, N > 720. Reflect padding of (1920 - 480) / 2 samples per side, periodic Hann(1920)
    STFT with hop 480 and no centring, magnitude sqrt(re^2 + im^2 + 1e-9), Slaney mel filters for 24 kHz / n_fft 1920
    between 0 and `fmax_hz` (CosyVoice2: 8000 Hz; None: 12 kHz, Fun-CosyVoice3's `fmax: null`), natural log floored
    at 1e-5.
    """
    x = np.asarray(x24k, dtype=np.float64).reshape(-1)
    pad = (MEL_NFFT - MEL_HOP) // 2
    if x.shape[0] <= pad:
        raise ValueError(f"prompt_mel needs more than {pad} samples, got {x.shape[0]}")
    padded = np.pad(x, pad, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(MEL_NFFT) / MEL_NFFT)
    frames = np.lib.stride_tricks.sliding_window_view(padded, MEL_NFFT)[::MEL_HOP]
    spectrum = np.fft.rfft(frames * window, axis=1)
    magnitude = np.sqrt(spectrum.real**2 + spectrum.imag**2 + 1e-9)
    filters = slaney_mel_filters(MEL_RATE_HZ, MEL_NFFT, MEL_BINS, 0.0, fmax_hz).astype(np.float64)
    return np.log(np.maximum(magnitude @ filters.T, 1e-5)).astype(np.float32)


@dataclass(frozen=True)
class PromptAnalysis2:
    """What a CosyVoice2 voice needs from a recording; tokens and mel cut to a common length (2 frames a token).

    embedding (192,) raw CAM++ output; speech_tokens (P,) int32 at 25 Hz; mel (2P, 80) natural-log mel at 50 frames/s.
    """

    embedding: np.ndarray
    speech_tokens: np.ndarray
    mel: np.ndarray
    duration_s: float
    source_rate_hz: int
    timings_s: dict[str, float] = field(default_factory=dict)


class PromptAnalyzer2(PromptAnalyzer):
    """The v1 analyzer's models and checks with the CosyVoice2 tokenizer (25 Hz) and prompt mel (24 kHz); a family
    whose prompt mel reaches higher sets `mel_fmax_hz` (None: up to 12 kHz)."""

    mel_fmax_hz: float | None = MEL_FMAX_HZ

    def speech_tokens(self, whisper_mel: np.ndarray) -> np.ndarray:
        """speech_tokenizer_v2 on a whisper log-mel (128, T) float32: tokens (about T / 4,) int32 in 0..6560."""
        feats = np.ascontiguousarray(whisper_mel, dtype=np.float32)[None]
        (out,) = self.tokenizer.run(["indices"], {"feats": feats, "feats_length": np.array([feats.shape[2]], np.int32)})
        tokens = np.asarray(out).reshape(-1)
        if not 0 < tokens.shape[0] <= feats.shape[2] or tokens.min() < 0 or tokens.max() >= SPEECH_TOKENS:
            raise EngineError(f"speech tokenizer returned {tokens.shape[0]} tokens (ids within 0..{SPEECH_TOKENS - 1}?)")
        return tokens.astype(np.int32)

    def analyze2(self, audio: np.ndarray, sample_rate: int) -> PromptAnalysis2:
        """Embedding, speech tokens and prompt mel of a mono recording (N,) float at `sample_rate` Hz (PromptAudioError
        for recordings the v1 analyzer refuses: below 16 kHz, too long or short, silent, not finite)."""
        x = self._check(audio, sample_rate)
        timings: dict[str, float] = {}
        clock = time.perf_counter()

        def lap(stage: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            timings[stage] = now - clock
            clock = now

        speech_16k = resample(x, sample_rate, PROMPT_RATE_HZ)
        lap("resample")
        embedding = self.embedding(subtract_mean(kaldi_fbank(speech_16k))[0])
        lap("embedding")
        tokens = self.speech_tokens(whisper_log_mel(speech_16k))
        lap("tokens")
        mel = prompt_mel(resample(x, sample_rate, MEL_RATE_HZ), self.mel_fmax_hz)
        lap("mel")
        n = min(mel.shape[0] // 2, tokens.shape[0])
        seconds = speech_16k.shape[0] / PROMPT_RATE_HZ
        return PromptAnalysis2(embedding, tokens[:n], mel[: 2 * n], seconds, int(sample_rate), timings)
