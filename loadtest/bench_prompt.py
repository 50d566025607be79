"""Benchmark: time to analyse a prompt recording, without the two prompt models and with the tiny stand-ins.

The real CAM++ (`campplus.onnx`, 28 MB) and S3 tokenizer (`speech_tokenizer_v1.onnx`, about 500 MB in the
release) cannot be downloaded here; the committed tiny bundle carries functional stand-ins with the released
inputs and outputs, so the "with models" figure is the numpy front end plus two small ONNX calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.layers.features import kaldi_fbank, prompt_mel80, resample, subtract_mean, whisper_log_mel
from service.layers.prompt import PromptAnalyzer

REPO = Path(__file__).resolve().parents[1]


def speechlike(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """A voiced, amplitude-modulated signal with noise: decodes and analyses like a recording of that length."""
    g = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    voiced = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / rate) / k for k in range(1, 8))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    return (0.2 * voiced * envelope + 0.01 * g.standard_normal(t.size)).astype(np.float32)


def features_only(audio: np.ndarray, rate: int) -> None:
    """What the analysis computes besides the two models (official frontend order)."""
    x16 = resample(audio, rate, 16_000)
    subtract_mean(kaldi_fbank(x16))
    whisper_log_mel(x16)
    prompt_mel80(resample(x16, 16_000, 22_050))


def timed(fn: object, reps: int) -> dict[str, float]:
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        runs.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(runs), "min_s": min(runs), "max_s": max(runs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rate", type=int, default=48_000, help="sample rate of the uploaded recording")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--bundle", type=Path, default=REPO / "models" / "tiny")
    args = p.parse_args(argv)
    audio = speechlike(args.seconds, args.rate)
    bundle = ModelBundle.load(args.bundle)
    analyzer = PromptAnalyzer.load(
        bundle.prompt_model_path("campplus"), bundle.prompt_model_path("speech_tokenizer"), RuntimeOptions(intra_op_threads=2)
    )
    features_only(audio, args.rate)  # warm-up: filter banks and resampling kernels are built once
    analyzer.analyze(audio, args.rate)
    result = {
        "prompt_seconds": args.seconds,
        "source_rate_hz": args.rate,
        "features_only": timed(lambda: features_only(audio, args.rate), args.reps),
        "with_stand_in_models": timed(lambda: analyzer.analyze(audio, args.rate), args.reps),
        "stand_in_bundle": str(args.bundle),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
