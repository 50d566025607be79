"""A random-weight CosyVoice2 checkpoint in the official layout, built by the official classes from a resized yaml.

Every value comes from numpy.random.RandomState(seed). Tensors of 1,024 elements or more are strided views into a few
shared random pools (one pool per scale, per file), so torch.save writes each pool once: the files stay small although
the flow encoder's widths are fixed at 512 by the official code (upsample_encoder.py: PreLookaheadLayer and Upsample1D
are built with 512 channels whatever the yaml says). A view's rows are overlapping windows of its pool; views of
different tensors start at different offsets with different row strides, so no two tensors are equal.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

OFFICIAL_YAML = "examples/libritts/cosyvoice2/conf/cosyvoice2.yaml"
BLANK = "CosyVoice-BlankEN"
TEXT_VOCAB = 151936  # Qwen2's embedding rows (151,643 BPE tokens + added tokens, padded)
POOLED_MIN_NUMEL = 1024
POOL_NUMEL = 1 << 16
EMBEDDING_ROW_STRIDE = 2  # text embedding rows: windows 2 elements apart in their own pool


@dataclass(frozen=True)
class Size:
    """The yaml and Qwen2 sizes that a checkpoint size changes (everything else is the official value)."""

    llm_hidden: int
    llm_layers: int
    llm_heads: int
    llm_kv_heads: int
    llm_ffn: int
    flow_linear_units: int
    flow_blocks: int
    est_channels: int
    est_head_dim: int
    est_blocks: int
    est_mid_blocks: int
    hift_channels: int


FULL = Size(896, 24, 14, 2, 4864, 2048, 6, 256, 64, 4, 12, 512)
SIZES = {
    "tiny": Size(32, 2, 4, 2, 64, 64, 1, 64, 16, 1, 2, 64),
    "medium": Size(128, 4, 8, 2, 384, 512, 2, 128, 32, 2, 4, 128),
    "full": FULL,
}
# (label, anchor line, key, field of Size): the first `key:` line after the anchor takes the field's value.
ENC = "encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder"
EST = "estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder"
HIFT = "hift: !new:cosyvoice.hifigan.generator.HiFTGenerator"
YAML_EDITS = [
    ("llm_input_size", "# fixed params", "llm_input_size", "llm_hidden"),
    ("llm_output_size", "# fixed params", "llm_output_size", "llm_hidden"),
    ("flow.encoder.linear_units", ENC, "linear_units", "flow_linear_units"),
    ("flow.encoder.num_blocks", ENC, "num_blocks", "flow_blocks"),
    ("flow.decoder.estimator.channels", EST, "channels", "est_channels"),
    ("flow.decoder.estimator.attention_head_dim", EST, "attention_head_dim", "est_head_dim"),
    ("flow.decoder.estimator.n_blocks", EST, "n_blocks", "est_blocks"),
    ("flow.decoder.estimator.num_mid_blocks", EST, "num_mid_blocks", "est_mid_blocks"),
    ("hift.base_channels", HIFT, "base_channels", "hift_channels"),
    ("hift.f0_predictor.cond_channels", HIFT, "cond_channels", "hift_channels"),
]


def resized_yaml(official: str, size: Size) -> tuple[str, list[tuple[str, str, str]]]:
    """The official cosyvoice2.yaml with the sizes of `size`; also the (key, official value, new value) changes."""
    text, changes = official, []
    for label, anchor, key, field in YAML_EDITS:
        line = re.compile(rf"^([ \t]*{key}: )([^#\n]*)", re.M).search(text, text.index(anchor))
        if line is None:
            raise ValueError(f"{key} not found after {anchor!r} in the official yaml")
        old = line.group(2).strip()
        value = getattr(size, field)
        new = f"[{value}]" if old.startswith("[") else str(value)
        text = text[: line.start(2)] + new + text[line.end(2) :]
        if new != old:
            changes.append((label, old, new))
    return text, changes


def qwen2_config(size: Size) -> dict[str, Any]:
    """config.json of the Qwen2 body (the Qwen2-0.5B values, resized)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": size.llm_hidden,
        "initializer_range": 0.02,
        "intermediate_size": size.llm_ffn,
        "max_position_embeddings": 32768,
        "max_window_layers": size.llm_layers,
        "model_type": "qwen2",
        "num_attention_heads": size.llm_heads,
        "num_hidden_layers": size.llm_layers,
        "num_key_value_heads": size.llm_kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": TEXT_VOCAB,
    }


GENERATION_CONFIG = {"bos_token_id": 151643, "do_sample": False, "eos_token_id": 151643, "max_new_tokens": 2048}


class PoolBank:
    """Random pools, one per power-of-two scale, from which large tensors are cut as strided views."""

    def __init__(self, rng: np.random.RandomState) -> None:
        import torch

        self._torch = torch
        self.rng = rng
        self.pools: dict[int, Any] = {}

    def _pool(self, exponent: int) -> Any:
        if exponent not in self.pools:
            values = self.rng.standard_normal(POOL_NUMEL) * 2.0**exponent
            self.pools[exponent] = self._torch.from_numpy(values.astype(np.float32))
        return self.pools[exponent]

    def view(self, shape: tuple[int, ...], std: float) -> Any:
        """A [shape] view of the pool nearest to `std` (rows are windows at a random offset and stride)."""
        pool = self._pool(round(math.log2(std)))
        rows, row = shape[0], math.prod(shape[1:])
        if rows == 1 or rows * row <= POOL_NUMEL // 2:
            offset = int(self.rng.randint(0, POOL_NUMEL - rows * row + 1))
            return pool[offset : offset + rows * row].view(shape)
        widest = (POOL_NUMEL - row) // (rows - 1)
        stride = int(self.rng.randint(max(1, widest // 2), widest + 1))
        offset = int(self.rng.randint(0, POOL_NUMEL - (rows - 1) * stride - row + 1))
        strides = (stride, *_contiguous_strides(shape[1:]))
        return pool.as_strided(shape, strides, offset)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for dim in reversed(shape):
        out.append(step)
        step *= dim
    return tuple(reversed(out))


def embedding_view(rng: np.random.RandomState, shape: tuple[int, int], std: float) -> Any:
    """A [rows, dim] table whose row i is the window [2 i, 2 i + dim) of its own pool (Qwen2's 151,936-row table)."""
    import torch

    rows, dim = shape
    pool = torch.from_numpy((rng.standard_normal((rows - 1) * EMBEDDING_ROW_STRIDE + dim) * std).astype(np.float32))
    return pool.as_strided(shape, (EMBEDDING_ROW_STRIDE, 1), 0)


def random_state_dict(
    template: dict[str, Any], rng: np.random.RandomState, shared: dict[str, str] | None = None
) -> dict[str, Any]:
    """New values for every tensor of `template` (a module's default-init state dict) with the same scale.

    Large tensors: pooled views at the scale of their default init. Constant tensors (norm weights 1, biases 0,
    Snake alphas 1) get 0.1 * U(-1, 1) around their constant, so a re-implementation that drops one is caught.
    Other small tensors: N(mean, std) of their default init. `shared` maps a key to an earlier key it is tied to.
    """
    import torch

    bank, out = PoolBank(rng), {}
    for key, value in template.items():
        if shared and key in shared:
            out[key] = out[shared[key]]
            continue
        flat = value.detach().double()
        if not bool(flat.isfinite().all()) or float(flat.abs().max()) > 1e3:
            raise ValueError(f"{key}: its default init looks uninitialized (max |x| {float(flat.abs().max()):.3g})")
        std, mean = (flat.std().item() if flat.numel() > 1 else 0.0), flat.mean().item()
        if value.shape[0] >= 100_000:
            out[key] = embedding_view(rng, tuple(value.shape), std)
        elif value.numel() >= POOLED_MIN_NUMEL and std > 0:
            out[key] = bank.view(tuple(value.shape), std)
        elif std == 0:
            out[key] = torch.from_numpy((mean + 0.1 * rng.uniform(-1, 1, tuple(value.shape))).astype(np.float32))
        else:
            out[key] = torch.from_numpy((mean + std * rng.standard_normal(tuple(value.shape))).astype(np.float32))
    return out


def tied_keys(module: Any) -> dict[str, str]:
    """Key -> the first key holding the same parameter (Qwen2's lm_head is its embedding when tie_word_embeddings)."""
    seen: dict[int, str] = {}
    tied = {}
    for key, value in module.state_dict(keep_vars=True).items():
        ident = id(value)
        if ident in seen:
            tied[key] = seen[ident]
        else:
            seen[ident] = key
    return tied


def describe(state: dict[str, Any]) -> dict[str, list[Any]]:
    """key -> [shape, dtype] (the shapes.json format)."""
    return {key: [list(value.shape), str(value.dtype).removeprefix("torch.")] for key, value in state.items()}


def param_counts(state: dict[str, Any], tied: dict[str, str]) -> dict[str, Any]:
    """Total and per-top-level-module parameter counts (tied tensors counted once)."""
    by_module: dict[str, int] = {}
    for key, value in state.items():
        if key not in tied:
            top = key.split(".")[0]
            by_module[top] = by_module.get(top, 0) + value.numel()
    return {"total": sum(by_module.values()), "by_top_level_module": by_module}


def write_json(path: Path, payload: object) -> None:
    path.write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
