"""Replay the prompt fixtures (prompts.npz + prompts/*.wav + stand-in models) through our prompt analysis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from service.audio.decode import decode_audio
from service.engine.options import RuntimeOptions
from service.layers.features import kaldi_fbank, resample, subtract_mean, whisper_log_mel
from service.layers.prompt import MAX_PROMPT_S, PromptAnalyzer
from service.verify.checks import Check, max_abs, mismatches

PROMPTS_FILE = "prompts.npz"
PROMPT_MODELS = ("campplus.onnx", "speech_tokenizer_v1.onnx")

# Max abs error bounds; measured on the tiny fixtures (float64 numpy vs torch float32): resample 2.4e-7,
# fbank 6.5e-4 (bins at ln e ~ -15), fbank mean 2.1e-5, whisper mel 4.1e-5, 80-bin mel 3.4e-4, embedding 1.6e-5.
TOL_RESAMPLE = 1e-6
TOL_FBANK = 2e-3
TOL_FBANK_MEAN = 1e-4
TOL_WHISPER_MEL = 1e-4
TOL_MEL80 = 1e-3
TOL_EMBEDDING = 1e-4
# Tokens from our own whisper mel are compared where the recorded top-1/top-2 margin exceeds this. The
# per-token flip bound derived from the stand-in tokenizer's weights and our measured mel error
# (tests/test_prompt_analyzer.py) is at most 2.7e-3 on these prompts; tokens below it may flip legitimately.
SAFE_TOKEN_MARGIN = 5e-3


def prompt_names(npz: Any) -> list[str]:
    """Prompt names present in prompts.npz (from arrays named `<prompt>_speech_16k`)."""
    return sorted(k.removesuffix("_speech_16k") for k in npz.files if k.endswith("_speech_16k"))


def verify_prompts(fixtures: Path, runtime: RuntimeOptions | None = None) -> Iterator[Check]:
    """Per prompt: resampling, fbank, whisper mel, tokens of the recorded mel, and analyze() of the WAV file."""
    analyzer = PromptAnalyzer.load(fixtures / PROMPT_MODELS[0], fixtures / PROMPT_MODELS[1], runtime)
    with np.load(fixtures / PROMPTS_FILE) as npz:
        for name in prompt_names(npz):
            want = {k.removeprefix(name + "_"): npz[k] for k in npz.files if k.startswith(name + "_")}
            yield from _stage_checks(analyzer, name, want)
            wav = fixtures / "prompts" / f"{name}.wav"
            if wav.is_file():
                yield from _file_checks(analyzer, name, wav, want)


def _stage_checks(analyzer: PromptAnalyzer, name: str, want: dict[str, np.ndarray]) -> Iterator[Check]:
    """Each stage fed with the recorded input of that stage."""
    speech_16k = want["speech_16k"][0]
    got_22k = resample(speech_16k, 16_000, 22_050)
    yield Check("prompt", f"{name} resample 16k->22050", max_abs(got_22k, want["legacy_speech_22050"][0]), TOL_RESAMPLE)
    fbank, mean = subtract_mean(kaldi_fbank(speech_16k))
    yield Check("prompt", f"{name} fbank", max_abs(fbank, want["fbank"]), TOL_FBANK)
    yield Check("prompt", f"{name} fbank mean", max_abs(mean, want["fbank_mean"]), TOL_FBANK_MEAN)
    yield Check("prompt", f"{name} whisper mel", max_abs(whisper_log_mel(speech_16k), want["whisper_mel"]), TOL_WHISPER_MEL)
    tokens = analyzer.speech_tokens(want["whisper_mel"])
    yield Check("prompt", f"{name} tokens (recorded mel)", mismatches(tokens, want["speech_token"]), 0.0)


def _file_checks(analyzer: PromptAnalyzer, name: str, wav: Path, want: dict[str, np.ndarray]) -> Iterator[Check]:
    """The whole path from the WAV file: decode, resample, analyze (both mel variants)."""
    audio, rate = decode_audio(wav.read_bytes(), max_seconds=MAX_PROMPT_S)
    for target in (16_000, 24_000):
        error = max_abs(resample(audio, rate, target), want[f"speech_{target // 1000}k"][0])
        yield Check("prompt", f"{name} resample file->{target // 1000}k", error, TOL_RESAMPLE)
    trained = analyzer.analyze(audio, rate)
    official = analyzer.analyze(audio, rate, mel_variant="official-24k")
    yield Check("prompt", f"{name} embedding", max_abs(trained.embedding, want["embedding"]), TOL_EMBEDDING)
    safe = want["token_score_margin"] > SAFE_TOKEN_MARGIN
    got, ref = trained.speech_tokens, want["speech_token"]
    error = mismatches(got[safe], ref[safe]) if got.shape == ref.shape else float("inf")
    yield Check("prompt", f"{name} tokens own mel ({int(safe.sum())}/{safe.size})", error, 0.0)
    yield Check("prompt", f"{name} mel80 official-24k", max_abs(official.mel, want["mel80"]), TOL_MEL80)
    yield Check("prompt", f"{name} mel80 trained (legacy)", max_abs(trained.mel, want["legacy_mel80"]), TOL_MEL80)
