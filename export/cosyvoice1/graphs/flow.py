"""Flow ONNX graphs (flow_encoder, flow_lr, flow_estimator): wrappers, export, and ORT-vs-torch parity."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import Tensor, nn

from export.modules.flow import MaskedDiffWithXvec
from export.onnx_io import ExportedGraph, export_graph

ENCODER_LENGTHS = (1, 9, 40)
FRAME_LENGTHS = (1, 7, 36, 69)  # odd and even: the estimator halves the time axis and doubles it back
BATCHES = (1, 2, 4)


class FlowEncoderGraph(nn.Module):
    """tokens (B, T) int64, embedding (B, 192) raw x-vector -> h (B, T, 80), spks (B, 80)."""

    def __init__(self, flow: MaskedDiffWithXvec) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, tokens: Tensor, embedding: Tensor) -> tuple[Tensor, Tensor]:
        return self.flow.encode(tokens), self.flow.speaker(embedding)


class FlowRegulatorGraph(nn.Module):
    """x (B, 80, M) interpolated to mel rate -> mu (B, 80, M) through the length regulator's conv stack."""

    def __init__(self, flow: MaskedDiffWithXvec) -> None:
        super().__init__()
        self.regulator = flow.length_regulator

    def forward(self, x: Tensor) -> Tensor:
        return self.regulator(x)


class FlowEstimatorGraph(nn.Module):
    """One velocity evaluation v(x, mask, mu, t, spks, cond), shapes as in docs/bundle-format.md."""

    def __init__(self, flow: MaskedDiffWithXvec) -> None:
        super().__init__()
        self.estimator = flow.decoder.estimator

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        return self.estimator(x, mask, mu, t, spks, cond)


def _encoder_inputs(flow: MaskedDiffWithXvec, batch: int, length: int, gen: torch.Generator) -> tuple[Tensor, ...]:
    cfg = flow.cfg
    tokens = torch.randint(0, cfg.vocab_size, (batch, length), generator=gen)
    return tokens, torch.randn(batch, cfg.spk_embed_dim, generator=gen)


def _lr_inputs(flow: MaskedDiffWithXvec, batch: int, frames: int, gen: torch.Generator) -> tuple[Tensor, ...]:
    return (torch.randn(batch, flow.cfg.lr_channels, frames, generator=gen),)


def _padding_mask(batch: int, frames: int) -> Tensor:
    """Row 0 full length, later rows shorter (at least one frame), as a batch of padded requests would be."""
    lengths = [max(1, frames - b * (frames // 4 + 1)) if b else frames for b in range(batch)]
    return (torch.arange(frames)[None, :] < torch.tensor(lengths)[:, None]).float().unsqueeze(1)


def _estimator_inputs(flow: MaskedDiffWithXvec, batch: int, frames: int, gen: torch.Generator) -> tuple[Tensor, ...]:
    n_mels = flow.cfg.output_size
    mask = _padding_mask(batch, frames)
    x = torch.randn(batch, n_mels, frames, generator=gen)
    mu = torch.randn(batch, n_mels, frames, generator=gen) * mask
    t = torch.rand(batch, generator=gen)
    spks = torch.randn(batch, n_mels, generator=gen) * 0.1
    cond = torch.randn(batch, n_mels, frames, generator=gen) * mask
    return x, mask, mu, t, spks, cond


_InputFn = Callable[[MaskedDiffWithXvec, int, int, torch.Generator], tuple[Tensor, ...]]


@dataclass(frozen=True)
class _GraphSpec:
    """How to build, name, trace and verify one flow graph."""

    wrapper: type[nn.Module]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dynamic_axes: dict[str, dict[int, str]]
    make_inputs: _InputFn
    lengths: tuple[int, ...]  # token or frame counts checked by verify_flow


_BATCH_FRAMES = {0: "batch", 2: "frames"}
_GRAPHS: dict[str, _GraphSpec] = {
    "flow_encoder": _GraphSpec(
        FlowEncoderGraph,
        ("tokens", "embedding"),
        ("h", "spks"),
        {"tokens": {0: "batch", 1: "tokens"}, "embedding": {0: "batch"}, "h": {0: "batch", 1: "tokens"}, "spks": {0: "batch"}},
        _encoder_inputs,
        ENCODER_LENGTHS,
    ),
    "flow_lr": _GraphSpec(
        FlowRegulatorGraph, ("x",), ("mu",), {"x": _BATCH_FRAMES, "mu": _BATCH_FRAMES}, _lr_inputs, FRAME_LENGTHS
    ),
    "flow_estimator": _GraphSpec(
        FlowEstimatorGraph,
        ("x", "mask", "mu", "t", "spks", "cond"),
        ("v",),
        {n: _BATCH_FRAMES for n in ("x", "mask", "mu", "cond", "v")} | {"t": {0: "batch"}, "spks": {0: "batch"}},
        _estimator_inputs,
        FRAME_LENGTHS,
    ),
}


def export_flow(model: MaskedDiffWithXvec, out_dir: Path) -> list[ExportedGraph]:
    """Write flow_encoder.onnx, flow_lr.onnx and flow_estimator.onnx into `out_dir` (opset 13, dynamic axes).

    The example inputs are traced at batch 2 and an odd length, from a fixed seed, so the bytes are reproducible.
    """
    model.eval()
    exported = []
    for name, spec in _GRAPHS.items():
        args = spec.make_inputs(model, 2, 11, torch.Generator().manual_seed(0))
        path = out_dir / f"{name}.onnx"
        exported.append(export_graph(spec.wrapper(model), args, path, spec.inputs, spec.outputs, spec.dynamic_axes))
    return exported


def _session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def _max_error(session: ort.InferenceSession, module: nn.Module, names: tuple[str, ...], args: tuple[Tensor, ...]) -> float:
    with torch.no_grad():
        expected = module(*args)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = session.run(None, {n: a.numpy() for n, a in zip(names, args, strict=True)})
    return max(float(np.abs(g - e.numpy()).max()) for g, e in zip(got, expected, strict=True))


def verify_flow(model: MaskedDiffWithXvec, out_dir: Path, seed: int = 0) -> dict[str, float]:
    """Max abs error of each flow graph in `out_dir` (ORT) against the torch module, over batch 1, 2, 4 and
    several lengths (odd and even; estimator rows after the first are padded with mask zeros)."""
    model.eval()
    errors: dict[str, float] = {}
    for name, spec in _GRAPHS.items():
        session, module = _session(out_dir / f"{name}.onnx"), spec.wrapper(model)
        gen = torch.Generator().manual_seed(seed)
        cases = [spec.make_inputs(model, batch, length, gen) for batch in BATCHES for length in spec.lengths]
        errors[name] = max(_max_error(session, module, spec.inputs, args) for args in cases)
    return errors
