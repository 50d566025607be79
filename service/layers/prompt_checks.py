"""What the Qwen2-based 24 kHz families verify alike against their reference fixtures: the serving tokenizer on the
official ids (`tokenizer_cases.json`) and the prompt analysis, feature by feature and from the WAV files (`prompts.npz`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from service.audio.decode import decode_audio
from service.engine.options import RuntimeOptions
from service.layers.features import kaldi_fbank, resample, subtract_mean, whisper_log_mel
from service.layers.prompt import MAX_PROMPT_S
from service.layers.prompt24k import MEL_RATE_HZ, PromptAnalyzer2, prompt_mel
from service.layers.qwen_tokenizer import Qwen2Tokenizer
from service.verify.checks import Check, max_abs, mismatches

PROMPTS_FILE = "prompts.npz"
TOL = 1e-4
# Prompt features are numpy float64 against torch float32 (as for v1, service/verify_prompts.py): log-mel bins of
# near-silent frames differ in the 4th decimal.
TOL_RESAMPLE, TOL_FBANK, TOL_WHISPER_MEL, TOL_MEL80 = 1e-6, 2e-3, 1e-4, 1e-3
SAFE_FSQ_MARGIN = 5e-3  # tokens whose FSQ values were closer to a rounding boundary may flip on our own whisper mel


# ---- text ---------------------------------------------------------------------------------------


def verify_tokenizer(tokenizer: Qwen2Tokenizer, path: Path) -> Iterator[Check]:
    """The serving tokenizer on every recorded normalized sentence and raw text: the official ids exactly."""
    for i, case in enumerate(json.loads(path.read_text(encoding="utf-8"))["cases"]):
        got = [tokenizer.encode(s) for s in case["normalized_sentences"]]
        bad = sum(mismatches(g, w) > 0 for g, w in zip(got, case["ids"], strict=False)) + abs(len(got) - len(case["ids"]))
        yield Check("tokenizer", f"case{i} ({case['name']}) ids", float(bad), 0.0)
        if "raw_ids" in case:
            yield Check(
                "tokenizer", f"case{i} ({case['name']}) raw ids", mismatches(tokenizer.encode(case["text"]), case["raw_ids"]), 0.0
            )


# ---- prompt analysis ----------------------------------------------------------------------------


def verify_prompts(
    fixtures: Path, runtime: RuntimeOptions | None, kind: type[PromptAnalyzer2], models: tuple[str, str]
) -> Iterator[Check]:
    """Per prompt: each feature from its recorded input, then the whole analysis of the WAV file, with the family's
    analyzer (`kind`) over its prompt models (`models`: CAM++ and speech tokenizer files in `fixtures`, which the
    caller checks are there: `skip_reason`)."""
    analyzer = kind.load(fixtures / models[0], fixtures / models[1], runtime)
    with np.load(fixtures / PROMPTS_FILE) as npz:
        names = sorted(k.removesuffix("_speech_16k") for k in npz.files if k.endswith("_speech_16k"))
        for name in names:
            want = {k.removeprefix(name + "_"): npz[k] for k in npz.files if k.startswith(name + "_")}
            speech_16k = want["speech_16k"]
            yield Check("prompt", f"{name} fbank", max_abs(subtract_mean(kaldi_fbank(speech_16k))[0], want["fbank"]), TOL_FBANK)
            yield Check(
                "prompt", f"{name} whisper mel", max_abs(whisper_log_mel(speech_16k), want["whisper_mel"]), TOL_WHISPER_MEL
            )
            mel80 = prompt_mel(want["speech_24k"], analyzer.mel_fmax_hz)
            yield Check("prompt", f"{name} mel80 (24 kHz)", max_abs(mel80, want["mel80"]), TOL_MEL80)
            yield Check("prompt", f"{name} embedding", max_abs(analyzer.embedding(want["fbank"]), want["embedding"]), TOL)
            tokens = analyzer.speech_tokens(want["whisper_mel"])
            yield Check("prompt", f"{name} tokens (recorded mel)", mismatches(tokens, want["speech_token"]), 0.0)
            wav = fixtures / "prompts" / f"{name}.wav"
            if wav.is_file():
                yield from _file_checks(analyzer, name, wav, want)


def _file_checks(analyzer: PromptAnalyzer2, name: str, wav: Path, want: dict[str, np.ndarray]) -> Iterator[Check]:
    audio, rate = decode_audio(wav.read_bytes(), max_seconds=MAX_PROMPT_S)
    for target, key in ((16_000, "speech_16k"), (MEL_RATE_HZ, "speech_24k")):
        yield Check(
            "prompt", f"{name} resample file->{target // 1000}k", max_abs(resample(audio, rate, target), want[key]), TOL_RESAMPLE
        )
    got = analyzer.analyze2(audio, rate)
    n = got.speech_tokens.shape[0]
    safe = want["fsq_margin"][:n] > SAFE_FSQ_MARGIN
    tokens_ok = got.speech_tokens.shape[0] == min(want["speech_token"].shape[0], want["mel80"].shape[0] // 2)
    error = mismatches(got.speech_tokens[safe], want["speech_token"][:n][safe]) if tokens_ok else float("inf")
    yield Check("prompt", f"{name} trimmed tokens, own mel ({int(safe.sum())}/{safe.size})", error, 0.0)
    yield Check("prompt", f"{name} trimmed mel80", max_abs(got.mel, want["mel80"][: 2 * n]), TOL_MEL80)
