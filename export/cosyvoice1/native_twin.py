"""CosyVoice-300M's estimator twin: each transformer block of its flow estimator as one cosyvoice_lite.EstimatorBlock.

The v1 estimator (export/modules/estimator.py, ConditionalDecoder) is not chunk-causal: every transformer block attends
over all frames of the call, with an additive key bias built from the `mask` input (padding). Its blocks are otherwise
the CosyVoice2 estimator's (LayerNorm, q/k/v, attention, out, LayerNorm, GELU feed-forward, residuals), so the fused
kernel runs them with no cache (`cached` = 0: an empty float16 cache made once per call from the batch size) and an
attention chunk no call reaches (FULL_ATTENTION_CHUNK: every frame sees every frame, cached_attention.h). The bias is
dropped: the twin attends over every frame, which is what the core graph computes where `mask` is all ones, and the
engine never pads (the rows of one call have equal lengths: cosyvoice1/flow.py feeds a mask of ones). The ResNet
blocks keep reading `mask`; their stride-1 convolutions become BF16Conv1d nodes (bf16 products, float32 sums: the
vocoder's kernel), which took a call at 200 frames from 184 to 164 ms on one Zen 4 thread (docs/perf-log.md).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from export.fuse_layers import fuse_blocks
from export.fuse_ops import fuse_bf16_convs, fuse_int8_matmuls
from export.fuse_resnet import fuse_norm_mish
from export.native_twin import PRODUCTS
from export.twin_graph import BLOCK_OP_NAME, CONV_OP_NAME, NORM_MISH_OP_NAME, OP_NAME, Graph, RewriteError, attr, replace_nodes
from service.bundle import NATIVE_DOMAIN, Manifest

FULL_ATTENTION_CHUNK = int(np.iinfo(np.int64).max)  # an attention chunk no call reaches: full attention
CHUNK_NAME = "full_attention_chunk"
MASK_INPUT, X_INPUT = "mask", "x"  # the estimator's padding mask and its (B, 80, M) input (export/cosyvoice1/graphs/flow.py)
# What the padding bias may be built of on its way from `mask` (1 - mask, times -1e10, every other frame, unsqueezed).
_BIAS_OPS = frozenset({"Sub", "Mul", "Unsqueeze", "Slice", "Cast", "Identity", "Constant"})


def _heads(g: Graph, tensor: str, perm: list[int]) -> tuple[str, onnx.NodeProto]:
    """The (B, M, H*DK) input behind Transpose(perm, Reshape(x, (B, M, H, DK))) and that Reshape."""
    transpose = g.made_by(tensor, "Transpose")
    if attr(transpose, "perm") != perm:
        raise RewriteError(f"{transpose.name}: perm {attr(transpose, 'perm')}, expected {perm}")
    reshape = g.made_by(transpose.input[0], "Reshape")
    return reshape.input[0], reshape


def _head_shape(g: Graph, reshape: onnx.NodeProto) -> tuple[int, int]:
    """(heads, head dim) of a per-head Reshape whose shape is Concat(batch, frames, H, DK)."""
    shape = g.made_by(reshape.input[1], "Concat")
    if len(shape.input) != 4:
        raise RewriteError(f"{reshape.name}: not a (B, M, H, DK) view")
    heads, head_dim = (int(np.asarray(g.constant(name)).reshape(-1)[0]) for name in shape.input[2:])
    return heads, head_dim


def _check_padding_bias(g: Graph, bias: str) -> None:
    """RewriteError unless `bias` is made from the `mask` input alone (the padding bias, zero where mask is 1)."""
    stack, seen, reaches_mask = [bias], set(), False
    while stack:
        name = stack.pop()
        if name in seen or not name:
            continue
        seen.add(name)
        node = g.producer.get(name)
        if node is None:
            reaches_mask |= name == MASK_INPUT
            if name != MASK_INPUT and name not in g.initializers:
                raise RewriteError(f"{bias!r}: the attention bias reads the graph input {name!r}, not only {MASK_INPUT!r}")
            continue
        if node.op_type not in _BIAS_OPS:
            raise RewriteError(f"{bias!r}: the attention bias is not the padding bias ({node.op_type} {node.name})")
        stack.extend(node.input)
    if not reaches_mask:
        raise RewriteError(f"{bias!r}: the attention bias does not come from {MASK_INPUT!r}")


def _full_attention_core(g: Graph, softmax: onnx.NodeProto) -> tuple[list[str], str, float, tuple[int, int]]:
    """The (q, k, v) inputs, output, score scale and (heads, head dim) of the core around `softmax`:
    Reshape(Transpose(Softmax(scale * q·kᵀ + bias) · v)) with q, k, v per-head views of their products."""
    masked = g.made_by(softmax.input[0], "Add")
    scaled, bias = g.made_by_either(masked, "Mul")
    scores, scale_name = g.made_by_either(scaled, "MatMul")
    q, q_view = _heads(g, scores.input[0], [0, 2, 1, 3])
    k, _ = _heads(g, scores.input[1], [0, 2, 3, 1])
    product = g.only_consumer(softmax.output[0], "MatMul")
    if product.input[0] != softmax.output[0]:
        raise RewriteError(f"{product.name}: the probabilities are not its left operand")
    v, _ = _heads(g, product.input[1], [0, 2, 1, 3])
    back = g.only_consumer(product.output[0], "Transpose")
    if attr(back, "perm") != [0, 2, 1, 3]:
        raise RewriteError(f"{back.name}: the heads are not merged back time-first")
    merged = g.only_consumer(back.output[0], "Reshape")
    _check_padding_bias(g, bias)
    heads, head_dim = _head_shape(g, q_view)
    scale = float(np.asarray(g.constant(scale_name)).reshape(-1)[0])
    if heads < 1 or head_dim < 1 or not np.isclose(scale, head_dim**-0.5, rtol=1e-6):
        raise RewriteError(f"{softmax.name}: heads {heads}, head dim {head_dim}, score scale {scale}")
    return [q, k, v], merged.output[0], scale, (heads, head_dim)


def _empty_cache(graph: onnx.GraphProto, heads: int, head_dim: int) -> tuple[str, list[onnx.NodeProto]]:
    """A float16 (B, 0, heads, head_dim) tensor (B: the batch of the graph's `x`) and the nodes that make it."""
    name = f"no_past_{heads}x{head_dim}"
    graph.initializer.extend([
        numpy_helper.from_array(np.array([0], np.int64), f"{name}_from"),
        numpy_helper.from_array(np.array([1], np.int64), f"{name}_to"),
        numpy_helper.from_array(np.array([0, heads, head_dim], np.int64), f"{name}_rest"),
    ])  # fmt: skip
    zero = numpy_helper.from_array(np.zeros(1, np.float16))
    nodes = [
        helper.make_node("Shape", [X_INPUT], [f"{name}_x_shape"], name=f"{name}_x_shape"),
        helper.make_node("Slice", [f"{name}_x_shape", f"{name}_from", f"{name}_to"], [f"{name}_batch"], name=f"{name}_batch"),
        helper.make_node("Concat", [f"{name}_batch", f"{name}_rest"], [f"{name}_dims"], name=f"{name}_dims", axis=0),
        helper.make_node("ConstantOfShape", [f"{name}_dims"], [name], name=name, value=zero),
    ]
    return name, nodes


def fuse_full_attention(model: onnx.ModelProto) -> int:
    """Replace every attention core of a v1 estimator graph by one CachedAttention node with an empty cache and
    FULL_ATTENTION_CHUNK (in place); returns how many. RewriteError when a core, or its bias, does not match."""
    graph = model.graph
    if not {X_INPUT, MASK_INPUT} <= {i.name for i in graph.input}:
        raise RewriteError(f"the estimator has no inputs {X_INPUT!r} and {MASK_INPUT!r}")
    g = Graph(graph)
    fused: dict[str, onnx.NodeProto] = {}
    caches: dict[tuple[int, int], str] = {}
    made: list[onnx.NodeProto] = []
    for index, softmax in enumerate(n for n in graph.node if n.op_type == "Softmax"):
        (q, k, v), output, scale, shape = _full_attention_core(g, softmax)
        if shape not in caches:
            caches[shape], nodes = _empty_cache(graph, *shape)
            made += nodes
        past = caches[shape]
        fused[output] = helper.make_node(
            OP_NAME, [q, k, v, past, past, CHUNK_NAME], [output], name=f"full_attention_{index}", domain=NATIVE_DOMAIN,
            heads=shape[0], scale=scale,
        )  # fmt: skip
    if fused:
        graph.initializer.append(numpy_helper.from_array(np.array([FULL_ATTENTION_CHUNK], np.int64), CHUNK_NAME))
        nodes = [*made, *graph.node]  # the empty caches read only the graph input x: they go first
        del graph.node[:]
        graph.node.extend(nodes)
        replace_nodes(model, fused)
    return len(fused)


def rewrite_full_estimator(model: onnx.ModelProto, manifest: Manifest) -> tuple[int, str]:
    """The v1 estimator's twin: each attention core over the whole window, its int8 products, then each transformer
    block around an attention as one EstimatorBlock (RewriteError when they do not pair up); then each stride-1
    convolution of its ResNet blocks (float32 in the int8 graph: ONNX Runtime's dynamic quantization leaves Conv) as
    one BF16Conv1d, as the vocoder's (a fifth of a call's time in ONNX Runtime's float32 Conv; its downsampling stays);
    then each GroupNorm and Mish, with the mask and addend after them, as one NormMish (export/fuse_resnet.py)."""
    cores = fuse_full_attention(model)
    if cores == 0:
        raise RewriteError("the estimator has no attention core")
    count = fuse_int8_matmuls(model)
    fused = fuse_blocks(model)
    if fused != cores:
        raise RewriteError(f"fused {fused} transformer blocks around {cores} attention cores")
    convs = fuse_bf16_convs(model)
    norms = fuse_norm_mish(model, MASK_INPUT)
    what = f"transformer blocks as {NATIVE_DOMAIN}.{BLOCK_OP_NAME} over the whole window"
    what += f", {count - 6 * fused} more {PRODUCTS}, {convs} convolutions as {NATIVE_DOMAIN}.{CONV_OP_NAME}"
    return fused, what + f", {norms} ResNet norms with their Mish as {NATIVE_DOMAIN}.{NORM_MISH_OP_NAME}"
