"""Rewrites of single operations into our nodes: an attention core over cached frames as CachedAttention, every int8
weight product as Int8MatMul over a packed weight, a causal convolution's im2col product as a windowed Int8MatMul, and
the decode step's `decode_spread` input (export/native_twin.py says what each twin is made of)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from export.twin_graph import (
    CONV_OP_NAME,
    INT8_OP_NAME,
    OP_NAME,
    QWEN2_OP_NAME,
    RELPOS_OP_NAME,
    Graph,
    RewriteError,
    attr,
    replace_nodes,
)
from service.bundle import NATIVE_DOMAIN

CHUNK_INPUT = "chunk"


def _heads_input(g: Graph, transposed: str) -> str:
    """The (B,T,H*DK) tensor behind a per-head view: Transpose(Reshape(x)) -> x."""
    return g.made_by(g.made_by(transposed, "Transpose").input[0], "Reshape").input[0]


def _cache_input(g: Graph, transposed: str) -> str:
    """The float16 cache input behind Transpose(Cast(past))."""
    return g.made_by(g.made_by(transposed, "Transpose").input[0], "Cast").input[0]


def _attention_core(g: Graph, softmax: onnx.NodeProto) -> tuple[list[str], str, float]:
    """The inputs (q, k, v, past_k, past_v), output and score scale of the core around `softmax`."""
    masked = g.made_by(softmax.input[0], "Add")
    scaled = g.made_by(masked.input[0], "Mul")
    scores = g.made_by(scaled.input[0], "Concat")
    past_scores, new_scores = (g.made_by(name, "MatMul") for name in scores.input)
    q = _heads_input(g, past_scores.input[0])
    past_k = _cache_input(g, past_scores.input[1])
    k = _heads_input(g, new_scores.input[1])
    products = [g.only_consumer(s.output[0], "MatMul") for s in g.consumers.get(softmax.output[0], [])]
    if len(products) != 2:
        raise RewriteError(f"{softmax.name}: expected two value products after the softmax")
    from_cache = [p for p in products if _reads_cache(g, p.input[1])]
    if len(from_cache) != 1:
        raise RewriteError(f"{softmax.name}: expected one value product over the cache and one over the new frames")
    past_product = from_cache[0]
    new_product = next(p for p in products if p is not past_product)
    past_v = _cache_input(g, past_product.input[1])
    v = _heads_input(g, new_product.input[1])
    total = g.only_consumer(past_product.output[0], "Add")
    merged = g.only_consumer(g.only_consumer(total.output[0], "Transpose").output[0], "Reshape")
    scale = float(np.asarray(g.constant(scaled.input[1])).reshape(-1)[0])
    return [q, k, v, past_k, past_v], merged.output[0], scale


def _reads_cache(g: Graph, tensor: str) -> bool:
    """Whether `tensor` is Transpose(Cast(a graph input)): a per-head view of a float16 cache."""
    transpose = g.producer.get(tensor)
    cast = g.producer.get(transpose.input[0]) if transpose is not None and transpose.op_type == "Transpose" else None
    return cast is not None and cast.op_type == "Cast" and cast.input[0] not in g.producer


def fuse_attention(model: onnx.ModelProto) -> int:
    """Replace every attention core of the estimator graph in `model` by one CachedAttention node (in place) and drop
    the nodes nothing reads any more; returns how many cores were replaced. RewriteError when a core does not match."""
    graph = model.graph
    g = Graph(graph)
    caches = {i.name: i for i in graph.input}
    fused: dict[str, onnx.NodeProto] = {}  # a core's output tensor -> the node that now makes it
    for softmax in [n for n in graph.node if n.op_type == "Softmax"]:
        inputs, output, scale = _attention_core(g, softmax)
        if inputs[3] not in caches:
            raise RewriteError(f"{inputs[3]!r} is not a graph input")
        dims = caches[inputs[3]].type.tensor_type.shape.dim
        heads, head_dim = dims[2].dim_value, dims[3].dim_value
        if heads < 1 or head_dim < 1 or not np.isclose(scale, head_dim**-0.5, rtol=1e-6):
            raise RewriteError(f"{inputs[3]}: heads {heads}, head dim {head_dim}, score scale {scale}")
        fused[output] = helper.make_node(
            OP_NAME, [*inputs, CHUNK_INPUT], [output], name=f"attention_{inputs[3]}", domain=NATIVE_DOMAIN,
            heads=heads, scale=scale,
        )  # fmt: skip
    replace_nodes(model, fused)
    return len(fused)


PANEL = 64  # output columns per packed panel (service/engine/native/int8_matmul.h)


def pack_int8_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(packed, colsum) of an int8 (K, N) weight in the layout of int8_matmul.h: panels of 64 columns, each a run of
    ceil(K/4) groups of 64 columns x 4 rows; zero padding; colsum int32 over the padded columns."""
    k, n = w.shape
    kq, panels = -(-k // 4), -(-n // PANEL)
    padded = np.zeros((kq * 4, panels * PANEL), np.int8)
    padded[:k, :n] = w
    packed = padded.reshape(kq, 4, panels, PANEL).transpose(2, 0, 3, 1)
    return np.ascontiguousarray(packed), padded.astype(np.int32).sum(axis=0, dtype=np.int32)


def fuse_int8_matmuls(model: onnx.ModelProto) -> int:
    """Replace every int8 weight product of `model` (DynamicQuantizeLinear -> MatMulInteger with a constant int8
    weight and zero point 0 -> Cast -> Mul by the two scales, and the bias Add after it when it adds a constant of
    the output width) by one Int8MatMul node over the packed weight (in place); returns how many. RewriteError when
    a product does not match."""
    graph = model.graph
    g = Graph(graph)
    fused: dict[str, onnx.NodeProto] = {}
    new_inits: list[onnx.TensorProto] = []
    for node in [n for n in graph.node if n.op_type == "MatMulInteger"]:
        xq, weight, xzp, wzp = [*node.input, "", ""][:4]  # zero points are optional inputs
        quant = g.made_by(xq, "DynamicQuantizeLinear")
        if xzp != quant.output[2] or weight not in g.initializers or wzp not in g.initializers:
            raise RewriteError(f"{node.name}: not a dynamically quantized product with a constant weight")
        w = numpy_helper.to_array(g.initializers[weight])
        if w.dtype != np.int8 or w.ndim != 2 or np.any(numpy_helper.to_array(g.initializers[wzp]) != 0):
            raise RewriteError(f"{node.name}: the weight is not int8 (K, N) with zero point 0")
        cast = g.only_consumer(node.output[0], "Cast")
        scaled = g.only_consumer(cast.output[0], "Mul")
        scales = g.made_by(scaled.input[1] if scaled.input[0] == cast.output[0] else scaled.input[0], "Mul")
        if quant.output[1] not in scales.input:
            raise RewriteError(f"{node.name}: the output scale is not the activation's scale times the weight's")
        w_scale = np.asarray(g.constant(next(i for i in scales.input if i != quant.output[1])), np.float32)
        if w_scale.size != 1:
            raise RewriteError(f"{node.name}: the weight has {w_scale.size} scales, the kernel takes one")
        output, bias = scaled.output[0], None
        users = g.consumers.get(output, [])
        if len(users) == 1 and users[0].op_type == "Add":
            other = next((i for i in users[0].input if i != output), None)
            if other is not None and _constant_shape(g, other) == (w.shape[1],):
                output, bias = users[0].output[0], other
        packed, colsum = pack_int8_weight(w)
        base = f"{weight}_int8mm"
        new_inits += [
            numpy_helper.from_array(packed, f"{base}_packed"),
            numpy_helper.from_array(colsum, f"{base}_colsum"),
            numpy_helper.from_array(w_scale.reshape(1), f"{base}_scale"),
        ]
        inputs = [quant.input[0], f"{base}_packed", f"{base}_colsum", f"{base}_scale"] + ([bias] if bias else [])
        fused[output] = helper.make_node(
            INT8_OP_NAME, inputs, [output], name=f"int8mm_{weight}", domain=NATIVE_DOMAIN, n=int(w.shape[1])
        )
    graph.initializer.extend(new_inits)
    replace_nodes(model, fused)
    return len(fused)


def _constant_shape(g: Graph, tensor: str) -> tuple[int, ...] | None:
    """The shape of `tensor` when it is an initializer, or the exporter's Identity alias of one (its deduplicated
    copies of equal weights), else None."""
    alias = g.producer.get(tensor)
    if alias is not None and alias.op_type == "Identity":
        tensor = alias.input[0]
    return tuple(g.initializers[tensor].dims) if tensor in g.initializers else None


def _window_slice(g: Graph, tensor: str) -> tuple[str, int, int] | None:
    """(source, start, end) of `tensor` when it is a step-1 Slice along axis 1 (time) with constant bounds, else None."""
    node = g.producer.get(tensor)
    if node is None or node.op_type != "Slice" or len(node.input) < 4:
        return None
    try:
        starts, ends, axes = (g.constant(node.input[i]).reshape(-1) for i in (1, 2, 3))
        steps = g.constant(node.input[4]).reshape(-1) if len(node.input) > 4 and node.input[4] else np.ones(1)
    except RewriteError:
        return None
    if starts.size != 1 or ends.size != 1 or axes.size != 1 or int(axes[0]) != 1 or int(steps.reshape(-1)[0]) != 1:
        return None
    return node.input[0], int(starts[0]), int(ends[0])


def fuse_conv_windows(model: onnx.ModelProto) -> int:
    """Let each Int8MatMul that multiplies an im2col built from slices read the frames instead (in place); returns
    how many. Our exporter writes a width-W causal convolution over a (B, T, C) time-major signal `a` as Concat(axis 2,
    Slice(a, i : i - W + 1 along time) for i < W), the last slice to the end: row m is frames m .. m + W - 1 side by
    side, which is where those frames already lie in `a`. The Int8MatMul takes `a` with window=W (int8_matmul.h's
    x_stride) and the copies go; its rows and their quantization are the same, so is the result, bit for bit."""
    graph = model.graph
    g = Graph(graph)
    fused: dict[str, onnx.NodeProto] = {}
    for node in [n for n in graph.node if n.op_type == INT8_OP_NAME and n.domain == NATIVE_DOMAIN]:
        concat = g.producer.get(node.input[0])
        if concat is None or concat.op_type != "Concat" or attr(concat, "axis") not in (2, -1) or len(concat.input) < 2:
            continue
        found = [w for w in (_window_slice(g, name) for name in concat.input) if w is not None]
        if len(found) != len(concat.input):
            continue
        width = len(found)
        sources = {source for source, _, _ in found}
        bounds = [(start, end) for _, start, end in found]
        to_the_end = bounds[-1][1] >= np.iinfo(np.int64).max // 2  # the last slice runs to the signal's end
        expected = [(i, i - width + 1) for i in range(width - 1)]
        if len(sources) != 1 or bounds[:-1] != expected or bounds[-1][0] != width - 1 or not to_the_end:
            continue
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        fused[node.output[0]] = helper.make_node(
            INT8_OP_NAME, [sources.pop(), *node.input[1:]], list(node.output), name=node.name, domain=NATIVE_DOMAIN,
            **attributes, window=width,
        )  # fmt: skip
    replace_nodes(model, fused)
    return len(fused)


def unpack_int8_weight(packed: np.ndarray, k: int, n: int) -> np.ndarray:
    """The int8 (K, N) weight of a packed one (pack_int8_weight's inverse)."""
    panels, kq = packed.shape[:2]
    return np.ascontiguousarray(packed.transpose(1, 3, 0, 2).reshape(kq * 4, panels * PANEL)[:k, :n])


SPREAD_INPUT = "decode_spread"  # service.engine.native.SPREAD_INPUT
SPREAD_SLOT = {INT8_OP_NAME: 5, QWEN2_OP_NAME: 32, RELPOS_OP_NAME: 35}  # the optional input each operator reads it as


def add_spread_input(model: onnx.ModelProto) -> int:
    """Let every Int8MatMul, Qwen2Layer and RelPosLayer node of a step read SPREAD_INPUT, a graph input backed by an
    initializer of value 1 (overridable per run, so callers that never feed it run as before); returns how many nodes
    read it."""
    graph = model.graph
    nodes = [n for n in graph.node if n.domain == NATIVE_DOMAIN and n.op_type in SPREAD_SLOT]
    for node in nodes:
        slot = SPREAD_SLOT[node.op_type]
        inputs = [*node.input, *[""] * (slot - len(node.input))][:slot]  # an absent bias stays absent
        del node.input[:]
        node.input.extend([*inputs, SPREAD_INPUT])
    if nodes:
        graph.initializer.append(numpy_helper.from_array(np.array([1], np.int64), SPREAD_INPUT))
        graph.input.append(helper.make_tensor_value_info(SPREAD_INPUT, onnx.TensorProto.INT64, [1]))
    return len(nodes)


def bf16_bits(w: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint32 holding 16), to nearest, ties to even, as cvl_bf16_of (conv1d.c)."""
    u = np.ascontiguousarray(w, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)
    nan = np.isnan(w)
    return np.where(nan, (u >> 16).astype(np.uint32) | 0x40, rounded)


def pack_bf16_conv_weight(w: np.ndarray) -> np.ndarray:
    """A Conv weight (C_out, C_in, taps) as BF16Conv1d reads it (conv1d.h): (taps, ceil(C_in / 2), C_out) int32 of
    bf16 pairs, channel 2p in the low half, a zero channel after an odd count."""
    c_out, c_in, taps = w.shape
    padded = np.zeros((c_out, 2 * (-(-c_in // 2)), taps), np.float32)
    padded[:, :c_in] = w
    bits = bf16_bits(padded)  # (C_out, 2P, taps)
    pairs = bits[:, 0::2] | (bits[:, 1::2] << 16)  # (C_out, P, taps)
    return np.ascontiguousarray(pairs.transpose(2, 1, 0)).view(np.int32)


def _snake(g: Graph, tensor: str) -> tuple[str, np.ndarray, np.ndarray] | None:
    """(x, alpha, inv_alpha) when `tensor` is a Snake activation of x as our exporter writes HiFT's (x + Mul(Reciprocal
    (a) * c, Pow(Sin(x * alpha), 2)), every factor a per-channel constant) and nothing else reads it; else None."""
    add = g.producer.get(tensor)
    if add is None or add.op_type != "Add" or len(g.consumers.get(tensor, [])) != 1:
        return None
    for x in add.input:
        try:
            scaled = g.made_by(g.other_input(add, x), "Mul")
            power = g.made_by_either(scaled, "Pow")[0]
            inv = g.other_input(scaled, power.output[0])
            sin = g.made_by(power.input[0], "Sin")
            inner = g.made_by(sin.input[0], "Mul")
            if x not in inner.input or not np.array_equal(g.constant(power.input[1]), np.float32(2)):
                continue
            alpha = np.asarray(g.constant(g.other_input(inner, x)), np.float32).reshape(-1)
            recip, c = g.made_by_either(g.made_by(inv, "Mul"), "Reciprocal")
            inverse = (np.float32(1) / np.asarray(g.constant(recip.input[0]), np.float32)) * np.asarray(g.constant(c), np.float32)
        except RewriteError:
            continue
        return x, alpha, np.ascontiguousarray(inverse, np.float32).reshape(-1)
    return None


def _evaluated(g: Graph, tensor: str) -> np.ndarray | None:
    """The value of `tensor` when only constants feed it (e.g. the pads F.pad's export computes with Reshape, Slice,
    Concat...): its producers run by ONNX's reference evaluator; None when a graph input reaches it."""
    from onnx.reference import ReferenceEvaluator

    if tensor in g.initializers:
        return numpy_helper.to_array(g.initializers[tensor])
    needed: list[onnx.NodeProto] = []
    stack, seen = [tensor], set()
    while stack:
        name = stack.pop()
        if name in seen or not name or name in g.initializers:
            continue
        seen.add(name)
        node = g.producer.get(name)
        if node is None:
            return None  # a graph input
        needed.append(node)
        stack += list(node.input)
    order = {id(n): i for i, n in enumerate(g.graph.node)}
    nodes = sorted({id(n): n for n in needed}.values(), key=lambda n: order[id(n)])
    inits = [g.initializers[i] for n in nodes for i in n.input if i in g.initializers]
    sub = helper.make_graph(
        nodes, "constant", [], [helper.make_tensor_value_info(tensor, onnx.TensorProto.UNDEFINED, None)], inits
    )
    model = helper.make_model(sub, opset_imports=[helper.make_opsetid("", 13)])
    return np.asarray(ReferenceEvaluator(model).run(None, {})[0])


def _time_pad(g: Graph, tensor: str) -> tuple[str, int, int] | None:
    """(x, left, right) when `tensor` is a constant zero Pad of x (B, C, T) along time alone that nothing else reads."""
    pad = g.producer.get(tensor)
    if (
        pad is None
        or pad.op_type != "Pad"
        or len(g.consumers.get(tensor, [])) != 1
        or attr(pad, "mode") not in (None, b"constant")
    ):
        return None
    if len(pad.input) > 2 and pad.input[2]:
        value = _evaluated(g, pad.input[2])
        if value is None or np.any(value != 0):
            return None
    pads = _evaluated(g, pad.input[1])
    if pads is None or pads.shape != (6,) or np.any(pads[[0, 1, 3, 4]] != 0) or np.any(pads < 0):
        return None
    return pad.input[0], int(pads[2]), int(pads[5])


def fuse_bf16_convs(model: onnx.ModelProto) -> int:
    """Replace every one-dimensional Conv of `model` with a constant weight and stride 1 (one group, or groups of an
    even count of input channels: a channel pair never spans two) by a BF16Conv1d node over its packed weight (in
    place; strided convolutions stay), taking along a zero Pad along time before it (_time_pad) and the Snake
    activation before that when the convolution alone reads one (_snake); returns how many."""
    graph = model.graph
    g = Graph(graph)
    fused: dict[str, onnx.NodeProto] = {}
    new_inits: list[onnx.TensorProto] = []
    for node in [n for n in graph.node if n.op_type == "Conv"]:
        weight = node.input[1]
        groups = int(attr(node, "group") or 1)  # type: ignore[call-overload]
        if weight not in g.initializers or attr(node, "auto_pad") not in (None, b"NOTSET"):
            continue
        w = numpy_helper.to_array(g.initializers[weight])
        strides = attr(node, "strides") or [1]
        pads = attr(node, "pads") or [0, 0]
        dilations = attr(node, "dilations") or [1]
        if w.ndim != 3 or w.dtype != np.float32 or list(strides) != [1]:  # type: ignore[call-overload]
            continue
        if groups > 1 and w.shape[1] % 2:  # a channel pair would span two groups
            continue
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else ""
        base = f"{weight}_bf16conv"
        new_inits.append(numpy_helper.from_array(pack_bf16_conv_weight(w), f"{base}_packed"))
        left, right = (int(v) for v in pads)  # type: ignore[attr-defined]
        source = node.input[0]
        padded = _time_pad(g, source)  # a causal convolution's explicit Pad (CosyVoice3's HiFT) joins its pads
        if padded is not None:
            source, left, right = padded[0], left + padded[1], right + padded[2]
        inputs = [source, f"{base}_packed", bias] if bias else [source, f"{base}_packed"]
        snake = _snake(g, source)
        if snake is not None and snake[1].size == w.shape[1] * groups == snake[2].size:
            new_inits.append(numpy_helper.from_array(snake[1], f"{base}_alpha"))
            new_inits.append(numpy_helper.from_array(snake[2], f"{base}_inv_alpha"))
            inputs = [snake[0], f"{base}_packed", bias, f"{base}_alpha", f"{base}_inv_alpha"]
        fused[node.output[0]] = helper.make_node(
            CONV_OP_NAME, inputs, [node.output[0]],
            name=f"bf16conv_{node.name or weight}", domain=NATIVE_DOMAIN,
            dilation=int(dilations[0]), pad_left=left, pad_right=right,  # type: ignore[index]
            **({"group": groups} if groups > 1 else {}),
        )  # fmt: skip
    graph.initializer.extend(new_inits)
    replace_nodes(model, fused)
    return len(fused)
