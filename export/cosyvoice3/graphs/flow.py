"""Fun-CosyVoice3 flow graphs (flow_speaker, flow_encoder, flow_estimator with explicit streaming caches) and checks.

A chunk call takes what earlier calls of the same sequence left (the look-ahead layer's last conv1 outputs, the DiT's
position-embedding convolution inputs and every block's keys and values) and returns what this call adds. The same
graphs run a whole sequence in one call (empty caches, start 0) with full attention (`chunk` = a huge value).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnxruntime as ort
import torch
from torch import Tensor, nn

from export.cosyvoice3.modules.dit import DiTCache
from export.cosyvoice3.modules.flow import CausalMaskedDiffWithDiT
from export.graphs.common import graph_names, max_error, run, session
from export.modules.chunk_causal import FULL_ATTENTION
from export.onnx_io import ExportedGraph, export_graph
from service.families.cosyvoice3.contract import GRAPH_IO, CosyVoice3Constants


class SpeakerGraph(nn.Module):
    """flow_speaker: embedding (B,192) raw x-vector -> spks (B,80)."""

    def __init__(self, flow: CausalMaskedDiffWithDiT) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, embedding: Tensor) -> Tensor:
        return self.flow.speaker(embedding)


class EncoderGraph(nn.Module):
    """flow_encoder: new tokens (B,T) + look-ahead context (B,K<=3) + tail (B,C1,2) -> h (B,T,80), tail_out."""

    def __init__(self, flow: CausalMaskedDiffWithDiT) -> None:
        super().__init__()
        self.flow = flow

    def forward(self, tokens: Tensor, context: Tensor, tail: Tensor) -> tuple[Tensor, Tensor]:
        return self.flow.lookahead(tokens, context, tail)


class EstimatorGraph(nn.Module):
    """flow_estimator: x, mu, t, spks, cond of new frames at `start` + caches -> v and what the caches gain.

    Keys and values cross the graph's edge time-first, as CosyVoice2's: past_k_b/past_v_b (B,C,H,DK), new_k/new_v
    (blocks,B,M,H,DK) (the engine appends frames to one buffer per guidance row in place)."""

    def __init__(self, flow: CausalMaskedDiffWithDiT) -> None:
        super().__init__()
        self.flow = flow

    def forward(
        self,
        x: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        chunk: Tensor,
        start: Tensor,
        tails: Tensor,
        *kv: Tensor,
    ) -> tuple[Tensor, ...]:
        nb = len(kv) // 2
        heads_first = [a.transpose(1, 2) for a in kv]
        cache = DiTCache(tails, heads_first[:nb], heads_first[nb:])
        v, new = self.flow.estimator.chunk_step(x, mu, t, spks, cond, chunk, start, cache)
        new_k, new_v = torch.stack(new.k).transpose(2, 3), torch.stack(new.v).transpose(2, 3)
        return v, new.tails, new_k, new_v


def _names(graph: str, extra: CosyVoice3Constants) -> tuple[list[str], list[str]]:
    return graph_names(GRAPH_IO, graph, 0, extra.graph_counts())


def encoder_args(flow: CausalMaskedDiffWithDiT, batch: int, new: int, context: int, gen: torch.Generator) -> tuple[Tensor, ...]:
    """Inputs of flow_encoder: random tokens, look-ahead tokens and a tail."""
    tokens = torch.randint(0, flow.cfg.vocab_size, (batch, new), generator=gen)
    ctx = torch.randint(0, flow.cfg.vocab_size, (batch, context), generator=gen)
    return tokens, ctx, torch.randn(batch, flow.cfg.lookahead_channels, 2, generator=gen)


def estimator_args(
    flow: CausalMaskedDiffWithDiT, batch: int, frames: int, past: int, gen: torch.Generator, start: int | None = None
) -> tuple[Tensor, ...]:
    """Inputs of flow_estimator: random frames, tails and a past of `past` frames; `start` defaults to `past`."""
    dit = flow.cfg.dit
    x, mu, cond = (torch.randn(batch, 80, frames, generator=gen) for _ in range(3))
    t, spks = torch.rand(batch, generator=gen), torch.randn(batch, 80, generator=gen)
    tails = torch.randn(batch, 2 * dit.dim, flow.estimator.empty_cache().tails.shape[2], generator=gen)
    kv = [torch.randn(batch, past, dit.heads, dit.dim_head, generator=gen) for _ in range(2 * dit.depth)]
    first = torch.tensor([past if start is None else start])
    return (x, mu, t, spks, cond, torch.tensor([dit.static_chunk_size]), first, tails, *kv)


def export_flow(flow: CausalMaskedDiffWithDiT, out_dir: Path, extra: CosyVoice3Constants) -> list[ExportedGraph]:
    """Write flow_speaker/flow_encoder/flow_estimator .onnx into out_dir (opset 13, dynamic batch/length/cache axes)."""
    flow.eval()
    gen = torch.Generator().manual_seed(0)
    enc_axes = {"tokens": {0: "B", 1: "T"}, "context": {0: "B", 1: "K"}, "tail": {0: "B"}, "h": {0: "B", 1: "T"}}
    enc_axes["tail_out"] = {0: "B"}
    est_in, _ = _names("flow_estimator", extra)
    frames = {0: "B", 2: "M"}
    est_axes = {"x": frames, "mu": frames, "cond": frames, "t": {0: "B"}, "spks": {0: "B"}, "tails": {0: "B"}, "v": frames}
    est_axes |= {n: {0: "B", 1: "C"} for n in est_in if n.startswith(("past_k_", "past_v_"))}
    est_axes |= {"tails_out": {0: "B"}, "new_k": {1: "B", 2: "M"}, "new_v": {1: "B", 2: "M"}}
    speaker_args = (torch.randn(2, flow.cfg.spk_embed_dim, generator=gen),)
    plan: list[tuple[str, nn.Module, tuple[Tensor, ...], dict[str, dict[int, str]]]] = [
        ("flow_speaker", SpeakerGraph(flow), speaker_args, {"embedding": {0: "B"}, "spks": {0: "B"}}),
        ("flow_encoder", EncoderGraph(flow), encoder_args(flow, 2, 7, 3, gen), enc_axes),
        ("flow_estimator", EstimatorGraph(flow), estimator_args(flow, 2, 9, 6, gen), est_axes),
    ]
    out: list[ExportedGraph] = []
    for name, wrapper, args, axes in plan:
        inputs, outputs = _names(name, extra)
        out.append(export_graph(wrapper, args, out_dir / f"{name}.onnx", inputs, outputs, axes))
    return out


def _check(sess: ort.InferenceSession, wrapper: nn.Module, args: tuple[Tensor, ...]) -> float:
    got = run(sess, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args, strict=True)})
    want = wrapper(*args)
    return max_error(list(got), list(want) if isinstance(want, tuple) else [want])


# (batch, new tokens, context): a chunk with its look-ahead, one without (the end), one token.
_ENCODER_CASES = ((1, 30, 3), (2, 25, 3), (1, 7, 0), (1, 1, 1), (2, 12, 2))
# (batch, frames, past frames, start): a first chunk, chunks after cached frames, a window whose frames were dropped
# (start beyond the cache), one frame.
_ESTIMATOR_CASES = ((2, 76, 0, 0), (2, 100, 76, 76), (4, 50, 150, 150), (2, 50, 120, 220), (2, 1, 7, 7), (2, 13, 0, 0))


def verify_flow(flow: CausalMaskedDiffWithDiT, out_dir: Path, seed: int = 0) -> dict[str, float]:
    """Each flow graph in onnxruntime against the torch modules on several chunk shapes; name -> max abs error.

    The estimator is also checked with full attention (`chunk` huge, empty caches), its non-streaming use."""
    flow.eval()
    gen = torch.Generator().manual_seed(seed)
    checks: dict[str, Callable[[ort.InferenceSession], float]] = {
        "flow_speaker": lambda s: _check(s, SpeakerGraph(flow), (torch.randn(3, flow.cfg.spk_embed_dim, generator=gen),)),
        "flow_encoder": lambda s: max(_check(s, EncoderGraph(flow), encoder_args(flow, *c, gen)) for c in _ENCODER_CASES),
        "flow_estimator": lambda s: max(_estimator_case(s, flow, case, gen) for case in _ESTIMATOR_CASES),
    }
    with torch.no_grad():
        return {name: check(session(out_dir / f"{name}.onnx")) for name, check in checks.items()}


def _estimator_case(
    sess: ort.InferenceSession, flow: CausalMaskedDiffWithDiT, case: tuple[int, int, int, int], gen: torch.Generator
) -> float:
    batch, frames, past, start = case
    args = estimator_args(flow, batch, frames, past, gen, start)
    err = _check(sess, EstimatorGraph(flow), args)
    if past == 0:
        full = (*args[:5], torch.tensor([FULL_ATTENTION]), args[6], torch.zeros_like(args[7]), *args[8:])
        err = max(err, _check(sess, EstimatorGraph(flow), full))
    return err
