"""HiFTRunner on the tiny bundle against the official HiFT fixtures (hift.npz): f0, SineGen source, waveform."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.bundle import ModelBundle, ModelConstants
from service.engine.options import RuntimeOptions
from service.engine.sessions import open_sessions
from service.layers.hift import HiFTNoise, HiFTRunner, draw_hift_noise, sine_excitation

CASES = (0, 1, 2)
HIFT_GRAPHS = ("hift_f0", "hift_source", "hift_decode")


@pytest.fixture(scope="module")
def bundle(tiny_bundle: Path) -> ModelBundle:
    return ModelBundle.load(tiny_bundle)


@pytest.fixture(scope="module")
def runner(bundle: ModelBundle) -> HiFTRunner:
    sessions = open_sessions(bundle, RuntimeOptions(intra_op_threads=1), names=HIFT_GRAPHS)
    return HiFTRunner(sessions, bundle.constants)


@pytest.fixture(scope="module")
def ref(ref_dir: Path) -> Any:
    return np.load(ref_dir / "hift.npz")


def _noise(ref: Any, case: int) -> HiFTNoise:
    return HiFTNoise(phase=ref[f"case{case}_phase_used"][0, :, 0], sine_noise=ref[f"case{case}_sine_noise"][0])


@pytest.mark.parametrize("case", CASES)
def test_wav_given_source(runner: HiFTRunner, ref: Any, case: int) -> None:
    wav = runner.decode(ref[f"case{case}_mel"][0], ref[f"case{case}_source"][0, 0])
    expected = ref[f"case{case}_wav"][0]
    assert wav.shape == expected.shape and wav.dtype == np.float32
    np.testing.assert_allclose(wav, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_source_rebuilt_from_f0_and_recorded_noise(runner: HiFTRunner, ref: Any, case: int) -> None:
    # case 2 has a synthetic voiced f0 contour: it only passes with the float64-accumulated phase
    sine = sine_excitation(ref[f"case{case}_f0"][0], runner.samples_per_frame, runner.constants, _noise(ref, case))
    assert sine.shape == (ref[f"case{case}_source"].shape[-1], runner.n_harmonics)
    np.testing.assert_allclose(runner.source(sine), ref[f"case{case}_source"][0, 0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_predicted_f0(runner: HiFTRunner, ref: Any, case: int) -> None:
    key = "case2_f0_predicted" if case == 2 else f"case{case}_f0"
    np.testing.assert_allclose(runner.predict_f0(ref[f"case{case}_mel"][0]), ref[key][0], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("case", (0, 1))  # case 2 replaced the predicted f0, so only 0 and 1 run end to end
def test_inference_end_to_end_with_injected_noise(runner: HiFTRunner, ref: Any, case: int) -> None:
    wav, source = runner.inference(ref[f"case{case}_mel"][0], np.zeros(0, np.float32), _noise(ref, case))
    np.testing.assert_allclose(source, ref[f"case{case}_source"][0, 0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(wav, ref[f"case{case}_wav"][0], atol=1e-4, rtol=0)


def test_cache_source_overwrites_head(runner: HiFTRunner, ref: Any) -> None:
    mel = ref["case0_mel"][0]
    cache = np.linspace(-0.5, 0.5, 1000, dtype=np.float32)
    wav, source = runner.inference(mel, cache, _noise(ref, 0))
    np.testing.assert_array_equal(source[:1000], cache)
    np.testing.assert_allclose(source[1000:], ref["case0_source"][0, 0, 1000:], atol=1e-4)
    assert np.abs(wav).max() <= runner.constants.audio_limit
    assert not np.allclose(wav[:1000], ref["case0_wav"][0, :1000], atol=1e-3)  # the cached excitation was used


def test_float32_phase_accumulation_would_fail_the_voiced_case(ref: Any) -> None:
    """Guards the float64 cumsum: a float32 running phase drifts far beyond the tolerance on voiced audio."""
    c = ModelConstants()
    f0u = np.repeat(ref["case2_f0"][0], 256)
    freq = f0u[None, :] * np.arange(1, 10, dtype=np.float32)[:, None] / np.float32(c.sample_rate)
    drift = np.abs(np.cumsum(freq, axis=1, dtype=np.float32) - np.cumsum(freq, axis=1, dtype=np.float64)).max()
    assert drift > 1e-3
    sine = sine_excitation(ref["case2_f0"][0], 256, c, _noise(ref, 2))
    assert np.isfinite(sine).all()


def test_unvoiced_excitation_is_scaled_noise() -> None:
    c = ModelConstants()
    noise = HiFTNoise(phase=np.zeros(9, np.float32), sine_noise=np.ones((9, 512), np.float32))
    sine = sine_excitation(np.zeros(2, np.float32), 256, c, noise)
    np.testing.assert_allclose(sine, c.sine_amp / 3, rtol=1e-6)  # f0 below the threshold: noise only


def test_draw_hift_noise() -> None:
    a = draw_hift_noise(np.random.default_rng(7), 9, 300)
    b = draw_hift_noise(np.random.default_rng(7), 9, 300)
    assert a.phase.shape == (9,) and a.sine_noise.shape == (9, 300)
    assert a.phase[0] == 0.0 and np.all(np.abs(a.phase) <= np.pi)
    np.testing.assert_array_equal(a.sine_noise, b.sine_noise)
    assert a.sine_noise.dtype == np.float32
