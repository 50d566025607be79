"""The Qwen2 body of the Qwen2-based families' LLM, read from the checkpoint's CosyVoice-BlankEN/config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from export.config import ConfigError, need

QWEN_DIR = "CosyVoice-BlankEN"
QWEN_CONFIG = "config.json"


@dataclass(frozen=True)
class QwenConfig:
    """The Qwen2 body of the LLM (CosyVoice-BlankEN/config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float
    rms_norm_eps: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def read_qwen_config(path: Path) -> QwenConfig:
    """QwenConfig of a transformers Qwen2 config.json (ConfigError naming the file for anything else)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read the Qwen2 config: {e}") from e
    if data.get("model_type", "qwen2") != "qwen2":
        raise ConfigError(f"{path}: model_type {data.get('model_type')!r} is not qwen2")
    if data.get("rope_scaling"):
        raise ConfigError(f"{path}: rope_scaling {data['rope_scaling']!r} is not supported")
    where = str(path)
    heads = int(need(data, "num_attention_heads", where))
    return QwenConfig(
        vocab_size=int(need(data, "vocab_size", where)),
        hidden_size=int(need(data, "hidden_size", where)),
        intermediate_size=int(need(data, "intermediate_size", where)),
        num_layers=int(need(data, "num_hidden_layers", where)),
        num_heads=heads,
        num_kv_heads=int(data.get("num_key_value_heads", heads)),
        rope_theta=float(data.get("rope_theta", 10000.0)),
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
    )
