"""FlowRunner on the tiny bundle against the official flow fixtures (flow.npz), plus the regulator and solver rules."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.bundle import ModelBundle, ModelConstants
from service.engine.options import RuntimeOptions
from service.engine.sessions import open_sessions
from service.families.cosyvoice1.flow import FlowCache, FlowRunner, regulate_length
from service.layers.cfm import cosine_t_span
from service.layers.dsp import interpolate_linear

FLOW_GRAPHS = ("flow_encoder", "flow_lr", "flow_estimator")


@pytest.fixture(scope="module")
def sessions(tiny_bundle: Path) -> Mapping[str, Any]:
    return open_sessions(ModelBundle.load(tiny_bundle), RuntimeOptions(intra_op_threads=1), names=FLOW_GRAPHS)


@pytest.fixture(scope="module")
def constants(tiny_bundle: Path) -> ModelConstants:
    return ModelBundle.load(tiny_bundle).constants


@pytest.fixture(scope="module")
def runner(sessions: Mapping[str, Any], constants: ModelConstants) -> FlowRunner:
    return FlowRunner(sessions, constants)


@pytest.fixture(scope="module")
def ref(ref_dir: Path) -> Any:
    return np.load(ref_dir / "flow.npz")


class RecordingSession:
    """Wraps an ORT session and keeps the feeds of every run."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.feeds: list[dict[str, np.ndarray]] = []

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> Any:
        self.feeds.append({k: np.array(v, copy=True) for k, v in feeds.items()})
        return self.inner.run(names, feeds)


@pytest.mark.parametrize("case", (0, 1))  # 40 tokens: single interpolation; 100 tokens: head/middle/tail
def test_mel_with_recorded_noise(runner: FlowRunner, ref: Any, case: int) -> None:
    mel, cache = runner.inference(ref[f"case{case}_tokens"], ref[f"case{case}_embedding"], ref[f"case{case}_noise"][0])
    assert mel.shape == ref[f"case{case}_mel"].shape[1:] and mel.dtype == np.float32
    np.testing.assert_allclose(mel, ref[f"case{case}_mel"][0], atol=1e-3, rtol=0)
    np.testing.assert_allclose(np.stack([cache.z, cache.mu], axis=-1), ref[f"case{case}_flow_cache_out"][0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", (0, 1))
def test_mu_and_spks(runner: FlowRunner, ref: Any, case: int) -> None:
    h, spks = runner.encode(ref[f"case{case}_tokens"], ref[f"case{case}_embedding"])
    np.testing.assert_allclose(spks, ref[f"case{case}_spks"][0], atol=1e-5, rtol=0)
    mu = runner.mean(h, runner.mel_frames(len(ref[f"case{case}_tokens"])))
    np.testing.assert_allclose(mu, ref[f"case{case}_mu"][0], atol=1e-4, rtol=0)


def test_estimator_feeds_follow_cfg_layout(sessions: Mapping[str, Any], constants: ModelConstants, ref: Any) -> None:
    recorder = RecordingSession(sessions["flow_estimator"])
    runner = FlowRunner({**sessions, "flow_estimator": recorder}, constants)
    runner.solve(ref["case1_mu"][0], ref["case1_spks"][0], ref["case1_noise"][0], n_timesteps=3)
    assert len(recorder.feeds) == 3  # one batched (B = 2) call per Euler step
    first = recorder.feeds[0]
    for name in ("x", "mask", "mu", "t", "spks", "cond"):
        np.testing.assert_allclose(first[name], ref[f"case1_est_step1_in_{name}"], atol=1e-6, err_msg=name)
    (v,) = recorder.inner.run(["v"], first)
    np.testing.assert_allclose(v, ref["case1_est_step1_out"], atol=1e-4, rtol=0)
    np.testing.assert_allclose([f["t"][0] for f in recorder.feeds], cosine_t_span(3)[:3], atol=1e-7)


def test_cosine_t_span(ref: Any) -> None:
    np.testing.assert_allclose(cosine_t_span(10), ref["case0_t_span"], atol=1e-7)
    assert cosine_t_span(1).tolist() == [0.0, 1.0]


def test_cache_overwrites_head_of_noise_and_mu(runner: FlowRunner, ref: Any, constants: ModelConstants) -> None:
    tokens, emb = ref["case1_tokens"], ref["case1_embedding"]
    n = constants.mel_overlap_len
    rng = np.random.default_rng(0)
    cache = FlowCache(z=rng.standard_normal((80, n)).astype(np.float32), mu=rng.standard_normal((80, n)).astype(np.float32))
    noise = ref["case1_noise"][0]
    mel, new_cache = runner.inference(tokens, emb, noise, cache)
    np.testing.assert_array_equal(new_cache.z, noise[:, -n:])  # the tail is past the overwritten head
    h, _ = runner.encode(tokens, emb)
    reference_mu = runner.mean(h, runner.mel_frames(len(tokens)))
    reference_mu[:, :n] = cache.mu
    z = noise.copy()
    z[:, :n] = cache.z
    expected = runner.solve(reference_mu, ref["case1_spks"][0], z, constants.n_timesteps)
    np.testing.assert_allclose(mel, expected, atol=1e-4)
    assert np.abs(mel[:, :n] - ref["case1_mel"][0, :, :n]).max() > 1e-2


def test_noise_shape_is_checked(runner: FlowRunner, ref: Any) -> None:
    with pytest.raises(ValueError, match="noise shape"):
        runner.inference(ref["case0_tokens"], ref["case0_embedding"], np.zeros((80, 10), np.float32))


def test_regulator_edges_align_overlapping_chunks() -> None:
    """The 20 tokens shared by two streaming chunks map to the same 34 frames at the end of one and the start of the next."""
    c = ModelConstants()
    feats = np.random.default_rng(2).standard_normal((160, 6)).astype(np.float32)
    first, second = feats[:120], feats[100:160]
    a = regulate_length(first, c.tokens_to_mel_frames(120), c.token_overlap_len, c.mel_overlap_len)
    b = regulate_length(second, c.tokens_to_mel_frames(60), c.token_overlap_len, c.mel_overlap_len)
    assert a.shape == (6, 206) and b.shape == (6, 103)
    np.testing.assert_array_equal(a[:, -34:], b[:, :34])


def test_regulator_short_input_is_one_resize() -> None:
    feats = np.random.default_rng(3).standard_normal((40, 4)).astype(np.float32)
    np.testing.assert_array_equal(regulate_length(feats, 68, 20, 34), interpolate_linear(feats.T, 68))
