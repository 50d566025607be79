"""Bundle layouts: file names, graph inputs and outputs, graph groups, and each family's layout."""

from __future__ import annotations

from dataclasses import dataclass

from service.errors import BundleError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SPEAKERS_NAME = "speakers.json"
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

# The optional "prompt" group: the official prompt-analysis models, copied verbatim from the checkpoint directory
# (CAM++ speaker embedding, S3 speech tokenizer v1). Graph name -> (file name, input names, output names).
PROMPT_GRAPHS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "campplus": ("campplus.onnx", ("input",), ("output",)),
    "speech_tokenizer": ("speech_tokenizer_v1.onnx", ("feats", "feats_length"), ("indices",)),
}
PROMPT_GRAPH_NAMES: tuple[str, ...] = tuple(PROMPT_GRAPHS)
GROUP_CORE = "core"
GROUP_PROMPT = "prompt"
# The optional "float" group: twins of core graphs that a quantized bundle computes in int8, computing in floating
# point instead, for runtimes that compute in bf16 (OpenVINO). A twin is named `<core name>_float`, has the core
# graph's inputs and outputs, and keeps its weights compressed (precision "int8-weights": int8 MatMul weights behind
# DequantizeLinear, other weights float16 behind Cast; export/quantize.py float_twin).
GROUP_FLOAT = "float"
FLOAT_SUFFIX = "_float"
# The optional "native" group: twins of core graphs of a quantized bundle in which some nodes are kernels of ours
# (domain NATIVE_DOMAIN) that ONNX Runtime runs from service/engine/native: in the CosyVoice2 flow estimator each
# attention core (score and value products over the cached frames, chunk mask, softmax) is one
# `cosyvoice_lite.CachedAttention` (bf16 products, float32 sums); in the LLM step each int8 weight product (dynamic
# quantization, MatMulInteger, scales, bias) is one `cosyvoice_lite.Int8MatMul` over the weight packed in the order
# the kernel reads it. A twin is named `<core name>_native`, has the core graph's inputs, outputs and precision;
# export/native_twin.py writes it.
GROUP_NATIVE = "native"
NATIVE_SUFFIX = "_native"
NATIVE_DOMAIN = "cosyvoice_lite"
NATIVE_GRAPHS = ("flow_estimator", "llm_step")

FAMILY_V1 = "cosyvoice1"  # CosyVoice-300M (-SFT, -Instruct); a manifest without `family` is one
FAMILY_V2 = "cosyvoice2"  # CosyVoice2-0.5B
V2_TOKENIZER_NAME = "tokenizer.json"  # the Qwen2 byte-level BPE with CosyVoice's special tokens (`tokenizers` format)
V2_NOISE_NAME = "flow_noise.npy"  # the flow's fixed noise buffer (80, 15000) float32 (official rand_noise)
# CosyVoice2 graphs. Templates: `{i}` one name per LLM layer, `{e}` per token-rate encoder block, `{u}` per
# up-sampled encoder block, `{b}` per estimator transformer block (counts in manifest.cosyvoice2 / constants).
V2_GRAPH_IO: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llm_prompt": (("text_ids",), ("x",)),
    "llm_embed": (("token",), ("x",)),
    "llm_step": (("x", "past_len", "past_k_{i}", "past_v_{i}"), ("logp", "new_k", "new_v")),
    "flow_speaker": (("embedding",), ("spks",)),
    "flow_encoder": (
        ("tokens", "context", "chunk", "look_ahead", "up_tail", "enc_k_{e}", "enc_v_{e}", "up_k_{u}", "up_v_{u}"),
        ("h", "look_ahead_out", "up_tail_out", "enc_new_k", "enc_new_v", "up_new_k", "up_new_v"),
    ),
    "flow_estimator": (
        ("x", "mu", "t", "spks", "cond", "chunk", "tails", "past_k_{b}", "past_v_{b}"),
        ("v", "tails_out", "new_k", "new_v"),
    ),
    "hift_f0": GRAPH_IO["hift_f0"],
    "hift_source": GRAPH_IO["hift_source"],
    "hift_decode": GRAPH_IO["hift_decode"],
}
# CosyVoice2 prompt models: the same CAM++ and a 25 Hz speech tokenizer (inputs feats, feats_length; output indices).
V2_PROMPT_GRAPHS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "campplus": PROMPT_GRAPHS["campplus"],
    "speech_tokenizer": ("speech_tokenizer_v2.onnx", ("feats", "feats_length"), ("indices",)),
}


@dataclass(frozen=True)
class FamilyLayout:
    """What a bundle of one model family holds: its core graphs, prompt models and other required files."""

    graph_io: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]
    prompt_graphs: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]]
    tokenizer: str
    required_files: tuple[str, ...]


FAMILIES: dict[str, FamilyLayout] = {
    FAMILY_V1: FamilyLayout(GRAPH_IO, PROMPT_GRAPHS, TOKENIZER_NAME, (SPEAKERS_NAME, TOKENIZER_NAME)),
    FAMILY_V2: FamilyLayout(V2_GRAPH_IO, V2_PROMPT_GRAPHS, V2_TOKENIZER_NAME, (SPEAKERS_NAME, V2_TOKENIZER_NAME, V2_NOISE_NAME)),
}


def family_layout(family: str) -> FamilyLayout:
    """The layout of a known family; BundleError naming the known ones otherwise."""
    if family not in FAMILIES:
        raise BundleError(f"manifest family {family!r} is not known (known: {', '.join(FAMILIES)})")
    return FAMILIES[family]


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
