"""PromptAnalyzer with the stand-in campplus and speech tokenizer: every output against the official v1 fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from scipy.io import wavfile

from service.errors import EngineError, PromptAudioError, PromptAudioProblem
from service.layers.features import whisper_log_mel
from service.layers.prompt import PromptAnalysis, PromptAnalyzer

PROMPTS = ("zh_16k", "en_24k", "zh_44k", "en_48k_stereo")
TOL_EMBEDDING = 1e-4  # measured <= 1.6e-5 (|embedding| up to 24; ORT vs torch float32 on a 6e-4-off fbank)
TOL_MEL80 = 1e-3  # as in test_prompt_features
# Slack added to the token bound for float32 rounding of the scores themselves (ORT vs torch, |score| < 1).
SCORE_ROUNDING = 1e-5


@pytest.fixture(scope="module")
def prompts(ref_dir: Path) -> dict[str, np.ndarray]:
    with np.load(ref_dir / "prompts.npz") as npz:
        return {k: npz[k] for k in npz.files}


@pytest.fixture(scope="module")
def analyzer(ref_dir: Path) -> PromptAnalyzer:
    return PromptAnalyzer.load(ref_dir / "campplus.onnx", ref_dir / "speech_tokenizer_v1.onnx")


@pytest.fixture(scope="module")
def analyses(ref_dir: Path, analyzer: PromptAnalyzer) -> dict[tuple[str, str], PromptAnalysis]:
    out = {}
    for name in PROMPTS:
        rate, raw = wavfile.read(ref_dir / "prompts" / f"{name}.wav")
        x = raw.astype(np.float32) / np.float32(32768)
        x = x.mean(axis=1, dtype=np.float32) if x.ndim == 2 else x
        for variant in ("trained", "official-24k"):
            out[name, variant] = analyzer.analyze(x, rate, mel_variant=variant)  # type: ignore[arg-type]
    return out


def max_err(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))


@pytest.mark.parametrize("name", PROMPTS)
def test_embedding(analyses: dict[tuple[str, str], PromptAnalysis], prompts: dict[str, np.ndarray], name: str) -> None:
    got = analyses[name, "trained"].embedding
    assert got.dtype == np.float32 and got.shape == (192,)
    assert max_err(got, prompts[f"{name}_embedding"]) <= TOL_EMBEDDING


@pytest.mark.parametrize("name", PROMPTS)
def test_embedding_of_fixture_fbank(analyzer: PromptAnalyzer, prompts: dict[str, np.ndarray], name: str) -> None:
    assert max_err(analyzer.embedding(prompts[f"{name}_fbank"]), prompts[f"{name}_embedding"]) <= TOL_EMBEDDING


@pytest.mark.parametrize("name", PROMPTS)
def test_tokens_of_fixture_mel_are_exact(analyzer: PromptAnalyzer, prompts: dict[str, np.ndarray], name: str) -> None:
    got = analyzer.speech_tokens(prompts[f"{name}_whisper_mel"])
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, prompts[f"{name}_speech_token"])
    np.testing.assert_array_equal(got, prompts[f"{name}_tokenizer_out"].reshape(-1))


def token_flip_bounds(ref_dir: Path, ours: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per token, the largest change of (top-1 minus top-2) score that the mel difference `ours - ref` can cause.

    The stand-in computes scores = codebook^T tanh(conv2(tanh(conv1(mel)))) with unit-norm codes; conv2 has
    stride 2, so token t sees conv1 outputs 2t-1..2t+1, which see mel frames 2t-2..2t+2. tanh is 1-Lipschitz,
    so |d score_c| <= |d a2_t| <= s2 * |d a1 window| <= s2 * s1 * sqrt(3) * |d mel frames 2t-2..2t+2|_F, with
    s1, s2 the spectral norms of the unfolded conv weights (sqrt(3): each mel frame enters up to 3 conv1
    outputs). A margin moves by at most twice that. A token can only flip where its margin is below it.
    """
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(ref_dir / "speech_tokenizer_v1.onnx")).graph.initializer}
    s1 = np.linalg.norm(weights["w1"].reshape(weights["w1"].shape[0], -1), 2)
    s2 = np.linalg.norm(weights["w2"].reshape(weights["w2"].shape[0], -1), 2)
    np.testing.assert_allclose(np.linalg.norm(weights["codebook"], axis=0), 1.0, rtol=1e-5)
    diff = np.pad(ours.astype(np.float64) - ref, ((0, 0), (2, 2)))
    n_tokens = (ref.shape[1] - 1) // 2 + 1
    local = np.array([np.linalg.norm(diff[:, 2 * t : 2 * t + 5]) for t in range(n_tokens)])
    return 2.0 * s1 * s2 * np.sqrt(3.0) * local + SCORE_ROUNDING


@pytest.mark.parametrize("name", PROMPTS)
def test_tokens_of_our_mel_where_the_margin_is_safe(
    ref_dir: Path, analyses: dict[tuple[str, str], PromptAnalysis], prompts: dict[str, np.ndarray], name: str
) -> None:
    want = prompts[f"{name}_speech_token"]
    got = analyses[name, "trained"].speech_tokens
    assert got.dtype == np.int32 and got.shape == want.shape
    ours = whisper_log_mel(prompts[f"{name}_speech_16k"][0])
    safe = prompts[f"{name}_token_score_margin"] > token_flip_bounds(ref_dir, ours, prompts[f"{name}_whisper_mel"])
    assert safe.mean() > 0.95  # the comparison below covers nearly every token
    np.testing.assert_array_equal(got[safe], want[safe])


@pytest.mark.parametrize("name", PROMPTS)
def test_mel_variants(analyses: dict[tuple[str, str], PromptAnalysis], prompts: dict[str, np.ndarray], name: str) -> None:
    trained, official = analyses[name, "trained"], analyses[name, "official-24k"]
    assert (trained.mel_rate_hz, official.mel_rate_hz) == (22_050, 24_000)
    assert trained.mel.dtype == np.float32
    assert max_err(trained.mel, prompts[f"{name}_legacy_mel80"]) <= TOL_MEL80
    assert max_err(official.mel, prompts[f"{name}_mel80"]) <= TOL_MEL80
    np.testing.assert_array_equal(trained.speech_tokens, official.speech_tokens)
    assert trained.duration_s == prompts[f"{name}_speech_16k"].shape[1] / 16_000
    assert set(trained.timings_s) == {"resample", "fbank", "embedding", "whisper_mel", "tokens", "mel"}


def test_thirty_seconds_is_accepted(analyzer: PromptAnalyzer) -> None:
    x = (0.1 * np.random.RandomState(0).randn(30 * 48_000)).astype(np.float32)
    result = analyzer.analyze(x, 48_000)
    assert result.duration_s == 30.0
    assert result.speech_tokens.shape == (1500,)
    assert result.mel.shape == (30 * 22_050 // 256, 80)


class ForbiddenSession:
    """A session that must not be reached: refusals happen before any model runs."""

    def run(self, output_names: Any, feeds: Any) -> list[Any]:
        raise AssertionError("model ran on refused input")


@pytest.mark.parametrize(
    ("audio", "rate", "reason"),
    [
        (np.full(16_000, 0.1, np.float32), 8_000, PromptAudioProblem.SAMPLE_RATE),
        (np.full(44_100 * 31, 0.1, np.float32), 44_100, PromptAudioProblem.TOO_LONG),
        (np.full(30 * 16_000 + 1, 0.1, np.float32), 16_000, PromptAudioProblem.TOO_LONG),
        (np.full(15_000, 0.1, np.float32), 16_000, PromptAudioProblem.TOO_SHORT),
        (np.zeros(0, np.float32), 16_000, PromptAudioProblem.TOO_SHORT),
        (np.full(32_000, 5e-5, np.float32), 16_000, PromptAudioProblem.SILENT),
        (np.array([0.1, np.nan] * 16_000, np.float32), 16_000, PromptAudioProblem.CORRUPT),
    ],
    ids=["8k", "long-44k", "30s-plus-one", "short", "empty", "silent", "nan"],
)
def test_refusals(audio: np.ndarray, rate: int, reason: PromptAudioProblem) -> None:
    analyzer = PromptAnalyzer(ForbiddenSession(), ForbiddenSession())
    with pytest.raises(PromptAudioError) as info:
        analyzer.analyze(audio, rate)
    assert info.value.reason == reason


def test_caller_errors() -> None:
    analyzer = PromptAnalyzer(ForbiddenSession(), ForbiddenSession())
    with pytest.raises(ValueError):
        analyzer.analyze(np.zeros((2, 32_000), np.float32), 16_000)  # not mono
    with pytest.raises(ValueError):
        analyzer.analyze(np.full(32_000, 0.1, np.float32), 16_000, mel_variant="24k")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PromptAnalyzer(ForbiddenSession(), ForbiddenSession(), min_seconds=5, max_seconds=2)


class FixedSession:
    def __init__(self, output: np.ndarray) -> None:
        self.output = output
        self.feeds: dict[str, np.ndarray] = {}

    def run(self, output_names: Any, feeds: dict[str, np.ndarray]) -> list[Any]:
        self.feeds = feeds
        return [self.output]


def test_injected_sessions_get_the_official_feeds() -> None:
    campplus = FixedSession(np.ones((1, 192), np.float32))
    tokenizer = FixedSession(np.arange(100, dtype=np.int64).reshape(1, 1, 100))
    result = PromptAnalyzer(campplus, tokenizer).analyze(np.sin(np.arange(32_000) / 7).astype(np.float32), 16_000)
    assert campplus.feeds["input"].shape == (1, 1 + (32_000 - 400) // 160, 80)
    assert tokenizer.feeds["feats"].shape == (1, 128, 200) and tokenizer.feeds["feats"].dtype == np.float32
    assert tokenizer.feeds["feats_length"].dtype == np.int32 and tokenizer.feeds["feats_length"].tolist() == [200]
    np.testing.assert_array_equal(result.speech_tokens, np.arange(100, dtype=np.int32))


def test_model_output_of_the_wrong_shape_is_an_engine_error() -> None:
    x = np.sin(np.arange(32_000) / 7).astype(np.float32)
    good_tokens = FixedSession(np.zeros((1, 1, 100), np.int64))
    with pytest.raises(EngineError):
        PromptAnalyzer(FixedSession(np.ones((1, 80), np.float32)), good_tokens).analyze(x, 16_000)
    with pytest.raises(EngineError):
        PromptAnalyzer(FixedSession(np.ones((1, 192), np.float32)), FixedSession(np.zeros((1, 1, 7), np.int64))).analyze(
            x, 16_000
        )


def test_verify_prompts_section(ref_dir: Path, tmp_path: Path) -> None:
    from service.families.cosyvoice1.verify.prompts import PROMPT_MODELS, PROMPTS_FILE, verify_prompts

    checks = list(verify_prompts(ref_dir))
    assert len(checks) == 11 * len(PROMPTS) and len({c.name for c in checks}) == len(checks)
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    # the same replay against a fixture whose official mel was moved by 1e-2 must fail exactly there
    (tmp_path / "prompts").mkdir()
    for f in (*PROMPT_MODELS, "prompts/en_24k.wav"):
        (tmp_path / f).write_bytes((ref_dir / f).read_bytes())
    with np.load(ref_dir / PROMPTS_FILE) as npz:
        arrays = {k: npz[k] for k in npz.files if k.startswith("en_24k_")}
    arrays["en_24k_mel80"] = arrays["en_24k_mel80"] + np.float32(1e-2)
    np.savez(tmp_path / PROMPTS_FILE, **arrays)
    failed = [c.name for c in verify_prompts(tmp_path) if not c.ok]
    assert failed == ["en_24k mel80 official-24k"]
