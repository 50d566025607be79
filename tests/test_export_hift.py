"""HiFT export side: strict loading, torch parity with the official fixtures, ONNX graphs and their parity."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from export.config import load_config
from export.graphs.hift import export_hift, verify_hift
from export.modules.hift import HiFTGenerator, normalize_hift_state_dict
from export.onnx_io import opset_of
from service.families.cosyvoice1.contract import GRAPH_IO

pytestmark = pytest.mark.export

CASES = (0, 1, 2)
HIFT_GRAPHS = ("hift_f0", "hift_source", "hift_decode")
N_FFT, HOP = 16, 4
ATOL = 1e-4
# tensor -> {axis: size} of the only static axes (tiny model); every batch and length axis is dynamic
FIXED_AXES = {"mel": {1: 80}, "f0": {}, "sine": {2: 9}, "source": {1: 1}, "s_stft": {1: 18}, "x": {1: 18}}


@pytest.fixture(scope="module")
def official_sd(ref_dir: Path) -> dict[str, torch.Tensor]:
    return dict(torch.load(ref_dir / "hift.pt", map_location="cpu", weights_only=True))


@pytest.fixture(scope="module")
def model(ref_dir: Path, official_sd: dict[str, torch.Tensor]) -> HiFTGenerator:
    torch.set_num_threads(1)
    hift = HiFTGenerator(load_config(ref_dir / "cosyvoice.yaml").hift).eval()
    hift.load_official_state_dict(official_sd)
    return hift


@pytest.fixture(scope="module")
def fixtures(ref_dir: Path) -> dict[str, np.ndarray]:
    with np.load(ref_dir / "hift.npz") as npz:
        return {k: npz[k] for k in npz.files}


@pytest.fixture(scope="module")
def onnx_dir(model: HiFTGenerator, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hift_onnx")
    export_hift(model, out)
    return out


def _case(fixtures: dict[str, np.ndarray], case: int, key: str) -> torch.Tensor:
    return torch.from_numpy(fixtures[f"case{case}_{key}"])


def _to_legacy_keys(sd: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    renames = {".parametrizations.weight.original0": ".weight_g", ".parametrizations.weight.original1": ".weight_v"}
    out = {}
    for key, value in sd.items():
        for new, old in renames.items():
            key = key.replace(new, old)
        out[prefix + key] = value
    return out


# ---- loading ---------------------------------------------------------------------------------------


def test_strict_load_new_style_round_trips(model: HiFTGenerator, official_sd: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == official_sd.keys()
    assert all(torch.equal(state[k], v) for k, v in official_sd.items())


@pytest.mark.parametrize("prefix", ["", "generator."])
def test_strict_load_legacy_weight_norm_keys(
    ref_dir: Path, official_sd: dict[str, torch.Tensor], model: HiFTGenerator, prefix: str
) -> None:
    legacy = _to_legacy_keys(official_sd, prefix)
    assert sum(k.endswith(".weight_g") for k in legacy) == sum(k.endswith(".original0") for k in official_sd) > 0
    assert normalize_hift_state_dict(legacy).keys() == official_sd.keys()
    fresh = HiFTGenerator(model.cfg)
    fresh.load_official_state_dict(legacy)
    state = fresh.state_dict()
    assert all(torch.equal(state[k], v) for k, v in official_sd.items())


def test_strict_load_rejects_missing_and_clashing_keys(model: HiFTGenerator, official_sd: dict[str, torch.Tensor]) -> None:
    fresh = HiFTGenerator(model.cfg)
    missing = {k: v for k, v in official_sd.items() if not k.startswith("conv_post.")}
    with pytest.raises(RuntimeError, match="conv_post"):
        fresh.load_official_state_dict(missing)
    both_styles = {**official_sd, "conv_pre.weight_g": official_sd["conv_pre.parametrizations.weight.original0"]}
    with pytest.raises(ValueError, match="conv_pre"):
        fresh.load_official_state_dict(both_styles)


def test_full_size_keys_and_shapes(repo_root: Path, full_size_shapes: Path) -> None:
    cfg = load_config(repo_root / "export" / "configs" / "cosyvoice-300m-sft.yaml").hift
    with torch.device("meta"):
        hift = HiFTGenerator(cfg)
    got = {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in hift.state_dict().items()}
    want = json.loads(full_size_shapes.read_text(encoding="utf-8"))["hift.pt"]
    assert got == want


def test_fold_weight_norm_keeps_outputs(model: HiFTGenerator, fixtures: dict[str, np.ndarray]) -> None:
    folded = model.folded_copy()
    assert folded.is_folded and not model.is_folded
    assert not any(".parametrizations." in k for k in folded.state_dict())
    mel, source = _case(fixtures, 0, "mel"), _case(fixtures, 0, "source")
    with torch.no_grad():
        s_stft = model.stft(source)
        diff = (folded.conv_decode(mel, s_stft) - model.conv_decode(mel, s_stft)).abs().max().item()
    assert diff <= 1e-6
    with pytest.raises(RuntimeError, match="fold"):
        folded.load_official_state_dict({})


# ---- torch reference vs the official fixtures --------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_torch_matches_official(model: HiFTGenerator, fixtures: dict[str, np.ndarray], case: int) -> None:
    ref = {k: _case(fixtures, case, k) for k in ("mel", "f0", "phase_used", "sine_noise", "source", "wav")}
    predicted = _case(fixtures, case, "f0_predicted" if case == 2 else "f0")
    with torch.no_grad():
        f0 = model.f0(ref["mel"])
        source = model.source_from_f0(ref["f0"], ref["phase_used"], ref["sine_noise"])
        wav = model.decode(ref["mel"], ref["source"])
    assert (f0 - predicted).abs().max().item() <= ATOL
    # case 2 is the voiced one: it exercises the harmonic path and its float64 phase accumulation
    assert bool((ref["f0"] > model.cfg.nsf_voiced_threshold).any()) == (case == 2)
    assert (source - ref["source"]).abs().max().item() <= ATOL
    assert wav.shape == ref["wav"].shape
    assert (wav - ref["wav"]).abs().max().item() <= ATOL


# ---- ONNX graphs ---------------------------------------------------------------------------------------


def test_onnx_matches_torch(model: HiFTGenerator, onnx_dir: Path) -> None:
    errors = verify_hift(model, onnx_dir)
    assert set(errors) == set(HIFT_GRAPHS)
    assert all(err <= ATOL for err in errors.values()), errors


@pytest.mark.parametrize("name", HIFT_GRAPHS)
def test_onnx_opset_names_and_dynamic_axes(onnx_dir: Path, name: str) -> None:
    path = onnx_dir / f"{name}.onnx"
    assert opset_of(path) == 13
    graph = onnx.load(str(path)).graph
    inputs, outputs = GRAPH_IO[name]
    assert tuple(v.name for v in graph.input) == inputs
    assert tuple(v.name for v in graph.output) == outputs
    for value in list(graph.input) + list(graph.output):
        dims = value.type.tensor_type.shape.dim
        fixed = {i: d.dim_value for i, d in enumerate(dims) if not d.dim_param}
        assert fixed == FIXED_AXES[value.name], f"{name}.{value.name}: every batch/length axis must be dynamic"


def test_export_is_deterministic(model: HiFTGenerator, onnx_dir: Path, tmp_path: Path) -> None:
    export_hift(model, tmp_path)
    for name in HIFT_GRAPHS:
        assert (tmp_path / f"{name}.onnx").read_bytes() == (onnx_dir / f"{name}.onnx").read_bytes(), name


# ---- ONNX + numpy signal processing reproduce the official output -----------------------------------------


def _window() -> np.ndarray:
    return (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)).astype(np.float32)


def _np_stft(source: np.ndarray) -> np.ndarray:
    """(B,1,L) -> (B,18,L/4+1): centred reflect-padded STFT, [Re ; Im]."""
    padded = np.pad(source[:, 0].astype(np.float64), ((0, 0), (N_FFT // 2, N_FFT // 2)), mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT, axis=-1)[:, ::HOP] * _window()
    spec = np.fft.rfft(frames, axis=-1).transpose(0, 2, 1)
    return np.concatenate([spec.real, spec.imag], axis=1).astype(np.float32)


def _np_istft(x: np.ndarray, audio_limit: float = 0.99) -> np.ndarray:
    """conv_post output (B,18,F) -> waveform (B,4(F-1)): exp/clip 100, sin phase, windowed overlap-add."""
    bins = N_FFT // 2 + 1
    magnitude = np.minimum(np.exp(x[:, :bins].astype(np.float64)), 100.0)
    phase = np.sin(x[:, bins:].astype(np.float64))
    frames = np.fft.irfft(magnitude * np.exp(1j * phase), n=N_FFT, axis=1) * _window()[None, :, None]
    n_frames = x.shape[-1]
    out = np.zeros((x.shape[0], N_FFT + HOP * (n_frames - 1)))
    envelope = np.zeros(out.shape[-1])
    for t in range(N_FFT // HOP):  # add every 4th frame at once: their spans do not overlap
        starts = HOP * np.arange(t, n_frames, N_FFT // HOP)
        idx = (starts[:, None] + np.arange(N_FFT)).ravel()
        out[:, idx] += frames[:, :, t :: N_FFT // HOP].transpose(0, 2, 1).reshape(x.shape[0], -1)
        envelope[idx] += np.tile(_window().astype(np.float64) ** 2, len(starts))
    kept = slice(N_FFT // 2, -(N_FFT // 2))  # the window-sum envelope is 0 at the outermost padded samples
    wav = out[:, kept] / envelope[kept]
    return np.clip(wav, -audio_limit, audio_limit).astype(np.float32)


def _np_sine_waves(f0: np.ndarray, phase: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """numpy SineGen with float64 phase accumulation: f0 (B,T), phase (B,9,1), noise (B,9,L) -> (B,L,9)."""
    f0_up = np.repeat(f0, 256, axis=-1)[:, None, :]
    harmonics = np.arange(1, 10, dtype=np.float32)[None, :, None]
    cycles = f0_up * harmonics / np.float32(22050)
    accumulated = np.cumsum(cycles.astype(np.float64), axis=-1).astype(np.float32)
    sine = np.float32(0.1) * np.sin(np.float32(2 * np.pi) * (accumulated % 1) + phase)
    uv = (f0_up > 10).astype(np.float32)
    noise_amp = uv * np.float32(0.003) + (1 - uv) * np.float32(0.1 / 3)
    return (sine * uv + noise_amp * noise).transpose(0, 2, 1).astype(np.float32)


@pytest.mark.parametrize("case", CASES)
def test_onnx_with_numpy_dsp_reproduces_official(onnx_dir: Path, fixtures: dict[str, np.ndarray], case: int) -> None:
    ref = {k.removeprefix(f"case{case}_"): v for k, v in fixtures.items() if k.startswith(f"case{case}_")}
    sessions = {n: ort.InferenceSession(str(onnx_dir / f"{n}.onnx"), providers=["CPUExecutionProvider"]) for n in HIFT_GRAPHS}
    (f0,) = sessions["hift_f0"].run(None, {"mel": ref["mel"]})
    assert np.abs(f0 - ref["f0_predicted" if case == 2 else "f0"]).max() <= ATOL
    sine = _np_sine_waves(ref["f0"], ref["phase_used"], ref["sine_noise"])
    (source,) = sessions["hift_source"].run(None, {"sine": sine})
    assert np.abs(source - ref["source"]).max() <= ATOL
    (x,) = sessions["hift_decode"].run(None, {"mel": ref["mel"], "s_stft": _np_stft(ref["source"])})
    wav = _np_istft(x)
    assert wav.shape == ref["wav"].shape
    assert np.abs(wav - ref["wav"]).max() <= ATOL
