"""Native twins (service.bundle GROUP_NATIVE): quantized graphs in which some nodes are kernels of ours
(service/engine/native), run by ONNX Runtime with our library loaded.

* The CosyVoice2 flow estimator: each attention core is one `cosyvoice_lite.CachedAttention` node. The rewrite matches
  the core our exporter emits for `CachedAttention.chunk_step` (export/cosyvoice2/modules/estimator.py): from the new
  frames' q, k, v projections and the float16 caches to the tensor fed to `to_out`; the scores, mask, softmax and
  value products in between become the node. Its int8 weight products become Int8MatMul nodes as below. Then each
  transformer block around an attention (LayerNorm, q/k/v, attention, out, residual, LayerNorm, feed-forward with
  GELU, residual) becomes one `cosyvoice_lite.EstimatorBlock` node whose q, k and v are one product. Each causal
  convolution's product reads its frames in place (Int8MatMul window=3) instead of the im2col copy our exporter
  builds from slices (fuse_conv_windows).
* The CosyVoice-300M flow estimator (export/cosyvoice1/native_twin.py): its blocks attend over the whole window; each
  becomes one EstimatorBlock with an empty cache and an attention chunk no call reaches (fuse_blocks as above).
* The Fun-CosyVoice3 DiT (export/cosyvoice3/dit_twin.py): attention cores and products as for CosyVoice2, then each
  AdaLN-modulated block with rotary q and k as one `cosyvoice_lite.DiTBlock` (the same kernel with its modulation);
  its grouped position convolutions (float32 in the int8 graph) as `cosyvoice_lite.BF16Conv1d` (the vocoder's kernel).
* Both chunk-causal estimators: what they compute from the time step alone, tabulated at the solver's step times
  behind an `If` that computes any other time (export/time_table.py; tabulate_step_times).
* The vocoder (every family's HiFT decode graph, float32 in every bundle): each stride-1 convolution as one
  `cosyvoice_lite.BF16Conv1d` over its weight in bf16 pairs (products in bf16, sums in float32: the precision OpenVINO
  gave it on bf16 CPUs, without a second runtime); its twin's manifest precision is "bf16".
* The LLM step (either family): each int8 weight product as ONNX Runtime's dynamic quantization writes it
  (DynamicQuantizeLinear, MatMulInteger, Cast, Mul by the scales, and the bias Add) is one `cosyvoice_lite.Int8MatMul`
  node over the same int8 weight, packed in the order the kernel reads it; then each decoder layer is one node
  (`Qwen2Layer`: fuse_qwen2_layers; CosyVoice-300M's `RelPosLayer`: export/cosyvoice1/relpos_twin.py). Every node of
  ours in the step also reads the graph input `decode_spread` (an initializer of value 1 a caller may override per
  run: how many tasks a decode step's products split into over the session's threads; add_spread_input).

`python -m export.add_twins BUNDLE` adds the twins a bundle exported before them lacks; the exporters write them
into every quantized bundle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import onnx

from export.external_data import externalize_graph, load_inline, weights_name
from export.fuse_layers import fuse_blocks, fuse_qwen2_layers
from export.fuse_ops import add_spread_input, fuse_attention, fuse_bf16_convs, fuse_conv_windows, fuse_int8_matmuls
from export.fuse_resnet import fuse_norm_mish
from export.time_table import tabulate_time_inputs
from export.twin_graph import BLOCK_OP_NAME, CONV_OP_NAME, INT8_OP_NAME, NORM_MISH_OP_NAME, QWEN2_OP_NAME, RewriteError
from service.bundle import (
    CACHE_SCALE_SUFFIX,
    GROUP_NATIVE,
    MANIFEST_NAME,
    NATIVE_DOMAIN,
    NATIVE_SUFFIX,
    Manifest,
    ModelBundle,
    sha256_file,
)
from service.bundle.layout import SHARED_NATIVE_GRAPHS
from service.bundle.solver import euler_times

# Rewrites a graph into its native twin in place: (nodes replaced, what was done for the log); 0 leaves no twin.
Rewrite = Callable[[onnx.ModelProto, Manifest], tuple[int, str]]
PRODUCTS = f"int8 weight products as {NATIVE_DOMAIN}.{INT8_OP_NAME}"
# Our kernels as `make native` builds them (service.engine.native.LIBRARY_PATH; export reads no engine module): a time
# table is computed with them.
NATIVE_LIBRARY = Path(__file__).resolve().parents[1] / "service" / "engine" / "native" / "libcosyvoice_lite_native.so"


def rewrite_int8_products(model: onnx.ModelProto, manifest: Manifest) -> tuple[int, str]:
    """Every int8 weight product of the graph as one Int8MatMul (an LLM step; a 4-bit step has none), with the step's
    `decode_spread` input."""
    count = fuse_int8_matmuls(model)
    add_spread_input(model)
    return count, PRODUCTS


def rewrite_qwen2_step(model: onnx.ModelProto, manifest: Manifest) -> tuple[int, str]:
    """A Qwen2 step graph: its int8 products, then each decoder layer as one Qwen2Layer."""
    count = fuse_int8_matmuls(model)
    if count == 0:  # a 4-bit step: nothing of ours to run
        return 0, PRODUCTS
    layers = fuse_qwen2_layers(model)
    add_spread_input(model)
    beside = count - 7 * layers
    return count, f"{PRODUCTS}; decoder layers as {NATIVE_DOMAIN}.{QWEN2_OP_NAME} ({layers}), {beside} product(s) beside"


def rewrite_bf16_convs(model: onnx.ModelProto, manifest: Manifest) -> tuple[int, str]:
    """A vocoder (HiFT's decode graph, every family): each stride-1 convolution as one BF16Conv1d over its weight in
    bf16 pairs (float32 sums); its transposed and strided convolutions stay."""
    return fuse_bf16_convs(model), f"convolutions as {NATIVE_DOMAIN}.{CONV_OP_NAME} (bf16 products)"


# The rewrites of service.bundle SHARED_NATIVE_GRAPHS (every family's, beside its own): float32 graphs of a quantized
# bundle, the vocoder, whose twin computes its products in bf16 (the twin's manifest precision).
SHARED_REWRITES: dict[str, Rewrite] = {"hift_decode": rewrite_bf16_convs}

BLOCK_PRODUCTS = 6  # a fused block's int8 products: q, k, v, out, ff1, ff2
BLOCK_INPUTS = 23  # an EstimatorBlock's inputs before the optional pair of int8 caches' scales


def rewrite_cached_estimator(
    blocks: int,
    fuse: Callable[[onnx.ModelProto], int] = fuse_blocks,
    op_name: str = BLOCK_OP_NAME,
    block_inputs: int = BLOCK_INPUTS,
) -> Rewrite:
    """The rewrite of a chunk-causal estimator with `blocks` transformer blocks that attend over cached frames: each
    attention core, its int8 products, then each whole block as one `op_name` node (`fuse`: fuse_blocks for the
    EstimatorBlock, or a family's own, e.g. the DiT's, whose nodes take `block_inputs` before the caches' scales),
    convolution windows read in place, the float32 convolutions left (the DiT's grouped position convolutions) as
    BF16Conv1d, each ResNet block's LayerNorm and Mish with the addend after them as NormMish, the caches read in int8
    (int8_block_caches) (RewriteError when the blocks found are not `blocks`)."""

    def rewrite(model: onnx.ModelProto, manifest: Manifest) -> tuple[int, str]:
        cores = fuse_attention(model)
        if cores != blocks:
            raise RewriteError(f"rewrote {cores} attention cores, the estimator has {blocks}")
        count = fuse_int8_matmuls(model)
        fused = fuse(model)
        if fused != cores:
            raise RewriteError(f"fused {fused} blocks around {cores} attention cores")
        windows = fuse_conv_windows(model)
        convs = fuse_bf16_convs(model)
        norms = fuse_norm_mish(model)
        tabulated = tabulate_step_times(model, manifest)
        int8 = int8_block_caches(model, op_name, block_inputs)
        what = f"blocks as {NATIVE_DOMAIN}.{op_name} ({int8} caches read in int8)"
        what += f", {count - BLOCK_PRODUCTS * fused} more {PRODUCTS}"
        what += f" ({windows} reading convolution windows in place)" if windows else ""
        what += f", {convs} convolutions as {NATIVE_DOMAIN}.{CONV_OP_NAME}" if convs else ""
        what += f", {norms} ResNet norms with their Mish as {NATIVE_DOMAIN}.{NORM_MISH_OP_NAME}" if norms else ""
        return cores, what + (f", {tabulated} tensors of the time step tabulated at the solver's times" if tabulated else "")

    return rewrite


def int8_block_caches(model: onnx.ModelProto, op_name: str, required: int) -> int:
    """Every float16 cache input (B, C, H, DK) that only `op_name` nodes read as their past_k or past_v (inputs 1 and 2
    of `required`, which their optional scales follow) becomes int8, with its scales (B, C, H) float32 as a new input
    `<name>_scale` that the nodes read too: the engine's int8 frames (service/layers/frame_cache.py) go to the kernel
    as they are kept, no float16 copy per call. Returns the caches retyped (0: the graph has none, e.g.
    CosyVoice-300M's blocks over an empty cache)."""
    graph = model.graph
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, i))
    retyped = 0
    for graph_input in list(graph.input):
        tensor = graph_input.type.tensor_type
        uses = readers.get(graph_input.name, [])
        if tensor.elem_type != onnx.TensorProto.FLOAT16 or len(tensor.shape.dim) != 4 or not uses:
            continue
        if not all(node.op_type == op_name and index in (1, 2) for node, index in uses):
            continue
        dims = [onnx.TensorShapeProto.Dimension() for _ in range(3)]
        for dim, source in zip(dims, tensor.shape.dim[:3], strict=True):
            dim.CopyFrom(source)
        tensor.elem_type = onnx.TensorProto.INT8
        scale = onnx.helper.make_tensor_value_info(graph_input.name + CACHE_SCALE_SUFFIX, onnx.TensorProto.FLOAT, None)
        scale.type.tensor_type.shape.dim.extend(dims)
        graph.input.append(scale)
        for node, index in uses:
            if len(node.input) < required:
                raise RewriteError(f"{node.name}: {len(node.input)} inputs, {op_name} takes {required}")
            while len(node.input) < required + 2:
                node.input.append("")
            node.input[required + index - 1] = scale.name
        retyped += 1
    for node in graph.node:  # a block reads both caches in one type: both int8 with their scales, or neither
        if node.op_type == op_name and len(node.input) > required and "" in node.input[required:]:
            raise RewriteError(f"{node.name}: one cache int8, the other not")
    return retyped


def tabulate_step_times(model: onnx.ModelProto, manifest: Manifest) -> int:
    """What an estimator twin computes from its time step alone, tabulated at the Euler solver's step times
    (export/time_table.py); none without our library to compute them (the twin then computes them every call)."""
    if not NATIVE_LIBRARY.is_file():
        return 0
    times, _ = euler_times(manifest.constants.n_timesteps)
    return tabulate_time_inputs(model, [float(t) for t in times], str(NATIVE_LIBRARY))


def write_native_twin(bundle_dir: Path, rewrites: Mapping[str, Rewrite], log: Callable[[str], None] = print) -> tuple[str, ...]:
    """Add the native twins the quantized bundle in `bundle_dir` lacks (file and manifest entry), one per graph its
    family's `rewrites` or SHARED_REWRITES name (a large twin's weights in a file of their own); returns the twins'
    graph names. An fp32 bundle takes none (the official computation stays exact), nor does a graph with nothing to
    rewrite (a 4-bit step). RewriteError when a graph does not match."""
    manifest = ModelBundle.load(bundle_dir).manifest
    if manifest.precision == "fp32":
        return ()
    graphs = dict(manifest.graphs)
    written: list[str] = []
    for name, rewrite in (SHARED_REWRITES | dict(rewrites)).items():
        if name not in graphs or name + NATIVE_SUFFIX in graphs:
            continue
        entry = graphs[name]
        if entry.precision == "fp32" and name not in SHARED_NATIVE_GRAPHS:
            continue
        model = load_inline(bundle_dir / entry.file)
        try:
            count, what = rewrite(model, manifest)
        except RewriteError as e:
            raise RewriteError(f"{entry.file}: {e}") from e
        if count == 0:
            continue
        onnx.checker.check_model(model)
        twin = bundle_dir / f"{name}{NATIVE_SUFFIX}.onnx"
        onnx.save(model, str(twin))
        weights = weights_name(twin.name) if externalize_graph(twin) else ""
        graphs[name + NATIVE_SUFFIX] = replace(
            entry, file=twin.name, sha256=sha256_file(twin), group=GROUP_NATIVE,
            inputs=tuple(i.name for i in model.graph.input),  # the core's, and an estimator's int8 caches' scales
            precision="bf16" if entry.precision == "fp32" else entry.precision,
            weights=weights, weights_sha256=sha256_file(bundle_dir / weights) if weights else "",
        )  # fmt: skip
        written.append(name + NATIVE_SUFFIX)
        log(f"native twin: {twin.name} ({count} {what})")
    if written:
        (bundle_dir / MANIFEST_NAME).write_text(replace(manifest, graphs=graphs).to_json(), encoding="utf-8")
    return tuple(written)


def drop_native_twins(bundle_dir: Path) -> None:
    """Remove the bundle's native twins (files and manifest entries)."""
    manifest = ModelBundle.load(bundle_dir).manifest
    twins = {name: g for name, g in manifest.graphs.items() if g.group == GROUP_NATIVE}
    graphs = {name: g for name, g in manifest.graphs.items() if name not in twins}
    (bundle_dir / MANIFEST_NAME).write_text(replace(manifest, graphs=graphs).to_json(), encoding="utf-8")
    for g in twins.values():
        (bundle_dir / g.file).unlink(missing_ok=True)
        if g.weights:
            (bundle_dir / g.weights).unlink(missing_ok=True)
