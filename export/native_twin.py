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

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from export.onnx_io import ExportError
from service.bundle import GROUP_NATIVE, MANIFEST_NAME, NATIVE_DOMAIN, NATIVE_SUFFIX, Manifest, ModelBundle, sha256_file

OP_NAME = "CachedAttention"
CHUNK_INPUT = "chunk"


class RewriteError(ExportError):
    """The graph does not hold the attention cores our exporter writes (nothing was changed on disk)."""


class _Graph:
    """Producer and consumer lookups over a graph's nodes."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.producer = {out: node for node in graph.node for out in node.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.initializers = {init.name: init for init in graph.initializer}

    def made_by(self, tensor: str, op_type: str) -> onnx.NodeProto:
        node = self.producer.get(tensor)
        if node is None or node.op_type != op_type:
            found = "a graph input or initializer" if node is None else node.op_type
            raise RewriteError(f"{tensor!r} comes from {found}, expected {op_type}")
        return node

    def only_consumer(self, tensor: str, op_type: str) -> onnx.NodeProto:
        users = self.consumers.get(tensor, [])
        if len(users) != 1 or users[0].op_type != op_type:
            raise RewriteError(f"{tensor!r} feeds {[u.op_type for u in users]}, expected one {op_type}")
        return users[0]

    def constant(self, tensor: str) -> np.ndarray:
        if tensor in self.initializers:
            return numpy_helper.to_array(self.initializers[tensor])
        node = self.producer.get(tensor)
        if node is not None and node.op_type == "Identity":  # the exporter's alias of a shared initializer
            return self.constant(node.input[0])
        node = self.made_by(tensor, "Constant")
        return numpy_helper.to_array(node.attribute[0].t)

    def other_input(self, node: onnx.NodeProto, known: str) -> str:
        """The input of two-input `node` that is not `known`."""
        if len(node.input) != 2 or known not in node.input:
            raise RewriteError(f"{node.name}: expected two inputs, one of them {known!r}")
        return node.input[1] if node.input[0] == known else node.input[0]

    def made_by_either(self, node: onnx.NodeProto, op_type: str) -> tuple[onnx.NodeProto, str]:
        """The node of `op_type` making one of `node`'s two inputs, and the other input."""
        for name in node.input:
            maker = self.producer.get(name)
            if maker is not None and maker.op_type == op_type:
                return maker, self.other_input(node, name)
        raise RewriteError(f"{node.name}: no input comes from {op_type}")


def _heads_input(g: _Graph, transposed: str) -> str:
    """The (B,T,H*DK) tensor behind a per-head view: Transpose(Reshape(x)) -> x."""
    return g.made_by(g.made_by(transposed, "Transpose").input[0], "Reshape").input[0]


def _cache_input(g: _Graph, transposed: str) -> str:
    """The float16 cache input behind Transpose(Cast(past))."""
    return g.made_by(g.made_by(transposed, "Transpose").input[0], "Cast").input[0]


def _attention_core(g: _Graph, softmax: onnx.NodeProto) -> tuple[list[str], str, float]:
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


def _reads_cache(g: _Graph, tensor: str) -> bool:
    """Whether `tensor` is Transpose(Cast(a graph input)): a per-head view of a float16 cache."""
    transpose = g.producer.get(tensor)
    cast = g.producer.get(transpose.input[0]) if transpose is not None and transpose.op_type == "Transpose" else None
    return cast is not None and cast.op_type == "Cast" and cast.input[0] not in g.producer


def fuse_attention(model: onnx.ModelProto) -> int:
    """Replace every attention core of the estimator graph in `model` by one CachedAttention node (in place) and drop
    the nodes nothing reads any more; returns how many cores were replaced. RewriteError when a core does not match."""
    graph = model.graph
    g = _Graph(graph)
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
    _replace_nodes(model, fused)
    return len(fused)


INT8_OP_NAME = "Int8MatMul"
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
    g = _Graph(graph)
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
    _replace_nodes(model, fused)
    return len(fused)


def _constant_shape(g: _Graph, tensor: str) -> tuple[int, ...] | None:
    """The shape of `tensor` when it is an initializer, or the exporter's Identity alias of one (its deduplicated
    copies of equal weights), else None."""
    alias = g.producer.get(tensor)
    if alias is not None and alias.op_type == "Identity":
        tensor = alias.input[0]
    return tuple(g.initializers[tensor].dims) if tensor in g.initializers else None


def _window_slice(g: _Graph, tensor: str) -> tuple[str, int, int] | None:
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
    g = _Graph(graph)
    fused: dict[str, onnx.NodeProto] = {}
    for node in [n for n in graph.node if n.op_type == INT8_OP_NAME and n.domain == NATIVE_DOMAIN]:
        concat = g.producer.get(node.input[0])
        if concat is None or concat.op_type != "Concat" or _attr(concat, "axis") not in (2, -1) or len(concat.input) < 2:
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
    _replace_nodes(model, fused)
    return len(fused)


BLOCK_OP_NAME = "EstimatorBlock"
SQRT_HALF = 0.5**0.5


def unpack_int8_weight(packed: np.ndarray, k: int, n: int) -> np.ndarray:
    """The int8 (K, N) weight of a packed one (pack_int8_weight's inverse)."""
    panels, kq = packed.shape[:2]
    return np.ascontiguousarray(packed.transpose(1, 3, 0, 2).reshape(kq * 4, panels * PANEL)[:k, :n])


def _layer_norm(g: _Graph, output: str) -> tuple[list[onnx.NodeProto], str, np.ndarray, np.ndarray, float]:
    """(nodes, input, weight, bias, epsilon) of the LayerNorm pattern making `output` (opset 13 has no LayerNorm op):
    Add(Mul(Div(Sub(x, ReduceMean(x)), Sqrt(Add(ReduceMean(Pow(Sub, 2)), eps))), weight), bias), over the last axis."""
    shifted = g.made_by(output, "Add")
    scaled, bias = g.made_by_either(shifted, "Mul")
    div, weight = g.made_by_either(scaled, "Div")
    sub, sqrt = g.made_by(div.input[0], "Sub"), g.made_by(div.input[1], "Sqrt")
    add_eps = g.made_by(sqrt.input[0], "Add")
    var, eps = g.made_by_either(add_eps, "ReduceMean")
    power = g.made_by(var.input[0], "Pow")
    mean = g.made_by(sub.input[1], "ReduceMean")
    x = sub.input[0]
    if power.input[0] != sub.output[0] or float(g.constant(power.input[1])) != 2.0 or mean.input[0] != x:
        raise RewriteError(f"{output!r}: not a LayerNorm")
    for reduce in (mean, var):
        axes = next((list(a.ints) for a in reduce.attribute if a.name == "axes"), None)
        if axes != [-1]:
            raise RewriteError(f"{reduce.name}: a LayerNorm over axes {axes}, the kernel takes the last one")
    nodes = [mean, sub, power, var, add_eps, sqrt, div, scaled, shifted]
    w, b = (np.asarray(g.constant(t), np.float32).reshape(-1) for t in (weight, bias))
    return nodes, x, w, b, float(np.asarray(g.constant(eps)).reshape(-1)[0])


def _gelu(g: _Graph, output: str) -> tuple[list[onnx.NodeProto], str]:
    """(nodes, input) of exact GELU as torch exports it: Mul(Mul(x, Add(Erf(Div(x, sqrt 2)), 1)), 0.5)."""
    outer = g.made_by(output, "Mul")
    inner, half = g.made_by_either(outer, "Mul")
    plus, x = g.made_by_either(inner, "Add")
    erf, one = g.made_by_either(plus, "Erf")
    div = g.made_by(erf.input[0], "Div")
    ok = div.input[0] == x and np.isclose(float(g.constant(div.input[1])), 1 / SQRT_HALF, rtol=1e-6)
    if not ok or float(g.constant(one)) != 1.0 or float(g.constant(half)) != 0.5:
        raise RewriteError(f"{output!r}: not an exact GELU")
    return [div, erf, plus, inner, outer], x


def _int8_parts(g: _Graph, node: onnx.NodeProto, bias: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(int8 (K, N) weight, scale, bias) of an Int8MatMul node."""
    if node.op_type != INT8_OP_NAME or len(node.input) != (5 if bias else 4):
        raise RewriteError(f"{node.name}: expected an {INT8_OP_NAME} {'with' if bias else 'without'} a bias")
    n = next(a.i for a in node.attribute if a.name == "n")
    packed = g.constant(node.input[1])
    w = unpack_int8_weight(packed, packed.shape[1] * 4, n)  # K padded to a multiple of 4 with zero rows, as packed
    scale = np.asarray(g.constant(node.input[3]), np.float32).reshape(-1)
    return w, scale, np.asarray(g.constant(node.input[4]), np.float32).reshape(-1) if bias else None


def _packed_weight(part: str, w: np.ndarray, scale: np.ndarray, bias: np.ndarray | None) -> list[tuple[str, np.ndarray]]:
    """An EstimatorBlock weight's inputs: packed, colsum, scale(s) and, with one, the bias."""
    packed, colsum = pack_int8_weight(w)
    arrays = [(f"{part}_packed", packed), (f"{part}_colsum", colsum), (f"{part}_scale", scale)]
    return arrays if bias is None else [*arrays, (f"{part}_bias", bias)]


def fuse_blocks(model: onnx.ModelProto) -> int:
    """Replace each transformer block around a CachedAttention node (after fuse_attention and fuse_int8_matmuls) by
    one EstimatorBlock node (in place); returns how many. Its first output keeps the block output's name; in a graph
    with caches its float16 new keys and values, side by side, become the graph's new_k and new_v (_cache_output).
    RewriteError when a block or the stacks do not match."""
    graph = model.graph
    g = _Graph(graph)
    blocks: list[tuple[list[onnx.NodeProto], onnx.NodeProto]] = []
    inits: list[onnx.TensorProto] = []
    graph_outputs = {o.name for o in graph.output}
    new_kv: dict[str, str] = {}  # a block's k (v) product -> its float16 slice of new_k (new_v) from the fused node
    attentions = [n for n in graph.node if n.op_type == OP_NAME]
    readers = Counter(n.input[3] for n in attentions)  # a cache input per block, or one empty cache they all read
    for attention in attentions:
        q_mm, k_mm, v_mm = (g.made_by(t, INT8_OP_NAME) for t in attention.input[:3])
        h1 = q_mm.input[0]
        if k_mm.input[0] != h1 or v_mm.input[0] != h1:
            raise RewriteError(f"{attention.name}: q, k and v are not products of one input")
        ln1, x, ln1_w, ln1_b, eps1 = _layer_norm(g, h1)
        out_mm = g.only_consumer(attention.output[0], INT8_OP_NAME)
        residual1 = g.only_consumer(out_mm.output[0], "Add")
        if g.other_input(residual1, out_mm.output[0]) != x:
            raise RewriteError(f"{residual1.name}: not the attention's residual")
        h = residual1.output[0]
        ends = [n for n in g.consumers.get(h, []) if n.op_type == "Add"]
        if len(ends) != 1:
            raise RewriteError(f"{h!r}: expected one residual Add after the feed-forward")
        residual2 = ends[0]
        ff2_mm = g.made_by(g.other_input(residual2, h), INT8_OP_NAME)
        gelu, u = _gelu(g, ff2_mm.input[0])
        ff1_mm = g.made_by(u, INT8_OP_NAME)
        ln3, h_in, ln3_w, ln3_b, eps3 = _layer_norm(g, ff1_mm.input[0])
        if h_in != h:
            raise RewriteError(f"{ff1_mm.name}: the feed-forward does not read the attention's residual")
        nodes = [*ln1, q_mm, k_mm, v_mm, attention, out_mm, residual1, *ln3, ff1_mm, *gelu, ff2_mm, residual2]
        members = {id(n) for n in nodes}
        shared = {k_mm.output[0], v_mm.output[0], residual2.output[0]}  # k, v: checked with the stacks below
        for node in nodes:
            for out in node.output:
                outside = out in graph_outputs or any(id(c) not in members for c in g.consumers.get(out, []))
                if out not in shared and outside:
                    raise RewriteError(f"{out!r} of the block around {attention.name} is read outside it")
        (wq, sq, _), (wk, sk, _), (wv, sv, _) = (_int8_parts(g, mm, False) for mm in (q_mm, k_mm, v_mm))
        w_out, s_out, b_out = _int8_parts(g, out_mm, True)
        w_ff1, s_ff1, b_ff1 = _int8_parts(g, ff1_mm, True)
        w_ff2, s_ff2, b_ff2 = _int8_parts(g, ff2_mm, True)
        hd = wq.shape[1]
        scales = np.concatenate([np.repeat(sq, hd), np.repeat(sk, hd), np.repeat(sv, hd)]).astype(np.float32)
        if np.all(scales == scales[0]):
            scales = scales[:1]
        base = f"block_{attention.input[3] if readers[attention.input[3]] == 1 else attention.name}"
        arrays: list[tuple[str, np.ndarray]] = [
            ("ln1_w", ln1_w),
            ("ln1_b", ln1_b),
            *_packed_weight("qkv", np.concatenate([wq, wk, wv], axis=1), scales, None),
            *_packed_weight("out", w_out, s_out, b_out),
            ("ln3_w", ln3_w),
            ("ln3_b", ln3_b),
            *_packed_weight("ff1", w_ff1, s_ff1, b_ff1),
            *_packed_weight("ff2", w_ff2, s_ff2, b_ff2),
        ]  # the kernel's input order (ort_custom_op.c)
        inits += [numpy_helper.from_array(a, f"{base}_{name}") for name, a in arrays]
        heads = next(a.i for a in attention.attribute if a.name == "heads")
        scale_attr = next(a.f for a in attention.attribute if a.name == "scale")
        fused = helper.make_node(
            BLOCK_OP_NAME, [x, *attention.input[3:6], *(f"{base}_{name}" for name, _ in arrays)],
            [residual2.output[0], f"{base}_new_k", f"{base}_new_v"], name=base, domain=NATIVE_DOMAIN,
            heads=heads, scale=scale_attr, eps1=eps1, eps3=eps3,
        )  # fmt: skip
        blocks.append((nodes, fused))
        new_kv[k_mm.output[0]], new_kv[v_mm.output[0]] = fused.output[1], fused.output[2]
    cached = blocks and {"new_k", "new_v"} <= graph_outputs  # an estimator with caches (v1's attends without one)
    caches = [_cache_output(g, name, new_kv) for name in ("new_k", "new_v")] if cached else []
    graph.initializer.extend(inits)
    gone = {id(n) for nodes, _ in blocks for n in nodes}
    order = {id(n): i for i, n in enumerate(graph.node)}
    starts = {id(min(nodes, key=lambda n: order[id(n)])): fused for nodes, fused in blocks}
    ends = {id(cast): concat for cast, concat in caches}
    kept: list[onnx.NodeProto] = []
    for node in graph.node:
        if id(node) in starts:
            kept.append(starts[id(node)])  # where the block began: its inputs are all made by then
        if id(node) in ends:
            kept.append(ends[id(node)])  # the float16 slices side by side replace the cast of the float32 stack
        elif id(node) not in gone:
            kept.append(node)
    live = _live(kept, [o.name for o in graph.output])
    stray = sorted({name for node in live for name in node.input if name in new_kv})
    if stray:
        raise RewriteError(f"{stray[0]!r}: a block's keys/values are read elsewhere than in new_k/new_v")
    _install(graph, live)
    return len(blocks)


def _cache_output(g: _Graph, output: str, new_kv: dict[str, str]) -> tuple[onnx.NodeProto, onnx.NodeProto]:
    """(the Cast making the estimator's `output`, the Concat of the fused blocks' float16 slices to put there).

    Our exporter stacks each block's new keys as Cast(float16, Transpose(0,1,3,2,4, Concat(axis 0, Unsqueeze(0,
    Transpose(0,2,1,3, Reshape(k, (B,M,H,DK))))))): that is (NB,B,M,H,DK), each block's (B,M,H*DK) product in place, so
    the blocks' (1,B,M,H,DK) float16 outputs side by side are the same tensor."""
    cast = g.made_by(output, "Cast")
    outer = g.made_by(cast.input[0], "Transpose")
    stack = g.made_by(outer.input[0], "Concat")
    ok = _attr(cast, "to") == onnx.TensorProto.FLOAT16 and _attr(outer, "perm") == [0, 1, 3, 2, 4]
    if not ok or _attr(stack, "axis") != 0:
        raise RewriteError(f"{output!r}: not the float16 stack of the blocks' new keys/values the kernel writes")
    slices = []
    for name in stack.input:
        unsqueeze = g.made_by(name, "Unsqueeze")
        inner = g.made_by(unsqueeze.input[0], "Transpose")
        reshape = g.made_by(inner.input[0], "Reshape")
        if _attr(inner, "perm") != [0, 2, 1, 3] or [int(a) for a in g.constant(unsqueeze.input[1]).reshape(-1)] != [0]:
            raise RewriteError(f"{output!r}: {name!r} is not a block's keys/values in (B,H,M,DK)")
        if reshape.input[0] not in new_kv:
            raise RewriteError(f"{output!r}: {reshape.input[0]!r} is not a fused block's k or v product")
        slices.append(new_kv[reshape.input[0]])
    return cast, helper.make_node("Concat", slices, [output], name=f"{output}_stack", axis=0)


QWEN2_OP_NAME = "Qwen2Layer"


def fuse_qwen2_layers(model: onnx.ModelProto) -> int:
    """Replace each decoder layer of a CosyVoice2 LLM step (after fuse_int8_matmuls) by one Qwen2Layer node (in place);
    returns how many. The layer is found by the names our exporter gives its nodes (export/cosyvoice2/modules/llm.py:
    `/layers.{i}/...`): its input, RMSNorm weights and epsilon, the seven Int8MatMul products, the float16 caches (the
    inputs of their Casts), the shared mask and rotary tables, and its three outputs (y, the rotated new keys, the new
    values), whose names the node keeps. RewriteError when a piece is missing."""
    graph = model.graph
    g = _Graph(graph)
    by_name = {n.name: n for n in graph.node}
    products = {n.output[0]: n for n in graph.node if n.op_type == INT8_OP_NAME}
    rope: dict[str, str] = {}  # the rotary tables every layer reads: the step's one Cos and one Sin
    for op in ("Cos", "Sin"):
        makers = [n for n in graph.node if n.op_type == op]
        if len(makers) != 1:
            raise RewriteError(f"llm_step: expected one {op} node (the rotary table), found {len(makers)}")
        rope[op] = makers[0].output[0]
    fused: dict[str, onnx.NodeProto] = {}
    layer = 0
    while f"/layers.{layer}/Add_1" in by_name:
        prefix = f"/layers.{layer}/"

        def node(name: str, prefix: str = prefix) -> onnx.NodeProto:
            found = by_name.get(prefix + name)
            if found is None:
                raise RewriteError(f"llm_step: no node {prefix + name}")
            return found

        def product(output: str, bias: bool, prefix: str = prefix) -> list[str]:
            found = products.get(prefix + output)
            if found is None or len(found.input) != (5 if bias else 4):
                raise RewriteError(f"llm_step: {prefix + output} is not an {INT8_OP_NAME} {'with' if bias else 'without'} a bias")
            return list(found.input[1:])

        q = products.get(prefix + "self_attn/q_proj/Add_output_0")
        gate = products.get(prefix + "mlp/gate_proj/MatMul_output_0")
        if q is None or gate is None:
            raise RewriteError(f"llm_step: layer {layer} has no int8 q or gate product")
        past_k, past_v = f"past_k_{layer}", f"past_v_{layer}"
        head_dim = next((i.type.tensor_type.shape.dim[3].dim_value for i in graph.input if i.name == past_k), 0)
        if head_dim < 2:
            raise RewriteError(f"llm_step: no input {past_k} with a static head size")
        scores, mask = g.made_by_either(g.made_by(node("self_attn/Softmax").input[0], "Add"), "Unsqueeze")[::-1]
        scaled = g.made_by(scores, "Mul")
        constants = [
            name for name in scaled.input if name in g.initializers or g.producer[name].op_type in ("Constant", "Identity")
        ]
        if len(constants) != 1:
            raise RewriteError(f"llm_step: layer {layer}'s scores are not scaled by one constant")
        scale = g.constant(constants[0])
        inputs = [
            node("input_layernorm/Pow").input[0],
            past_k,
            past_v,
            mask.input[0],
            rope["Cos"],
            rope["Sin"],
            node("input_layernorm/Mul_1").input[0],
            *product("self_attn/q_proj/Add_output_0", True),
            *product("self_attn/k_proj/Add_output_0", True),
            *product("self_attn/v_proj/Add_output_0", True),
            *product("self_attn/o_proj/MatMul_output_0", False),
            node("post_attention_layernorm/Mul_1").input[0],
            *product("mlp/gate_proj/MatMul_output_0", False),
            *product("mlp/up_proj/MatMul_output_0", False),
            *product("mlp/down_proj/MatMul_output_0", False),
        ]
        # the new keys leave rotated: k_proj -> Reshape -> Transpose -> Mul(cos) -> Add(+ Mul(rotated halves, sin))
        k_heads = g.only_consumer(g.only_consumer(prefix + "self_attn/k_proj/Add_output_0", "Reshape").output[0], "Transpose")
        k_cos = [n for n in g.consumers.get(k_heads.output[0], []) if n.op_type == "Mul"]
        if len(k_cos) != 1:
            raise RewriteError(f"llm_step: layer {layer}'s keys are not rotated as the exporter writes it")
        k_new = g.only_consumer(k_cos[0].output[0], "Add").output[0]
        v_new = g.only_consumer(g.only_consumer(prefix + "self_attn/v_proj/Add_output_0", "Reshape").output[0], "Transpose")
        outputs = [node("Add_1").output[0], k_new, v_new.output[0]]
        fused[outputs[0]] = helper.make_node(
            QWEN2_OP_NAME, inputs, outputs, name=f"qwen2_layer_{layer}", domain=NATIVE_DOMAIN,
            heads=int(_attr(q, "n")) // head_dim, ff=int(_attr(gate, "n")),
            scale=float(scale),
            eps=float(g.constant(node("input_layernorm/Add").input[1])),
        )  # fmt: skip
        layer += 1
    if fused:
        _replace_nodes(model, fused)
    return len(fused)


RELPOS_OP_NAME = "RelPosLayer"  # a CosyVoice-300M decoder layer (export/cosyvoice1/relpos_twin.py)
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


def _attr(node: onnx.NodeProto, name: str) -> object:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


def _replace_nodes(model: onnx.ModelProto, fused: dict[str, onnx.NodeProto]) -> None:
    """Put each new node where the node making its output was, drop what nothing reads any more, keep the order
    topological (`_install`) and declare our domain."""
    graph = model.graph
    kept = [fused.get(n.output[0], n) if len(n.output) == 1 else n for n in graph.node]
    _install(graph, _live(kept, [o.name for o in graph.output]))
    if not any(op.domain == NATIVE_DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(NATIVE_DOMAIN, 1))


def _install(graph: onnx.GraphProto, live: list[onnx.NodeProto]) -> None:
    """Make `live` the graph's nodes, in its order except where a node reads what a later one makes (a fused node with
    several outputs stands where its last output was made, after nodes that read its first ones): such a node moves to
    just after its inputs exist. Drop the initializers none of them reads."""
    known = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    ordered: list[onnx.NodeProto] = []
    waiting: list[onnx.NodeProto] = []
    for node in live:
        if not all(name in known for name in node.input):
            waiting.append(node)
            continue
        ordered.append(node)
        known.update(node.output)
        while waiting and (ready := [n for n in waiting if all(name in known for name in n.input)]):
            for n in ready:
                ordered.append(n)
                known.update(n.output)
            moved = {id(n) for n in ready}
            waiting = [n for n in waiting if id(n) not in moved]
    if waiting:
        raise RewriteError(f"{waiting[0].name}: its inputs are never made (a cycle in the rewritten graph)")
    del graph.node[:]
    graph.node.extend(ordered)
    used = {name for node in ordered for name in node.input}
    keep_inits = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep_inits)


def _live(nodes: list[onnx.NodeProto], outputs: list[str]) -> list[onnx.NodeProto]:
    by_output = {out: node for node in nodes for out in node.output}
    seen: set[int] = set()
    stack = list(outputs)
    while stack:
        node = by_output.get(stack.pop())
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            stack.extend(name for name in node.input if name)
    return [n for n in nodes if id(n) in seen]


# Rewrites a graph into its native twin in place: (nodes replaced, what was done for the log); 0 leaves no twin.
Rewrite = Callable[[onnx.ModelProto, Manifest], tuple[int, str]]
PRODUCTS = f"int8 weight products as {NATIVE_DOMAIN}.{INT8_OP_NAME}"


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


def rewrite_cached_estimator(blocks: int) -> Rewrite:
    """The rewrite of a chunk-causal estimator with `blocks` transformer blocks that attend over cached frames: each
    attention core, its int8 products and then each whole block as one EstimatorBlock, convolution windows read in
    place (RewriteError when the blocks found are not `blocks`)."""

    def rewrite(model: onnx.ModelProto, manifest: Manifest) -> tuple[int, str]:
        cores = fuse_attention(model)
        if cores != blocks:
            raise RewriteError(f"rewrote {cores} attention cores, the estimator has {blocks}")
        count = fuse_int8_matmuls(model)
        fused = fuse_blocks(model)
        if fused != cores:
            raise RewriteError(f"fused {fused} transformer blocks around {cores} attention cores")
        windows = fuse_conv_windows(model)
        what = f"transformer blocks as {NATIVE_DOMAIN}.{BLOCK_OP_NAME}, {count - 6 * fused} more {PRODUCTS}"
        return cores, f"{what} ({windows} reading convolution windows in place)"

    return rewrite


def rewrite_attention_estimator(blocks: int) -> Rewrite:
    """The rewrite of a chunk-causal estimator whose blocks the fused EstimatorBlock does not cover (an AdaLN-modulated
    DiT with rotary q and k): each of its `blocks` attention cores over cached frames as one CachedAttention, every int8
    product as one Int8MatMul (RewriteError when the cores found are not `blocks`)."""

    def rewrite(model: onnx.ModelProto, manifest: Manifest) -> tuple[int, str]:
        cores = fuse_attention(model)
        if cores != blocks:
            raise RewriteError(f"rewrote {cores} attention cores, the estimator has {blocks}")
        count = fuse_int8_matmuls(model)
        return cores, f"attention cores as {NATIVE_DOMAIN}.{OP_NAME}, {count} {PRODUCTS}"

    return rewrite


def write_native_twin(bundle_dir: Path, rewrites: Mapping[str, Rewrite], log: Callable[[str], None] = print) -> tuple[str, ...]:
    """Add the native twins the quantized bundle in `bundle_dir` lacks (file and manifest entry), one per graph its
    family's `rewrites` name; returns the twins' graph names. An fp32 bundle takes none (the official computation stays
    exact), nor does a graph with nothing to rewrite (a 4-bit step). RewriteError when a graph does not match."""
    manifest = ModelBundle.load(bundle_dir).manifest
    if manifest.precision == "fp32":
        return ()
    graphs = dict(manifest.graphs)
    written: list[str] = []
    for name, rewrite in rewrites.items():
        if name not in graphs or name + NATIVE_SUFFIX in graphs or graphs[name].precision == "fp32":
            continue
        entry = graphs[name]
        model = onnx.load(str(bundle_dir / entry.file))
        try:
            count, what = rewrite(model, manifest)
        except RewriteError as e:
            raise RewriteError(f"{entry.file}: {e}") from e
        if count == 0:
            continue
        onnx.checker.check_model(model)
        twin = bundle_dir / f"{name}{NATIVE_SUFFIX}.onnx"
        onnx.save(model, str(twin))
        graphs[name + NATIVE_SUFFIX] = replace(entry, file=twin.name, sha256=sha256_file(twin), group=GROUP_NATIVE)
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
