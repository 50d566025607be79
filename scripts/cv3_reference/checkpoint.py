"""A random-weight Fun-CosyVoice3 checkpoint in the official layout: the official yaml with a few sizes shrunk.

The weights are drawn by `cv2_reference.checkpoint.random_state_dict` (numpy RandomState, pooled strided views for
large tensors), exactly as for the CosyVoice2 checkpoint; only the yaml and the sizes differ.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

OFFICIAL_YAML = "examples/libritts/cosyvoice3/conf/cosyvoice3.yaml"
YAML_NAME = "cosyvoice3.yaml"
BLANK = "CosyVoice-BlankEN"


@dataclass(frozen=True)
class Size:
    """The yaml and Qwen2 sizes a checkpoint size changes (every other value is the official one).

    The `llm_*` fields have the names `cv2_reference.checkpoint.qwen2_config` reads, so the Qwen2 config.json is
    written by the same function as CosyVoice2's.
    """

    llm_hidden: int
    llm_layers: int
    llm_heads: int
    llm_kv_heads: int
    llm_ffn: int
    lookahead_channels: int
    dit_dim: int
    dit_depth: int
    dit_heads: int
    dit_head_dim: int
    hift_channels: int


FULL = Size(896, 24, 14, 2, 4864, 1024, 1024, 22, 16, 64, 512)
SIZES = {
    # dit_dim stays a multiple of 16: CausalConvPositionEmbedding's convolutions have 16 groups (DiT/modules.py:115-127).
    "tiny": Size(32, 2, 4, 2, 64, 64, 64, 2, 4, 16, 64),
    "medium": Size(128, 4, 8, 2, 384, 256, 256, 4, 8, 32, 128),
    "full": FULL,
}
LOOKAHEAD = "pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer"
DIT = "estimator: !new:cosyvoice.flow.DiT.dit.DiT"
HIFT = "hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator"
# (label, anchor line, key, field of Size): the first `key:` line after the anchor takes the field's value.
YAML_EDITS = [
    ("llm_input_size", "# fixed params", "llm_input_size", "llm_hidden"),
    ("llm_output_size", "# fixed params", "llm_output_size", "llm_hidden"),
    ("flow.pre_lookahead_layer.channels", LOOKAHEAD, "channels", "lookahead_channels"),
    ("flow.decoder.estimator.dim", DIT, "dim", "dit_dim"),
    ("flow.decoder.estimator.depth", DIT, "depth", "dit_depth"),
    ("flow.decoder.estimator.heads", DIT, "heads", "dit_heads"),
    ("flow.decoder.estimator.dim_head", DIT, "dim_head", "dit_head_dim"),
    ("hift.base_channels", HIFT, "base_channels", "hift_channels"),
    ("hift.f0_predictor.cond_channels", HIFT, "cond_channels", "hift_channels"),
]


def resized_yaml(official: str, size: Size) -> tuple[str, list[tuple[str, str, str]]]:
    """The official cosyvoice3.yaml with the sizes of `size`; also the (key, official value, new value) changes."""
    text, changes = official, []
    for label, anchor, key, field in YAML_EDITS:
        line = re.compile(rf"^([ \t]*{key}: )([^#\n]*)", re.M).search(text, text.index(anchor))
        if line is None:
            raise ValueError(f"{key} not found after {anchor!r} in the official yaml")
        old = line.group(2).strip()
        new = str(getattr(size, field))
        text = text[: line.start(2)] + new + text[line.end(2) :]
        if new != old:
            changes.append((label, old, new))
    return text, changes
