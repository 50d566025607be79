"""The Qwen2 speech LLM graphs (llm_prompt, llm_embed, llm_step with an explicit grouped K/V cache) of the Qwen2-based
families, and their parity checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import Tensor, nn

from export.graphs.common import graph_names, max_error, run, session
from export.modules.qwen2 import Qwen2SpeechLM
from export.onnx_io import ExportedGraph, export_graph
from service.bundle.family import GraphIO

LLM_GRAPHS = ("llm_prompt", "llm_embed", "llm_step")


class PromptGraph(nn.Module):
    """llm_prompt: text_ids (B,T) -> x (B,T+2,D) = [sos, text embeddings, task]."""

    def __init__(self, model: Qwen2SpeechLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, text_ids: Tensor) -> Tensor:
        return self.model.prompt(text_ids)


class EmbedGraph(nn.Module):
    """llm_embed: token (B,T) -> x (B,T,D) speech embeddings."""

    def __init__(self, model: Qwen2SpeechLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, token: Tensor) -> Tensor:
        return self.model.embed_tokens(token)


class StepGraph(nn.Module):
    """llm_step: x, past_len, past_k_{i}..., past_v_{i}... -> logp, new_k, new_v."""

    def __init__(self, model: Qwen2SpeechLM) -> None:
        super().__init__()
        self.model = model
        self.num_layers = model.qwen.num_layers

    def forward(self, x: Tensor, past_len: Tensor, *cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n = self.num_layers
        return self.model.step(x, past_len, list(cache[:n]), list(cache[n:]))


def _step_axes(num_layers: int) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {"x": {0: "B", 1: "T"}, "past_len": {0: "B"}}
    for i in range(num_layers):
        axes[f"past_k_{i}"] = {0: "B", 2: "C"}
        axes[f"past_v_{i}"] = {0: "B", 2: "C"}
    axes.update({"logp": {0: "B"}, "new_k": {1: "B", 3: "T"}, "new_v": {1: "B", 3: "T"}})
    return axes


def export_llm(model: Qwen2SpeechLM, out_dir: Path, graph_io: GraphIO) -> list[ExportedGraph]:
    """Write llm_prompt/llm_embed/llm_step .onnx into out_dir (opset 13, dynamic batch, length and cache axes), named as
    the family's `graph_io` says."""
    model.eval()
    q = model.qwen
    gen = torch.Generator().manual_seed(0)
    text_ids = torch.randint(0, q.vocab_size, (2, 5), generator=gen)
    tokens = torch.randint(0, model.llm_decoder.out_features, (2, 3), generator=gen)
    x = torch.randn(2, 3, q.hidden_size, generator=gen)
    cache = [torch.randn(2, q.num_kv_heads, 4, q.head_dim, generator=gen) for _ in range(2 * q.num_layers)]
    plan: list[tuple[str, nn.Module, tuple[Tensor, ...], dict[str, dict[int, str]]]] = [
        ("llm_prompt", PromptGraph(model), (text_ids,), {"text_ids": {0: "B", 1: "T"}, "x": {0: "B", 1: "L"}}),
        ("llm_embed", EmbedGraph(model), (tokens,), {"token": {0: "B", 1: "T"}, "x": {0: "B", 1: "T"}}),
        ("llm_step", StepGraph(model), (x, torch.tensor([4, 2]), *cache), _step_axes(q.num_layers)),
    ]
    out: list[ExportedGraph] = []
    for name, wrapper, args, axes in plan:
        inputs, outputs = graph_names(graph_io, name, q.num_layers, {})
        out.append(export_graph(wrapper, args, out_dir / f"{name}.onnx", inputs, outputs, axes))
    return out


def _verify_prompt(model: Qwen2SpeechLM, sess: ort.InferenceSession, rng: np.random.Generator) -> float:
    err = 0.0
    for batch, length in ((1, 1), (1, 9), (3, 4)):
        ids = rng.integers(0, model.qwen.vocab_size, (batch, length))
        err = max(err, max_error(sess.run(None, {"text_ids": ids}), [model.prompt(torch.from_numpy(ids))]))
    return err


def _verify_embed(model: Qwen2SpeechLM, sess: ort.InferenceSession, rng: np.random.Generator) -> float:
    err = 0.0
    for batch, length in ((1, 1), (3, 5)):
        tok = rng.integers(0, model.llm_decoder.out_features, (batch, length))
        err = max(err, max_error(sess.run(None, {"token": tok}), [model.embed_tokens(torch.from_numpy(tok))]))
    return err


# (batch, new tokens T, past_len per row, cache columns C): prefill, decode, rows of different lengths, C = 0,
# C larger than any row needs.
_STEP_CASES: tuple[tuple[int, int, tuple[int, ...], int], ...] = (
    (1, 6, (0,), 0),
    (3, 5, (0, 0, 0), 0),
    (1, 1, (7,), 7),
    (3, 1, (0, 4, 9), 12),
    (2, 3, (2, 5), 6),
)


def _verify_step(model: Qwen2SpeechLM, sess: ort.InferenceSession, rng: np.random.Generator) -> float:
    q = model.qwen
    err = 0.0
    for batch, length, past_len, cols in _STEP_CASES:
        feeds: dict[str, np.ndarray] = {
            "x": rng.standard_normal((batch, length, q.hidden_size)).astype(np.float32),
            "past_len": np.asarray(past_len, dtype=np.int64),
        }
        for i in range(q.num_layers):
            for name in ("past_k", "past_v"):
                cache = rng.standard_normal((batch, q.num_kv_heads, cols, q.head_dim)).astype(np.float32)
                for b, n in enumerate(past_len):
                    cache[b, :, n:] = 1e3  # ignored columns hold large garbage so a masking bug shows
                feeds[f"{name}_{i}"] = cache
        logp, new_k, new_v = run(sess, feeds)
        for b, past in enumerate(past_len):  # each row against a torch single-row step with exactly its past
            cut = [torch.from_numpy(feeds[f"past_{kv}_{i}"][b : b + 1, :, :past]) for kv in "kv" for i in range(q.num_layers)]
            want = model.step(
                torch.from_numpy(feeds["x"][b : b + 1]), torch.tensor([past]), cut[: q.num_layers], cut[q.num_layers :]
            )
            err = max(err, max_error([logp[b], new_k[:, b], new_v[:, b]], [want[0][0], want[1][:, 0], want[2][:, 0]]))
    return err


def verify_llm(model: Qwen2SpeechLM, out_dir: Path, seed: int = 0) -> dict[str, float]:
    """Each LLM graph in onnxruntime against the torch model; graph name -> max abs error."""
    model.eval()
    rng = np.random.default_rng(seed)
    checks = {"llm_prompt": _verify_prompt, "llm_embed": _verify_embed, "llm_step": _verify_step}
    with torch.no_grad():
        return {name: check(model, session(out_dir / f"{name}.onnx"), rng) for name, check in checks.items()}


def step_deviation(fp32_step: Path, quant_step: Path, *, rows: int = 8, past: int = 24, seed: int = 0) -> dict[str, float]:
    """How far a quantized decode step is from the fp32 one: `rows` random hidden inputs after `past` random cached
    positions (float16-exact, as the quantized step reads its cache), max and mean |log-prob difference| and the share
    of rows whose most likely token is unchanged."""
    outs = []
    for path in (fp32_step, quant_step):
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        feeds: dict[str, np.ndarray] = {}
        gen = np.random.default_rng(seed)
        for i in sess.get_inputs():
            if i.name == "past_len":
                feeds[i.name] = np.full(rows, past, dtype=np.int64)
                continue
            shape = [rows if d == "B" else past if d == "C" else 1 if isinstance(d, str) else d for d in i.shape]
            value = (gen.standard_normal(shape) * (1.0 if i.name == "x" else 0.5)).astype(np.float16)
            feeds[i.name] = value if i.type == "tensor(float16)" else value.astype(np.float32)
        outs.append(np.asarray(sess.run(["logp"], feeds)[0], dtype=np.float64).reshape(rows, -1))
    want, got = outs
    err = np.abs(got - want)
    top1 = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    return {"logp_max_abs": float(err.max()), "logp_mean_abs": float(err.mean()), "top1_agreement": top1}
