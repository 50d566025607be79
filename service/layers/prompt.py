"""Voice-cloning prompt analysis (official v1 frontend): speaker embedding, speech tokens and prompt mel.

Prompt-mel variant. The v1 flow was trained on 80-bin mels of 22,050 Hz audio (86.13 frames/s, filters built
for 22,050 Hz). The official frontend computed the prompt mel from `Resample(16000, 22050)` of the 16 kHz
prompt until commit 622a3a1 (2025-12-08); since then it feeds the 24 kHz prompt to the same 22,050 Hz
extractor, which stretches the frequency axis by 24000/22050 and gives 93.75 frames/s. We serve the rate
the model was trained for ("trained", the default): source -> 16 kHz -> 22,050 Hz, which reproduces the
fixture `legacy_mel80` (resampling the source straight to 22,050 Hz keeps energy between 7.92 and 8 kHz
that the 16 kHz route removes, and misses that fixture by up to 1.6 in log-mel). "official-24k" reproduces
the current official `mel80` (source -> 24 kHz) for parity with the upstream code.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self

import numpy as np

from service.engine.options import RuntimeOptions
from service.engine.sessions import open_graph
from service.errors import EngineError, PromptAudioError, PromptAudioProblem
from service.layers.features import kaldi_fbank, prompt_mel80, resample, subtract_mean, whisper_log_mel

MelVariant = Literal["trained", "official-24k"]
MEL_VARIANTS: tuple[MelVariant, ...] = ("trained", "official-24k")

PROMPT_RATE_HZ = 16_000  # embedding and tokenizer input rate
MIN_SOURCE_RATE_HZ = 16_000  # the official load_wav asserts this; lower rates lack the 4-8 kHz band
MAX_PROMPT_S = 30.0  # the frontend asserts the 16 kHz prompt is at most 30 s
MIN_PROMPT_S = 1.0  # shorter prompts carry too little voice for cloning (and < 25 ms has no fbank frame)
SILENCE_PEAK = 1e-4  # peak amplitude below which a prompt is treated as silence (about 3 int16 steps)
MEL_MODEL_RATE_HZ = 22_050  # flow frame rate and the rate its mel filters are built for
_MEL_SOURCE_RATE_HZ: dict[MelVariant, int] = {"trained": MEL_MODEL_RATE_HZ, "official-24k": 24_000}
EMBEDDING_DIM = 192


@dataclass(frozen=True)
class PromptAnalysis:
    """What the v1 model needs from a prompt recording.

    embedding: (192,) float32 raw campplus output (the LLM and flow normalise it themselves).
    speech_tokens: (T_tok,) int32, 50 per second of the 16 kHz prompt.
    mel: (T_mel, 80) float32 natural-log mel (`prompt_speech_feat`), `mel_rate_hz` / 256 frames per second.
    duration_s: length of the 16 kHz prompt in seconds; source_rate_hz: rate the audio arrived at.
    timings_s: wall time per stage (resample, fbank, embedding, whisper_mel, tokens, mel).
    """

    embedding: np.ndarray
    speech_tokens: np.ndarray
    mel: np.ndarray
    mel_variant: MelVariant
    mel_rate_hz: int
    duration_s: float
    source_rate_hz: int
    timings_s: dict[str, float] = field(default_factory=dict)


class PromptAnalyzer:
    """Runs the two prompt models (campplus, speech tokenizer v1) on features computed in numpy.

    Sessions are any objects with ORT's `run(output_names, feeds)`; `load` opens the ONNX files.
    """

    def __init__(
        self, campplus: Any, tokenizer: Any, *, max_seconds: float = MAX_PROMPT_S, min_seconds: float = MIN_PROMPT_S
    ) -> None:
        if not 0 < min_seconds <= max_seconds:
            raise ValueError("need 0 < min_seconds <= max_seconds")
        self.campplus = campplus
        self.tokenizer = tokenizer
        self.max_seconds = max_seconds
        self.min_seconds = min_seconds

    @classmethod
    def load(cls, campplus_path: Path | str, tokenizer_path: Path | str, options: RuntimeOptions | None = None) -> Self:
        """Open `campplus.onnx` and `speech_tokenizer_v1.onnx` on the CPU; raises BundleError if unreadable."""
        return cls(
            open_graph(Path(campplus_path), options, "campplus"), open_graph(Path(tokenizer_path), options, "speech_tokenizer")
        )

    def embedding(self, fbank: np.ndarray) -> np.ndarray:
        """Campplus on a mean-subtracted fbank (T, 80) float32: the raw speaker embedding (192,) float32."""
        feeds = {"input": np.ascontiguousarray(fbank, dtype=np.float32)[None]}
        (out,) = self.campplus.run(["output"], feeds)
        emb = np.asarray(out, dtype=np.float32).reshape(-1)
        if emb.shape != (EMBEDDING_DIM,) or not np.all(np.isfinite(emb)):
            raise EngineError(f"campplus returned {emb.shape} (finite: {bool(np.all(np.isfinite(emb)))}), expected (192,)")
        return emb

    def speech_tokens(self, whisper_mel: np.ndarray) -> np.ndarray:
        """Speech tokenizer v1 on a whisper log-mel (128, T) float32: tokens ((T - 1) // 2 + 1,) int32."""
        feats = np.ascontiguousarray(whisper_mel, dtype=np.float32)[None]
        (out,) = self.tokenizer.run(["indices"], {"feats": feats, "feats_length": np.array([feats.shape[2]], np.int32)})
        tokens = np.asarray(out).reshape(-1)
        if tokens.shape[0] != (feats.shape[2] - 1) // 2 + 1:
            raise EngineError(f"speech tokenizer returned {tokens.shape[0]} tokens for {feats.shape[2]} frames")
        return tokens.astype(np.int32)

    def analyze(self, audio: np.ndarray, sample_rate: int, *, mel_variant: MelVariant = "trained") -> PromptAnalysis:
        """Embedding, speech tokens and prompt mel of a mono recording `audio` (N,) float32 at `sample_rate` Hz.

        Refuses (PromptAudioError) rates below 16 kHz, prompts whose 16 kHz version is longer than
        `max_seconds` or shorter than `min_seconds`, silent or non-finite audio.
        """
        if mel_variant not in MEL_VARIANTS:
            raise ValueError(f"mel_variant must be one of {MEL_VARIANTS}, got {mel_variant!r}")
        x = self._check(audio, sample_rate)
        timings: dict[str, float] = {}
        clock = time.perf_counter()

        def lap(stage: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            timings[stage] = timings.get(stage, 0.0) + now - clock
            clock = now

        speech_16k = resample(x, sample_rate, PROMPT_RATE_HZ)
        lap("resample")
        fbank, _ = subtract_mean(kaldi_fbank(speech_16k))
        lap("fbank")
        embedding = self.embedding(fbank)
        lap("embedding")
        feats = whisper_log_mel(speech_16k)
        lap("whisper_mel")
        tokens = self.speech_tokens(feats)
        lap("tokens")
        mel_rate = _MEL_SOURCE_RATE_HZ[mel_variant]
        mel_input = (
            resample(speech_16k, PROMPT_RATE_HZ, mel_rate) if mel_variant == "trained" else resample(x, sample_rate, mel_rate)
        )
        mel = prompt_mel80(mel_input, MEL_MODEL_RATE_HZ)
        lap("mel")
        return PromptAnalysis(
            embedding=embedding,
            speech_tokens=tokens,
            mel=mel,
            mel_variant=mel_variant,
            mel_rate_hz=mel_rate,
            duration_s=speech_16k.shape[0] / PROMPT_RATE_HZ,
            source_rate_hz=int(sample_rate),
            timings_s=timings,
        )

    def _check(self, audio: np.ndarray, sample_rate: int) -> np.ndarray:
        """Validate the recording before any work; returns it as contiguous float32 (N,)."""
        x = np.asarray(audio)
        if x.ndim != 1:
            raise ValueError(f"prompt audio must be mono (N,), got shape {x.shape}")
        if sample_rate < MIN_SOURCE_RATE_HZ:
            raise PromptAudioError(
                f"prompt audio sample rate {sample_rate} Hz is below {MIN_SOURCE_RATE_HZ} Hz",
                reason=PromptAudioProblem.SAMPLE_RATE,
            )
        seconds = math.ceil(x.shape[0] * PROMPT_RATE_HZ / sample_rate) / PROMPT_RATE_HZ
        if seconds > self.max_seconds:
            raise PromptAudioError(
                f"prompt audio is {seconds:.2f} s, longer than {self.max_seconds:g} s", reason=PromptAudioProblem.TOO_LONG
            )
        if seconds < self.min_seconds:
            raise PromptAudioError(
                f"prompt audio is {seconds:.2f} s, shorter than {self.min_seconds:g} s", reason=PromptAudioProblem.TOO_SHORT
            )
        x = np.ascontiguousarray(x, dtype=np.float32)
        if not np.all(np.isfinite(x)):
            raise PromptAudioError("prompt audio contains NaN or infinite samples", reason=PromptAudioProblem.CORRUPT)
        if float(np.max(np.abs(x))) < SILENCE_PEAK:
            raise PromptAudioError("prompt audio is silent", reason=PromptAudioProblem.SILENT)
        return x
