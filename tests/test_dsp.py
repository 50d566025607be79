"""DSP helpers: linear resize (torch align_corners=False), n_fft-16 STFT/iSTFT, Hamming cross-fade."""

from __future__ import annotations

import numpy as np
import pytest

from service.layers.dsp import StreamingStretch, fade_in_out, hann_window, interpolate_linear, istft, stft

N_FFT, HOP = 16, 4


def _reference_resize(x: np.ndarray, size: int) -> np.ndarray:
    """Spec §4.3 formula in float64, one output sample at a time."""
    n_in = x.shape[-1]
    out = np.empty((*x.shape[:-1], size))
    for d in range(size):
        src = max((d + 0.5) * n_in / size - 0.5, 0.0)
        i0 = min(int(np.floor(src)), n_in - 1)
        i1 = min(i0 + 1, n_in - 1)
        lam = src - i0
        out[..., d] = (1 - lam) * x[..., i0] + lam * x[..., i1]
    return out


@pytest.mark.parametrize(
    ("x", "size", "expected"),
    [
        ([0.0, 10.0], 4, [0.0, 2.5, 7.5, 10.0]),  # upsample: src = -0.25 (clamped), 0.25, 0.75, 1.25 (edge)
        ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 3, [0.5, 2.5, 4.5]),  # downsample by 2: src = 0.5, 2.5, 4.5
        ([3.0], 3, [3.0, 3.0, 3.0]),
        ([1.0, 2.0, 4.0], 3, [1.0, 2.0, 4.0]),  # same size is the identity
        ([0.0, 4.0, 8.0], 2, [1.0, 7.0]),  # src = 0.25, 1.75
    ],
)
def test_interpolate_hand_cases(x: list[float], size: int, expected: list[float]) -> None:
    got = interpolate_linear(np.asarray(x, dtype=np.float32), size)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize(("n_in", "size"), [(20, 34), (60, 103), (100, 172), (206, 137), (7, 1), (1, 9)])
def test_interpolate_matches_formula_on_last_axis(n_in: int, size: int) -> None:
    x = np.random.default_rng(n_in * 1000 + size).standard_normal((2, 5, n_in)).astype(np.float32)
    got = interpolate_linear(x, size)
    assert got.shape == (2, 5, size)
    # torch (and we) round the source position to float32: ~1e-5 at position 200, times the local slope
    np.testing.assert_allclose(got, _reference_resize(x.astype(np.float64), size), atol=1e-4)


def test_interpolate_to_zero_and_errors() -> None:
    assert interpolate_linear(np.ones((3, 4), np.float32), 0).shape == (3, 0)
    with pytest.raises(ValueError):
        interpolate_linear(np.ones((3, 0), np.float32), 2)


def test_hann_window_is_periodic() -> None:
    w = hann_window(N_FFT)
    n = np.arange(N_FFT)
    np.testing.assert_allclose(w, 0.5 - 0.5 * np.cos(2 * np.pi * n / N_FFT), atol=1e-7)
    assert w[0] == 0.0 and w[N_FFT // 2] == pytest.approx(1.0)
    np.testing.assert_allclose(w[1:], w[1:][::-1], atol=1e-7)  # periodic: symmetric after dropping sample 0


def test_stft_matches_dft_definition() -> None:
    x = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    w = hann_window(N_FFT)
    spec = stft(x, N_FFT, HOP, w)
    assert spec.shape == (N_FFT // 2 + 1, 64 // HOP + 1)
    xp = np.pad(x.astype(np.float64), N_FFT // 2, mode="reflect")
    n = np.arange(N_FFT)
    for t in (0, 1, 8, spec.shape[1] - 1):
        frame = xp[t * HOP : t * HOP + N_FFT] * w
        for k in range(N_FFT // 2 + 1):
            expected = np.sum(frame * np.exp(-2j * np.pi * k * n / N_FFT))
            assert abs(spec[k, t] - expected) < 1e-4


@pytest.mark.parametrize(("n_samples", "n_fft", "hop"), [(256, 16, 4), (1024, 16, 4), (44032, 16, 4), (600, 12, 5), (300, 8, 2)])
def test_istft_inverts_stft(n_samples: int, n_fft: int, hop: int) -> None:
    x = np.random.default_rng(n_samples).standard_normal((2, n_samples)).astype(np.float32)
    w = hann_window(n_fft)
    y = istft(stft(x, n_fft, hop, w), n_fft, hop, w)
    assert y.shape == x.shape and y.dtype == np.float32
    np.testing.assert_allclose(y, x, atol=2e-5)  # edges included: the envelope division is exact


def _reference_istft(spec: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Loop form of torch.istft(center=True): real inverse DFT per frame, window, overlap-add, envelope, trim."""
    n_frames = spec.shape[1]
    total = N_FFT + HOP * (n_frames - 1)
    out, env = np.zeros(total), np.zeros(total)
    n = np.arange(N_FFT)
    for t in range(n_frames):
        frame = np.zeros(N_FFT)
        for k in range(N_FFT // 2 + 1):
            weight = 1.0 if k in (0, N_FFT // 2) else 2.0  # Hermitian pair; DC/Nyquist counted once
            coef = spec[k, t].real if k in (0, N_FFT // 2) else spec[k, t]
            frame += weight * np.real(coef * np.exp(2j * np.pi * k * n / N_FFT))
        out[t * HOP : t * HOP + N_FFT] += frame / N_FFT * w
        env[t * HOP : t * HOP + N_FFT] += w * w
    kept = slice(N_FFT // 2, total - N_FFT // 2)  # the envelope is 0 only at the trimmed first sample
    return out[kept] / env[kept]


def test_istft_of_arbitrary_spectrum_matches_loop_reference() -> None:
    rng = np.random.default_rng(3)
    spec = (rng.standard_normal((9, 21)) + 1j * rng.standard_normal((9, 21))).astype(np.complex64)
    w = hann_window(N_FFT)
    y = istft(spec, N_FFT, HOP, w)
    assert y.shape == (HOP * 20,)
    np.testing.assert_allclose(y, _reference_istft(spec.astype(np.complex128), w.astype(np.float64)), atol=1e-5)


def test_fade_in_out_hand_case() -> None:
    window = np.hamming(4)  # [0.08, 0.77, 0.77, 0.08]
    new = np.ones((2, 5), dtype=np.float32)
    old = np.full((2, 3), 2.0, dtype=np.float32)
    out = fade_in_out(new, old, window)
    expected_head = [0.08 + 2 * 0.77, 0.77 + 2 * 0.08]
    np.testing.assert_allclose(out[:, :2], [expected_head, expected_head], atol=1e-6)
    np.testing.assert_array_equal(out[:, 2:], 1.0)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(new, 1.0)  # inputs untouched


def test_fade_in_out_uses_tail_of_old() -> None:
    window = np.hamming(6)
    new = np.zeros(4, dtype=np.float32)
    old = np.arange(10, dtype=np.float32)  # only the last 3 samples (7, 8, 9) take part
    out = fade_in_out(new, old, window)
    np.testing.assert_allclose(out[:3], np.array([7.0, 8.0, 9.0]) * window[3:], atol=1e-6)
    assert out[3] == 0.0


@pytest.mark.export
def test_dsp_matches_torch_ops() -> None:
    torch = pytest.importorskip("torch")
    f = pytest.importorskip("torch.nn.functional")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 80, 206)).astype(np.float32)
    for size in (34, 137, 257):
        ref = f.interpolate(torch.from_numpy(x), size=size, mode="linear").numpy()
        np.testing.assert_allclose(interpolate_linear(x, size), ref, atol=1e-6)
    w = hann_window(N_FFT)
    sig = rng.standard_normal((1, 4096)).astype(np.float32)
    spec_t = torch.stft(torch.from_numpy(sig), N_FFT, HOP, N_FFT, window=torch.from_numpy(w), return_complex=True)
    np.testing.assert_allclose(stft(sig, N_FFT, HOP, w), spec_t.numpy(), atol=1e-5)
    rnd = (rng.standard_normal((1, 9, 300)) + 1j * rng.standard_normal((1, 9, 300))).astype(np.complex64)
    ref_y = torch.istft(torch.from_numpy(rnd), N_FFT, HOP, N_FFT, window=torch.from_numpy(w)).numpy()
    np.testing.assert_allclose(istft(rnd, N_FFT, HOP, w), ref_y, atol=1e-5)


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.25, 1.5, 2.0, 4.0])
def test_streaming_stretch_equals_one_global_resize(speed: float) -> None:
    """Fed in any pieces, the stretch gives max(1, int(n / speed)) frames read at (j + 0.5) * speed - 0.5."""
    rng = np.random.default_rng(int(speed * 100))
    for _ in range(25):
        x = rng.standard_normal((3, int(rng.integers(1, 300)))).astype(np.float32)
        cuts = sorted(int(c) for c in rng.integers(0, x.shape[-1], size=int(rng.integers(0, 6))))
        stretch, pieces, prev = StreamingStretch(speed), [], 0
        for cut in cuts:
            pieces.append(stretch.push(x[:, prev:cut], final=False))
            prev = cut
        pieces.append(stretch.push(x[:, prev:], final=True))
        got = np.concatenate(pieces, axis=-1)
        n = x.shape[-1]
        size = max(1, int(n / speed))
        pos = np.maximum((np.arange(size) + 0.5) * speed - 0.5, 0.0)
        i0 = np.minimum(pos.astype(np.int64), n - 1)
        i1 = np.minimum(i0 + 1, n - 1)
        expected = x[:, i0] * (1 - pos + i0) + x[:, i1] * (pos - i0)
        assert got.shape == (3, size)
        np.testing.assert_allclose(got, expected, atol=1e-5)


def test_streaming_stretch_matches_interpolate_when_the_scale_is_exact() -> None:
    x = np.random.default_rng(0).standard_normal((2, 120)).astype(np.float32)
    stretch = StreamingStretch(1.5)
    got = np.concatenate([stretch.push(x[:, :50], final=False), stretch.push(x[:, 50:], final=True)], axis=-1)
    np.testing.assert_allclose(got, interpolate_linear(x, 80), atol=1e-6)  # 120 / 80 = 1.5 exactly


def test_streaming_stretch_holds_back_at_most_one_frame() -> None:
    stretch = StreamingStretch(0.5)
    out = stretch.push(np.ones((1, 10), dtype=np.float32), final=False)
    assert out.shape[-1] >= 20 - 2  # 10 frames at half speed: 20, minus what waits for the next frame
    with pytest.raises(ValueError):
        StreamingStretch(0.0)
