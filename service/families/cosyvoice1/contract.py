"""CosyVoice-300M's bundle contract, shared with export/: its graphs and their inputs and outputs, its prompt models and
files, and the relative positions its LLM step reads. Imports only service.bundle (the exporter reads it too)."""

from __future__ import annotations

import math

import numpy as np

from service.bundle import SPEAKERS_NAME, FamilyLayout

FAMILY = "cosyvoice1"  # CosyVoice-300M (-SFT, -Instruct); also what a manifest without `family` is
TOKENIZER_NAME = "multilingual.tiktoken"
# Graph name -> (input names, output names). `{i}` expands to one name per LLM layer.
GRAPH_IO: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llm_encoder": (("text_ids", "embedding"), ("lm_input",)),
    "llm_embed": (("token",), ("x",)),
    "llm_pos": (("pe",), ("pos",)),
    "llm_step": (("x", "past_len", "past_k_{i}", "past_v_{i}", "pos_{i}"), ("logp", "new_k", "new_v")),
    "flow_encoder": (("tokens", "embedding"), ("h", "spks")),
    "flow_lr": (("x",), ("mu",)),
    "flow_estimator": (("x", "mask", "mu", "t", "spks", "cond"), ("v",)),
    "hift_f0": (("mel",), ("f0",)),
    "hift_source": (("sine",), ("source",)),
    "hift_decode": (("mel", "s_stft"), ("x",)),
}
GRAPH_NAMES: tuple[str, ...] = tuple(GRAPH_IO)
# The prompt models (CAM++ speaker embedding, S3 speech tokenizer v1): graph name -> (file name, inputs, outputs).
PROMPT_GRAPHS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "campplus": ("campplus.onnx", ("input",), ("output",)),
    "speech_tokenizer": ("speech_tokenizer_v1.onnx", ("feats", "feats_length"), ("indices",)),
}
PROMPT_GRAPH_NAMES: tuple[str, ...] = tuple(PROMPT_GRAPHS)
# The native operator a step twin runs each decoder layer as (export/cosyvoice1/relpos_twin.py): it reads only the rows
# of `pos_{i}` at the distances in use, where ONNX Runtime's graph scores every row it is given.
RELPOS_LAYER_OP = "RelPosLayer"
LAYOUT = FamilyLayout(
    FAMILY, GRAPH_IO, PROMPT_GRAPHS, TOKENIZER_NAME, (SPEAKERS_NAME,), native_graphs=("llm_step", "flow_estimator")
)


def relative_pe(rows: int, dim: int) -> np.ndarray:
    """Positional rows of the bundle contract: espnet sinusoids (rows, dim) float32 for relative distances 0..rows-1.

    Row r: `pe[r, 2j] = sin(r * w_j)`, `pe[r, 2j+1] = cos(r * w_j)`, `w_j = exp(2j * -(ln(10000)/dim))`; angles are
    float32 products as in torch. The exp is taken in float64 and rounded to float32: that equals torch's float32 exp
    on all but 2-3 of 512 frequencies (numpy's float32 exp differs on ~200), so pe stays within 4e-6 of torch for
    r < 100 and 3e-5 for r < 1000. The exporter (llm_pos inputs) and the engine build rows with this one function.
    """
    if dim % 2:
        raise ValueError(f"positional dimension must be even, got {dim}")
    exponent = np.arange(0, dim, 2, dtype=np.float32) * np.float32(-(math.log(10000.0) / dim))
    w = np.exp(exponent.astype(np.float64)).astype(np.float32)
    angle = np.arange(rows, dtype=np.float32)[:, None] * w[None, :]
    pe = np.empty((rows, dim), dtype=np.float32)
    pe[:, 0::2] = np.sin(angle)
    pe[:, 1::2] = np.cos(angle)
    return pe
