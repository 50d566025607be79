"""LLM graphs (llm_encoder, llm_embed, llm_pos, llm_step): torch wrappers, export and onnxruntime parity."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import Tensor, nn

from export.cosyvoice1.modules.llm import TransformerLM
from export.onnx_io import ExportedGraph, export_graph
from service.bundle import expand_io_names
from service.families.cosyvoice1.contract import GRAPH_IO, relative_pe

LLM_GRAPHS = ("llm_encoder", "llm_embed", "llm_pos", "llm_step")


class EncoderGraph(nn.Module):
    """llm_encoder: text_ids (B,T), embedding (B,192) -> lm_input (B,T+3,DI)."""

    def __init__(self, model: TransformerLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, text_ids: Tensor, embedding: Tensor) -> Tensor:
        return self.model.encode(text_ids, embedding)


class EmbedGraph(nn.Module):
    """llm_embed: token (B,T) -> x (B,T,DI)."""

    def __init__(self, model: TransformerLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, token: Tensor) -> Tensor:
        return self.model.embed_tokens(token)


class PosGraph(nn.Module):
    """llm_pos: pe (R,D) -> pos (NL,H,R,DK)."""

    def __init__(self, model: TransformerLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, pe: Tensor) -> Tensor:
        return self.model.positional(pe)


class StepGraph(nn.Module):
    """llm_step: x, past_len, past_k_{i}..., past_v_{i}..., pos_{i}... -> logp, new_k, new_v."""

    def __init__(self, model: TransformerLM) -> None:
        super().__init__()
        self.model = model
        self.num_layers = model.cfg.llm.num_blocks

    def forward(self, x: Tensor, past_len: Tensor, *layers: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n = self.num_layers
        return self.model.step(x, past_len, list(layers[:n]), list(layers[n : 2 * n]), list(layers[2 * n :]))


def _geometry(model: TransformerLM) -> tuple[int, int, int]:
    """(NL, H, DK) of the decoder."""
    dec = model.cfg.llm
    return dec.num_blocks, dec.attention_heads, dec.output_size // dec.attention_heads


def _names(graph: str, num_layers: int) -> tuple[list[str], list[str]]:
    inputs, outputs = GRAPH_IO[graph]
    return expand_io_names(inputs, num_layers), expand_io_names(outputs, num_layers)


def _step_axes(num_layers: int) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {"x": {0: "B", 1: "T"}, "past_len": {0: "B"}}
    for i in range(num_layers):
        axes[f"past_k_{i}"] = {0: "B", 2: "C"}
        axes[f"past_v_{i}"] = {0: "B", 2: "C"}
        axes[f"pos_{i}"] = {1: "R"}
    axes.update({"logp": {0: "B"}, "new_k": {1: "B", 3: "T"}, "new_v": {1: "B", 3: "T"}})
    return axes


def export_llm(model: TransformerLM, out_dir: Path) -> list[ExportedGraph]:
    """Write llm_encoder/llm_embed/llm_pos/llm_step .onnx into out_dir (opset 13, dynamic batch/length axes)."""
    model.eval()
    nl, heads, d_k = _geometry(model)
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)
    text_ids = torch.randint(0, cfg.text_token_size, (2, 5), generator=gen)
    embedding = torch.randn(2, cfg.spk_embed_dim, generator=gen)
    tokens = torch.randint(0, cfg.speech_token_size, (2, 3), generator=gen)
    x = torch.randn(2, 3, cfg.llm_input_size, generator=gen)
    past_len = torch.tensor([4, 2])
    cache = [torch.randn(2, heads, 4, d_k, generator=gen) for _ in range(2 * nl)]
    pe = torch.from_numpy(relative_pe(9, cfg.llm_output_size))
    pos = list(model.positional(pe).detach())
    plan: list[tuple[str, nn.Module, tuple[Tensor, ...], dict[str, dict[int, str]]]] = [
        (
            "llm_encoder",
            EncoderGraph(model),
            (text_ids, embedding),
            {"text_ids": {0: "B", 1: "T"}, "embedding": {0: "B"}, "lm_input": {0: "B", 1: "L"}},
        ),
        ("llm_embed", EmbedGraph(model), (tokens,), {"token": {0: "B", 1: "T"}, "x": {0: "B", 1: "T"}}),
        ("llm_pos", PosGraph(model), (pe,), {"pe": {0: "R"}, "pos": {2: "R"}}),
        ("llm_step", StepGraph(model), (x, past_len, *cache, *pos), _step_axes(nl)),
    ]
    out: list[ExportedGraph] = []
    for name, wrapper, args, axes in plan:
        inputs, outputs = _names(name, nl)
        out.append(export_graph(wrapper, args, out_dir / f"{name}.onnx", inputs, outputs, axes))
    return out


def _session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def _max_err(got: list[np.ndarray], want: list[Tensor]) -> float:
    return max(float(np.abs(g - w.detach().numpy()).max()) if g.size else 0.0 for g, w in zip(got, want, strict=True))


def _verify_encoder(model: TransformerLM, sess: ort.InferenceSession, rng: np.random.Generator) -> float:
    err = 0.0
    for batch, length in ((1, 1), (1, 7), (3, 4), (3, 13)):
        ids = rng.integers(0, model.cfg.text_token_size, (batch, length))
        emb = rng.standard_normal((batch, model.cfg.spk_embed_dim)).astype(np.float32)
        got = sess.run(None, {"text_ids": ids, "embedding": emb})
        err = max(err, _max_err(got, [model.encode(torch.from_numpy(ids), torch.from_numpy(emb))]))
    return err


def _verify_embed(model: TransformerLM, sess: ort.InferenceSession, rng: np.random.Generator) -> float:
    err = 0.0
    for batch, length in ((1, 1), (3, 5)):
        tok = rng.integers(0, model.cfg.speech_token_size, (batch, length))
        err = max(err, _max_err(sess.run(None, {"token": tok}), [model.embed_tokens(torch.from_numpy(tok))]))
    return err


def _verify_pos(model: TransformerLM, sess: ort.InferenceSession, rng: np.random.Generator) -> float:
    """ORT on the numpy-built pe vs torch on torch-built sinusoids (so the numpy helper is covered too)."""
    err = 0.0
    for rows in (1, 8, 40):
        got = sess.run(None, {"pe": relative_pe(rows, model.cfg.llm_output_size)})
        err = max(err, _max_err(got, [model.positional(model.pe_rows(rows))]))
    return err


# (batch, new tokens T, past_len per row, cache columns C, pos rows R): prefill, decode, mixed rows,
# C = 0, C and R larger than needed.
_STEP_CASES: tuple[tuple[int, int, tuple[int, ...], int, int], ...] = (
    (1, 6, (0,), 0, 6),
    (3, 5, (0, 0, 0), 0, 9),
    (1, 1, (7,), 7, 8),
    (3, 1, (0, 4, 9), 12, 15),
    (2, 3, (2, 5), 6, 10),
    (3, 4, (3, 0, 3), 3, 7),
)


def _step_reference(model: TransformerLM, feeds: dict[str, np.ndarray], row: int, past: int) -> list[Tensor]:
    """Torch single-row step with the cache cut to exactly `past` columns and R = past + T (official layout)."""
    nl = model.cfg.llm.num_blocks
    x = torch.from_numpy(feeds["x"][row : row + 1])
    rows = past + x.shape[1]

    def cut(name: str) -> list[Tensor]:
        return [torch.from_numpy(feeds[f"{name}_{i}"][row : row + 1, :, :past]) for i in range(nl)]

    pos = [torch.from_numpy(feeds[f"pos_{i}"][:, :rows]) for i in range(nl)]
    logp, k, v = model.step(x, torch.tensor([past]), cut("past_k"), cut("past_v"), pos)
    return [logp[0], k[:, 0], v[:, 0]]


def _step_feeds(model: TransformerLM, case: tuple[int, int, tuple[int, ...], int, int], rng: np.random.Generator):
    batch, length, past_len, cols, rows = case
    nl, heads, d_k = _geometry(model)
    feeds: dict[str, np.ndarray] = {
        "x": rng.standard_normal((batch, length, model.cfg.llm_input_size)).astype(np.float32),
        "past_len": np.asarray(past_len, dtype=np.int64),
    }
    pos = model.positional(torch.from_numpy(relative_pe(rows, model.cfg.llm_output_size))).numpy()
    for i in range(nl):
        for name in ("past_k", "past_v"):
            cache = rng.standard_normal((batch, heads, cols, d_k)).astype(np.float32)
            for b, n in enumerate(past_len):
                cache[b, :, n:] = 1e3  # ignored columns hold large garbage so a masking bug shows
            feeds[f"{name}_{i}"] = cache
        feeds[f"pos_{i}"] = pos[i]
    return feeds


def _verify_step(model: TransformerLM, sess: ort.InferenceSession, rng: np.random.Generator) -> float:
    err = 0.0
    for case in _STEP_CASES:
        feeds = _step_feeds(model, case, rng)
        logp, new_k, new_v = sess.run(None, feeds)
        for b, past in enumerate(case[2]):
            err = max(err, _max_err([logp[b], new_k[:, b], new_v[:, b]], _step_reference(model, feeds, b, past)))
    return err


def verify_llm(model: TransformerLM, out_dir: Path, seed: int = 0) -> dict[str, float]:
    """Run each exported LLM graph in onnxruntime against the torch model; graph name -> max abs error.

    Covers several text lengths, B = 1 and 3, past length 0 (C = 0) and > 0, rows with different past_len
    (each compared to a torch single-row reference), and C, R larger than needed.
    """
    model.eval()
    checks: dict[str, Callable[[TransformerLM, ort.InferenceSession, np.random.Generator], float]] = {
        "llm_encoder": _verify_encoder,
        "llm_embed": _verify_embed,
        "llm_pos": _verify_pos,
        "llm_step": _verify_step,
    }
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        return {name: check(model, _session(out_dir / f"{name}.onnx"), rng) for name, check in checks.items()}
