"""HiFT ONNX graphs (hift_f0, hift_source, hift_decode): wrappers, export and ORT-vs-torch parity."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from export.modules.hift import HiFTGenerator
from export.onnx_io import ExportedGraph, ExportError, export_graph

# (batch, mel frames) pairs checked by verify_hift: T = 1 is the shortest legal input; odd and long T
# exercise the ConvTranspose / strided-conv output lengths (8T, 64T, 64T+1) with both batch sizes.
VERIFY_SHAPES: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (1, 7), (2, 7), (1, 68), (2, 150))
_TRACE_BATCH, _TRACE_FRAMES = 2, 5  # trace with B > 1 and T > 1 so neither axis is specialised


class F0Graph(nn.Module):
    """hift_f0: mel (B,80,T) -> f0 (B,T) Hz."""

    def __init__(self, model: HiFTGenerator) -> None:
        super().__init__()
        self.model = model

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return self.model.f0(mel)


class SourceGraph(nn.Module):
    """hift_source: sine (B,L,9) from numpy SineGen -> source (B,1,L) = tanh(l_linear(sine))ᵀ."""

    def __init__(self, model: HiFTGenerator) -> None:
        super().__init__()
        self.model = model

    def forward(self, sine: torch.Tensor) -> torch.Tensor:
        return self.model.merge_source(sine)


class DecodeGraph(nn.Module):
    """hift_decode: mel (B,80,T), s_stft (B,18,64T+1) -> conv_post output x (B,18,64T+1)."""

    def __init__(self, model: HiFTGenerator) -> None:
        super().__init__()
        self.model = model

    def forward(self, mel: torch.Tensor, s_stft: torch.Tensor) -> torch.Tensor:
        return self.model.conv_decode(mel, s_stft)


_DYNAMIC_AXES: dict[str, dict[str, dict[int, str]]] = {
    "hift_f0": {"mel": {0: "batch", 2: "frames"}, "f0": {0: "batch", 1: "frames"}},
    "hift_source": {"sine": {0: "batch", 1: "samples"}, "source": {0: "batch", 2: "samples"}},
    "hift_decode": {
        "mel": {0: "batch", 2: "frames"},
        "s_stft": {0: "batch", 2: "stft_frames"},
        "x": {0: "batch", 2: "stft_frames"},
    },
}
# The HiFT graphs' inputs and outputs, as every family's contract lists them (tests/test_export_hift.py checks that).
HIFT_IO: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "hift_f0": (("mel",), ("f0",)),
    "hift_source": (("sine",), ("source",)),
    "hift_decode": (("mel", "s_stft"), ("x",)),
}


def _inputs(model: HiFTGenerator, batch: int, frames: int, seed: int) -> dict[str, torch.Tensor]:
    """Plausible inputs for every HiFT graph: log-mel around -5, a noisy harmonic stack, its source's STFT."""
    gen = torch.Generator().manual_seed(seed)
    samples = frames * model.upsample_factor
    mel = torch.randn(batch, model.cfg.in_channels, frames, generator=gen) * 2 - 5
    sine = torch.randn(batch, samples, model.num_harmonics, generator=gen) * 0.05
    with torch.no_grad():
        s_stft = model.stft(model.merge_source(sine))
    return {"mel": mel, "sine": sine, "s_stft": s_stft}


def _wrappers(model: HiFTGenerator) -> dict[str, nn.Module]:
    return {"hift_f0": F0Graph(model), "hift_source": SourceGraph(model), "hift_decode": DecodeGraph(model)}


def export_hift(model: HiFTGenerator, out_dir: Path) -> list[ExportedGraph]:
    """Write hift_f0.onnx, hift_source.onnx and hift_decode.onnx to `out_dir` (opset 13, weight norm folded).

    `model` must hold the loaded weights; it is not modified (a folded copy is exported).
    """
    folded = model.folded_copy()
    example = _inputs(folded, _TRACE_BATCH, _TRACE_FRAMES, seed=0)
    out_dir.mkdir(parents=True, exist_ok=True)
    exported = []
    for name, wrapper in _wrappers(folded).items():
        input_names, output_names = HIFT_IO[name]
        args = tuple(example[n] for n in input_names)
        path = out_dir / f"{name}.onnx"
        exported.append(export_graph(wrapper, args, path, input_names, output_names, _DYNAMIC_AXES[name]))
    return exported


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _max_error(name: str, session: ort.InferenceSession, module: nn.Module, inputs: dict[str, torch.Tensor]) -> float:
    input_names, _ = HIFT_IO[name]
    feeds = {n: inputs[n].numpy() for n in input_names}
    (got,) = session.run(None, feeds)
    with torch.no_grad():
        want = module(*(inputs[n] for n in input_names)).numpy()
    if got.shape != want.shape:
        shapes = {n: a.shape for n, a in feeds.items()}
        raise ExportError(f"{name}: ONNX output shape {got.shape} != torch {want.shape} for inputs {shapes}")
    return float(np.max(np.abs(got - want)))


def verify_hift(model: HiFTGenerator, out_dir: Path, seed: int = 0) -> dict[str, float]:
    """Run the graphs in `out_dir` with ONNX Runtime against `model` on every VERIFY_SHAPES (batch, frames).

    Returns graph name -> max abs error over all shapes. Raises ExportError if an output shape differs.
    """
    model = model.eval()
    wrappers = _wrappers(model)
    sessions = {name: _session(out_dir / f"{name}.onnx") for name in wrappers}
    errors = dict.fromkeys(wrappers, 0.0)
    for i, (batch, frames) in enumerate(VERIFY_SHAPES):
        inputs = _inputs(model, batch, frames, seed + i)
        for name, session in sessions.items():
            errors[name] = max(errors[name], _max_error(name, session, wrappers[name], inputs))
    return errors
