"""Flow export: strict loading, torch parity with the official fixtures, ONNX parity, opset, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from export.config import load_config
from export.cosyvoice1.graphs.flow import export_flow, verify_flow
from export.modules.flow import CACHE_FRAMES, MaskedDiffWithXvec, mel_frames, time_span
from export.onnx_io import OPSET
from service.families.cosyvoice1.contract import GRAPH_IO

pytestmark = pytest.mark.export

CASES = (0, 1)
FLOW_GRAPHS = ("flow_encoder", "flow_lr", "flow_estimator")
_BF = (0, 2)  # batch and frame axes of a (B, C, M) tensor
DYNAMIC_AXES: dict[str, dict[str, tuple[int, ...]]] = {
    "flow_encoder": {"tokens": (0, 1), "embedding": (0,), "h": (0, 1), "spks": (0,)},
    "flow_lr": {"x": _BF, "mu": _BF},
    "flow_estimator": {"x": _BF, "mask": _BF, "mu": _BF, "t": (0,), "spks": (0,), "cond": _BF, "v": _BF},
}


@pytest.fixture(scope="module")
def flow(ref_dir: Path) -> MaskedDiffWithXvec:
    model = MaskedDiffWithXvec(load_config(ref_dir / "cosyvoice.yaml").flow)
    state = torch.load(ref_dir / "flow.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def fixtures(ref_dir: Path) -> dict[str, np.ndarray]:
    with np.load(ref_dir / "flow.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def onnx_dir(flow: MaskedDiffWithXvec, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("flow_onnx")
    export_flow(flow, out)
    return out


def _case(fixtures: dict[str, np.ndarray], case: int, name: str) -> torch.Tensor:
    return torch.from_numpy(fixtures[f"case{case}_{name}"])


def test_strict_load_covers_every_tiny_key(flow: MaskedDiffWithXvec, ref_dir: Path) -> None:
    state = torch.load(ref_dir / "flow.pt", map_location="cpu", weights_only=True)
    assert set(flow.state_dict()) == set(state)
    assert all(flow.state_dict()[k].shape == v.shape for k, v in state.items())


def test_full_size_keys_and_shapes_match_the_released_checkpoint(repo_root: Path, full_size_shapes: Path) -> None:
    cfg = load_config(repo_root / "export" / "configs" / "cosyvoice-300m-sft.yaml")
    with torch.device("meta"):
        model = MaskedDiffWithXvec(cfg.flow)
    got = {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in model.state_dict().items()}
    shapes = json.loads(full_size_shapes.read_text())
    assert got == shapes["flow.pt"]
    assert len(got) == 1185


def test_time_grid_and_frame_count_follow_the_official_formulas(fixtures: dict[str, np.ndarray]) -> None:
    np.testing.assert_allclose(time_span(10, "cosine").numpy(), fixtures["case0_t_span"], atol=1e-7)
    for case in CASES:
        assert mel_frames(len(fixtures[f"case{case}_tokens"]), 50) == fixtures[f"case{case}_mel"].shape[-1]


@pytest.mark.parametrize("case", CASES)
def test_estimator_step_matches_official(flow: MaskedDiffWithXvec, fixtures: dict[str, np.ndarray], case: int) -> None:
    names = ("x", "mask", "mu", "t", "spks", "cond")
    with torch.no_grad():
        out = flow.decoder.estimator(*(_case(fixtures, case, f"est_step1_in_{n}") for n in names))
    np.testing.assert_allclose(out.numpy(), fixtures[f"case{case}_est_step1_out"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_torch_flow_matches_official(flow: MaskedDiffWithXvec, fixtures: dict[str, np.ndarray], case: int) -> None:
    tokens = _case(fixtures, case, "tokens").long()[None]
    with torch.no_grad():
        out = flow.inference(tokens, _case(fixtures, case, "embedding")[None], _case(fixtures, case, "noise"))
    np.testing.assert_allclose(out.spks.numpy(), fixtures[f"case{case}_spks"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(out.mu.numpy(), fixtures[f"case{case}_mu"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(out.mel.numpy(), fixtures[f"case{case}_mel"], rtol=0, atol=1e-3)
    np.testing.assert_allclose(out.cache.numpy(), fixtures[f"case{case}_flow_cache_out"], rtol=0, atol=1e-4)
    # the cache is exactly the last CACHE_FRAMES frames of the noise and of mu
    noise = fixtures[f"case{case}_noise"]
    np.testing.assert_array_equal(out.cache[..., 0].numpy(), noise[:, :, -CACHE_FRAMES:])
    np.testing.assert_array_equal(out.cache[..., 1].numpy(), out.mu[:, :, -CACHE_FRAMES:].numpy())


def test_streaming_cache_in_overwrites_noise_and_mu(flow: MaskedDiffWithXvec, ref_dir: Path) -> None:
    with np.load(ref_dir / "stream.npz") as data:
        s = dict(data)
    tokens = torch.from_numpy(s["chunk1_token"]).long()[None]
    cache_in = torch.from_numpy(s["chunk1_flow_cache_in"])
    with torch.no_grad():
        out = flow.inference(tokens, torch.from_numpy(s["embedding"])[None], torch.from_numpy(s["chunk1_flow_noise"]), cache_in)
    np.testing.assert_array_equal(out.mu[:, :, :CACHE_FRAMES].numpy(), s["chunk1_flow_cache_in"][..., 1])
    np.testing.assert_allclose(out.mu.numpy(), s["chunk1_flow_mu"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(out.cache.numpy(), s["chunk1_flow_cache_out"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(out.mel.numpy(), s["chunk1_flow_mel_full"], rtol=0, atol=1e-3)


def test_onnx_matches_torch(flow: MaskedDiffWithXvec, onnx_dir: Path) -> None:
    errors = verify_flow(flow, onnx_dir, seed=3)
    assert set(errors) == set(FLOW_GRAPHS)
    assert all(err <= 1e-4 for err in errors.values()), errors


def test_graphs_are_opset13_with_contract_names_and_dynamic_axes(onnx_dir: Path) -> None:
    for name in FLOW_GRAPHS:
        model = onnx.load(str(onnx_dir / f"{name}.onnx"))
        assert {o.domain or "ai.onnx": o.version for o in model.opset_import}["ai.onnx"] == OPSET
        inputs, outputs = GRAPH_IO[name]
        assert tuple(i.name for i in model.graph.input) == inputs
        assert tuple(o.name for o in model.graph.output) == outputs
        for value in [*model.graph.input, *model.graph.output]:
            dims = value.type.tensor_type.shape.dim
            dynamic = DYNAMIC_AXES[name][value.name]
            for axis, dim in enumerate(dims):
                if axis in dynamic:
                    assert dim.dim_param, f"{name}.{value.name}: axis {axis} is static"
                else:
                    assert dim.dim_value > 0, f"{name}.{value.name}: axis {axis} should be a fixed size"


def test_export_is_deterministic(flow: MaskedDiffWithXvec, onnx_dir: Path, tmp_path: Path) -> None:
    export_flow(flow, tmp_path)
    for name in FLOW_GRAPHS:
        assert (tmp_path / f"{name}.onnx").read_bytes() == (onnx_dir / f"{name}.onnx").read_bytes(), name


def _interpolate(x: np.ndarray, size: int) -> np.ndarray:
    """x (C, T) -> (C, size): linear, align_corners=False, source index clamped at 0 (spec §4.3)."""
    n_in = x.shape[1]
    src = np.maximum((np.arange(size) + 0.5) * (n_in / size) - 0.5, 0.0)
    i0 = np.floor(src).astype(np.int64)
    i1 = np.minimum(i0 + 1, n_in - 1)
    lam = (src - i0).astype(np.float32)
    return x[:, i0] * (1 - lam) + x[:, i1] * lam


def _regulate(h: np.ndarray, frames: int) -> np.ndarray:
    """h (T, C) -> (C, frames) with the head/middle/tail split above 40 tokens."""
    x = h.T
    if x.shape[1] <= 40:
        return _interpolate(x, frames)
    edge = mel_frames(20, 50)
    parts = [_interpolate(x[:, :20], edge), _interpolate(x[:, 20:-20], frames - 2 * edge), _interpolate(x[:, -20:], edge)]
    return np.concatenate(parts, axis=1)


def _solve(est: ort.InferenceSession, noise: np.ndarray, mu: np.ndarray, spks: np.ndarray) -> np.ndarray:
    """Ten cosine-grid Euler steps with CFG 0.7, the conditional and unconditional rows as one batch of 2."""
    span = 1 - np.cos(np.linspace(0, 1, 11, dtype=np.float32) * np.float32(0.5 * np.pi))
    x, t = noise, span[0]
    zeros = np.zeros_like(mu)
    feeds = {
        "mask": np.ones((2, 1, mu.shape[-1]), np.float32),
        "mu": np.concatenate([mu, zeros]),
        "spks": np.concatenate([spks, np.zeros_like(spks)]),
        "cond": np.concatenate([zeros, zeros]),
    }
    for step in range(1, len(span)):
        dt = span[step] - t
        (v,) = est.run(None, {**feeds, "x": np.concatenate([x, x]), "t": np.full(2, t, np.float32)})
        x = x + dt * (1.7 * v[:1] - 0.7 * v[1:])
        t = t + dt
    return x


@pytest.mark.parametrize("case", CASES)
def test_onnx_graphs_with_numpy_solver_reproduce_official_mel(onnx_dir: Path, fixtures: dict[str, np.ndarray], case: int) -> None:
    enc, lr, est = (ort.InferenceSession(str(onnx_dir / f"{n}.onnx"), providers=["CPUExecutionProvider"]) for n in FLOW_GRAPHS)
    tokens = fixtures[f"case{case}_tokens"].astype(np.int64)[None]
    h, spks = enc.run(None, {"tokens": tokens, "embedding": fixtures[f"case{case}_embedding"][None]})
    x = _regulate(h[0], mel_frames(tokens.shape[1], 50))[None].astype(np.float32)
    (mu,) = lr.run(None, {"x": x})
    np.testing.assert_allclose(mu, fixtures[f"case{case}_mu"], rtol=0, atol=1e-4)
    mel = _solve(est, fixtures[f"case{case}_noise"], mu, spks)
    np.testing.assert_allclose(mel, fixtures[f"case{case}_mel"], rtol=0, atol=1e-3)
