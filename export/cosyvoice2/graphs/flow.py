"""CosyVoice2 flow graphs (flow_speaker, flow_encoder and flow_estimator with explicit streaming caches) and checks.

A chunk call takes what earlier calls of the same sequence left (the causal convolutions' last inputs, every
attention block's keys and values) and returns what this call adds, so a streaming request computes each frame
once. The same graphs run a whole sequence in one call (empty caches) with full attention (`chunk` = a huge value).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import Tensor, nn

from export.cosyvoice2.config import UP_BLOCKS
from export.cosyvoice2.graphs.common import graph_names, max_error, run, session
from export.cosyvoice2.modules.encoder import EncoderCache
from export.cosyvoice2.modules.estimator import EstimatorCache
from export.cosyvoice2.modules.flow import FULL_ATTENTION, CausalMaskedDiffWithXvec
from export.onnx_io import ExportedGraph, export_graph
from service.families.cosyvoice2.contract import CosyVoice2Constants


class SpeakerGraph(nn.Module):
    """flow_speaker: embedding (B,192) raw x-vector -> spks (B,80)."""

    def __init__(self, flow: CausalMaskedDiffWithXvec) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, embedding: Tensor) -> Tensor:
        return self.flow.speaker(embedding)


class EncoderGraph(nn.Module):
    """flow_encoder: new tokens + look-ahead context + caches -> h (B,2T,80) and what the caches gain."""

    def __init__(self, flow: CausalMaskedDiffWithXvec) -> None:
        super().__init__()
        self.flow = flow
        self.blocks = flow.cfg.encoder.num_blocks

    def forward(
        self, tokens: Tensor, context: Tensor, chunk: Tensor, look_ahead: Tensor, up_tail: Tensor, *kv: Tensor
    ) -> tuple[Tensor, ...]:
        n, u = self.blocks, len(kv) // 2 - self.blocks
        cache = EncoderCache(
            look_ahead, up_tail, list(kv[:n]), list(kv[n : 2 * n]), list(kv[2 * n : 2 * n + u]), list(kv[2 * n + u :])
        )
        h, tails, new = self.flow.encoder.chunk_step(self.flow.embed(tokens), self.flow.embed(context), chunk, cache)
        return (self.flow.encoder_proj(h), tails.look_ahead, tails.up, *new)


class EstimatorGraph(nn.Module):
    """flow_estimator: x, mu, t, spks, cond of new frames + caches -> v and what the caches gain.

    Keys and values cross the graph's edge time-first: past_k_i/past_v_i (B,C,H,DK), new_k/new_v (blocks,B,M,H,DK).
    The engine keeps each guidance row's cache as one buffer per step whose frames are appended in place, and a
    time-first slice of it is a contiguous input; heads-first, every call copied the whole cache to append a chunk.
    """

    def __init__(self, flow: CausalMaskedDiffWithXvec) -> None:
        super().__init__()
        self.flow = flow
        self.split = flow.estimator.tail_channels()

    def forward(
        self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, chunk: Tensor, tails: Tensor, *kv: Tensor
    ) -> tuple[Tensor, ...]:
        nb = len(kv) // 2
        heads_first = [a.transpose(1, 2) for a in kv]
        # tails stay (B, channels, 2) at the graph's edge; the estimator reads them time-first
        cache = EstimatorCache(list(torch.split(tails.transpose(1, 2), self.split, dim=2)), heads_first[:nb], heads_first[nb:])
        v, new = self.flow.estimator.chunk_step(x, mu, t, spks, cond, chunk, cache)
        new_k, new_v = torch.stack(new.k).transpose(2, 3), torch.stack(new.v).transpose(2, 3)
        return v, torch.cat(new.tails, dim=2).transpose(1, 2), new_k, new_v


def _kv_axes(names: list[str], prefix: tuple[str, ...], time_axis: int = 2) -> dict[str, dict[int, str]]:
    return {n: {0: "B", time_axis: "C"} for n in names if n.startswith(prefix)}


def encoder_args(
    flow: CausalMaskedDiffWithXvec, batch: int, new: int, context: int, past: int, gen: torch.Generator
) -> tuple[Tensor, ...]:
    """Inputs of flow_encoder: random tokens, tails and a past of `past` tokens."""
    enc = flow.cfg.encoder
    tokens = torch.randint(0, flow.cfg.vocab_size, (batch, new), generator=gen)
    ctx = torch.randint(0, flow.cfg.vocab_size, (batch, context), generator=gen)
    tails = [torch.randn(batch, enc.output_size, 2, generator=gen) for _ in range(2)]

    def kv(n: int, cols: int) -> list[Tensor]:
        return [torch.randn(batch, enc.attention_heads, cols, enc.head_dim, generator=gen) for _ in range(n)]

    kvs = kv(2 * enc.num_blocks, past) + kv(2 * UP_BLOCKS, 2 * past)
    return (tokens, ctx, torch.tensor([enc.chunk_size]), *tails, *kvs)


def estimator_args(
    flow: CausalMaskedDiffWithXvec, batch: int, frames: int, past: int, gen: torch.Generator
) -> tuple[Tensor, ...]:
    """Inputs of flow_estimator: random frames, tails and a past of `past` frames."""
    est = flow.cfg.estimator
    x, mu, cond = (torch.randn(batch, 80, frames, generator=gen) for _ in range(3))
    t, spks = torch.rand(batch, generator=gen), torch.randn(batch, 80, generator=gen)
    tails = torch.randn(batch, sum(flow.estimator.tail_channels()), 2, generator=gen)
    kv = [
        torch.randn(batch, past, est.num_heads, est.attention_head_dim, generator=gen) for _ in range(2 * est.transformer_blocks)
    ]
    return (x, mu, t, spks, cond, torch.tensor([est.static_chunk_size]), tails, *kv)


def export_flow(flow: CausalMaskedDiffWithXvec, out_dir: Path, extra: CosyVoice2Constants) -> list[ExportedGraph]:
    """Write flow_speaker/flow_encoder/flow_estimator .onnx into out_dir (opset 13, dynamic batch/length/cache axes)."""
    flow.eval()
    gen = torch.Generator().manual_seed(0)
    out: list[ExportedGraph] = []
    enc_in, enc_out = graph_names("flow_encoder", 0, extra)
    enc_axes = {
        "tokens": {0: "B", 1: "T"},
        "context": {0: "B", 1: "K"},
        "look_ahead": {0: "B"},
        "up_tail": {0: "B"},
        "h": {0: "B", 1: "T2"},
    }
    enc_axes |= _kv_axes(enc_in, ("enc_k_", "enc_v_", "up_k_", "up_v_"))
    enc_axes |= {"look_ahead_out": {0: "B"}, "up_tail_out": {0: "B"}}
    enc_axes |= {n: {1: "B", 3: "T" if n.startswith("enc") else "T2"} for n in enc_out if n.endswith(("_new_k", "_new_v"))}
    est_in, est_out = graph_names("flow_estimator", 0, extra)
    frames = {0: "B", 2: "M"}
    est_axes = {"x": frames, "mu": frames, "cond": frames, "t": {0: "B"}, "spks": {0: "B"}, "tails": {0: "B"}, "v": frames}
    est_axes |= _kv_axes(est_in, ("past_k_", "past_v_"), time_axis=1) | {
        "tails_out": {0: "B"},
        "new_k": {1: "B", 2: "M"},
        "new_v": {1: "B", 2: "M"},
    }
    spk_in, spk_out = graph_names("flow_speaker", 0, extra)
    speaker_args = (torch.randn(2, flow.cfg.spk_embed_dim, generator=gen),)
    plan: list[tuple[str, nn.Module, tuple[Tensor, ...], list[str], list[str], dict[str, dict[int, str]]]] = [
        ("flow_speaker", SpeakerGraph(flow), speaker_args, spk_in, spk_out, {"embedding": {0: "B"}, "spks": {0: "B"}}),
        ("flow_encoder", EncoderGraph(flow), encoder_args(flow, 2, 7, 3, 5, gen), enc_in, enc_out, enc_axes),
        ("flow_estimator", EstimatorGraph(flow), estimator_args(flow, 2, 9, 6, gen), est_in, est_out, est_axes),
    ]
    for name, wrapper, args, inputs, outputs, axes in plan:
        out.append(export_graph(wrapper, args, out_dir / f"{name}.onnx", inputs, outputs, axes))
    return out


def _feeds(sess: ort.InferenceSession, args: tuple[Tensor, ...]) -> dict[str, np.ndarray]:
    return {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args, strict=True)}


def _check(sess: ort.InferenceSession, wrapper: nn.Module, args: tuple[Tensor, ...]) -> float:
    got = run(sess, _feeds(sess, args))
    want = wrapper(*args)
    return max_error(list(got), list(want) if isinstance(want, tuple) else [want])


# (batch, new tokens, context, past tokens): a first chunk with and without look-ahead, later chunks, one token.
_ENCODER_CASES = ((1, 30, 3, 0), (2, 25, 3, 25), (1, 50, 2, 38), (1, 7, 0, 63), (1, 1, 1, 4), (2, 12, 0, 0))
# (batch, frames, past frames)
_ESTIMATOR_CASES = ((2, 76, 0), (2, 100, 76), (4, 50, 150), (2, 1, 7), (2, 13, 0))


def verify_flow(flow: CausalMaskedDiffWithXvec, out_dir: Path, seed: int = 0) -> dict[str, float]:
    """Each flow graph in onnxruntime against the torch modules on several chunk shapes; name -> max abs error.

    The encoder and estimator are also checked with full attention (`chunk` huge, empty caches), their
    non-streaming use.
    """
    flow.eval()
    gen = torch.Generator().manual_seed(seed)
    checks: dict[str, Callable[[ort.InferenceSession], float]] = {
        "flow_speaker": lambda s: _check(s, SpeakerGraph(flow), (torch.randn(3, flow.cfg.spk_embed_dim, generator=gen),)),
        "flow_encoder": lambda s: max(_encoder_case(s, flow, case, gen) for case in _ENCODER_CASES),
        "flow_estimator": lambda s: max(_estimator_case(s, flow, case, gen) for case in _ESTIMATOR_CASES),
    }
    with torch.no_grad():
        return {name: check(session(out_dir / f"{name}.onnx")) for name, check in checks.items()}


def _encoder_case(
    sess: ort.InferenceSession, flow: CausalMaskedDiffWithXvec, case: tuple[int, int, int, int], gen: torch.Generator
) -> float:
    batch, new, context, past = case
    args = encoder_args(flow, batch, new, context, past, gen)
    err = _check(sess, EncoderGraph(flow), args)
    if past == 0:  # the whole-sequence (non-streaming) form: zero tails, full attention
        full = (*args[:2], torch.tensor([FULL_ATTENTION]), torch.zeros_like(args[3]), torch.zeros_like(args[4]), *args[5:])
        err = max(err, _check(sess, EncoderGraph(flow), full))
    return err


def _estimator_case(
    sess: ort.InferenceSession, flow: CausalMaskedDiffWithXvec, case: tuple[int, int, int], gen: torch.Generator
) -> float:
    batch, frames, past = case
    args = estimator_args(flow, batch, frames, past, gen)
    err = _check(sess, EstimatorGraph(flow), args)
    if past == 0:
        full = (*args[:5], torch.tensor([FULL_ATTENTION]), torch.zeros_like(args[6]), *args[7:])
        err = max(err, _check(sess, EstimatorGraph(flow), full))
    return err
