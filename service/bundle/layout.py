"""Bundle layout: file names, graph groups and twin suffixes every bundle shares, and graph-name templates.

A family's own layout (its graphs with their inputs and outputs, its prompt models, its other files) is a FamilyLayout
(service/bundle/family.py) that the family defines in its contract module (service/families/<name>/contract.py).
"""

from __future__ import annotations

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SPEAKERS_NAME = "speakers.json"
# What a manifest without a `family` key is: written before every manifest named its family (CosyVoice-300M exports).
LEGACY_FAMILY = "cosyvoice1"
GROUP_CORE = "core"
# The optional "prompt" group: the official prompt-analysis models, copied verbatim from the checkpoint directory
# (CAM++ speaker embedding, an S3 speech tokenizer), whose names, files, inputs and outputs the family's layout lists.
GROUP_PROMPT = "prompt"
# The optional "float" group: twins of core graphs that a quantized bundle computes in int8, computing in floating
# point instead, for runtimes that compute in bf16 (OpenVINO). A twin is named `<core name>_float`, has the core
# graph's inputs and outputs, and keeps its weights compressed (precision "int8-weights": int8 MatMul weights behind
# DequantizeLinear, other weights float16 behind Cast; export/quantize.py float_twin).
GROUP_FLOAT = "float"
FLOAT_SUFFIX = "_float"
# The optional "native" group: twins of core graphs of a quantized bundle in which some nodes are kernels of ours
# (domain NATIVE_DOMAIN) that ONNX Runtime runs from service/engine/native. A twin is named `<core name>_native`, has
# the core graph's inputs (then any of its kernels' own: a step's decode_spread; an estimator twin's caches may be
# int8, each with its scales as one more input, CACHE_SCALE_SUFFIX), outputs and precision (bf16 for an fp32 graph
# whose kernels take bf16 products); export/native_twin.py writes it.
GROUP_NATIVE = "native"
NATIVE_SUFFIX = "_native"
NATIVE_DOMAIN = "cosyvoice_lite"
# A twin's estimator may read its key/value caches in int8 (the engine's int8 frames as kept): each such cache input
# `past_k_3` is int8 (B, C, H, DK) and its scales (B, C, H) float32 are the input `past_k_3_scale`.
CACHE_SCALE_SUFFIX = "_scale"
# Core graphs any family's bundle may give a native twin, beside the family's own (FamilyLayout.native_graphs): the
# vocoder, whose convolutions take bf16 products (export/native_twin.py SHARED_REWRITES).
SHARED_NATIVE_GRAPHS: tuple[str, ...] = ("hift_decode",)


def expand_io_names(names: tuple[str, ...], num_layers: int, counts: dict[str, int] | None = None) -> list[str]:
    """Expand `{i}` templates into per-layer names, grouped by template (all past_k, then past_v, ...).

    `counts` gives the number of names for other one-letter templates (CosyVoice2: `{e}`, `{u}`, `{b}`).
    """
    sizes = {"i": num_layers, **(counts or {})}
    out: list[str] = []
    for name in names:
        key = next((k for k in sizes if "{" + k + "}" in name), None)
        if key is None:
            out.append(name)
        else:
            out.extend(name.replace("{" + key + "}", str(n)) for n in range(sizes[key]))
    return out
