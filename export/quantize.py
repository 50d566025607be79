"""Dynamic INT8 weights for the LLM and flow-estimator MatMuls, written as a second bundle."""

from __future__ import annotations

import logging
import shutil
from dataclasses import replace
from pathlib import Path

from onnxruntime.quantization import QuantType, quantize_dynamic

from service.bundle import MANIFEST_NAME, Manifest, sha256_file

# Graphs whose weight MatMuls are quantized. HiFT, the flow encoder and the length regulator stay fp32:
# they are small or convolution-bound, and the vocoder is the most precision-sensitive stage.
INT8_GRAPHS = ("llm_encoder", "llm_step", "flow_estimator")


def quantize_graph(src: Path, dst: Path) -> None:
    """Per-tensor dynamic INT8 (u8 activations x s8 weights, VNNI) for MatMuls with constant weights."""
    logging.getLogger("root").setLevel(logging.ERROR)  # the quantizer logs a harmless pre-processing hint
    quantize_dynamic(
        str(src),
        str(dst),
        op_types_to_quantize=["MatMul"],
        weight_type=QuantType.QInt8,
        per_channel=False,
        extra_options={"MatMulConstBOnly": True},
    )


def write_int8_bundle(src_dir: Path, dst_dir: Path, manifest: Manifest) -> Manifest:
    """Copy the fp32 bundle in `src_dir` to `dst_dir`, quantizing INT8_GRAPHS; returns the new manifest."""
    dst_dir.mkdir(parents=True, exist_ok=False)
    graphs = dict(manifest.graphs)
    for name, entry in manifest.graphs.items():
        src, dst = src_dir / entry.file, dst_dir / entry.file
        if name in INT8_GRAPHS:
            quantize_graph(src, dst)
            graphs[name] = replace(entry, sha256=sha256_file(dst), precision="int8")
        else:
            shutil.copy2(src, dst)
    for name in manifest.files:
        shutil.copy2(src_dir / name, dst_dir / name)
    new = replace(manifest, graphs=graphs, precision="int8", model=manifest.model + "-int8")
    (dst_dir / MANIFEST_NAME).write_text(new.to_json(), encoding="utf-8")
    return new
