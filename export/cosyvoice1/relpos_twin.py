"""CosyVoice-300M's step twin: each decoder layer of the int8 `llm_step` as one `cosyvoice_lite.RelPosLayer` node
(service/families/cosyvoice1/native/relpos_layer.h), after its int8 products became Int8MatMul nodes (export/fuse_ops.py).

Our exporter writes a layer (export/modules/transformer.py RelPosLayer.step) as: LayerNorm; q, k, v products; the
content scores Concat(q_u · past_kᵀ, q_u · kᵀ) and the positional ones GatherElements(q_v · posᵀ, the step's distance
index), summed, divided by sqrt(head size), plus the step's mask; Softmax; the value products over the cache and the
new positions; the out product and its residual; LayerNorm; w_1, ReLU, w_2 and the residual. The layer is found from
its Softmax by that structure (the step graph's node names carry no layer number), and the node reads `past_len` and
the layer's `pos_i` itself in place of the shared index and mask, which nothing reads any more.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from export.fuse_layers import layer_norm_pattern
from export.fuse_ops import add_spread_input, fuse_int8_matmuls
from export.native_twin import PRODUCTS
from export.twin_graph import INT8_OP_NAME, RELPOS_OP_NAME, Graph, RewriteError, attr, replace_nodes
from service.bundle import NATIVE_DOMAIN, Manifest

PAST_LEN_INPUT = "past_len"
POS_INPUT_PREFIX = "pos_"  # the step's per-layer projected positions pos_0 .. pos_{NL-1}
LAYER_PRODUCTS = 6  # q, k, v, out, w_1, w_2


@dataclass
class _Attention:
    """What a layer's attention reads: the q product, its positional biases, the k and v products, the float16 caches,
    the layer's positions, the score scale, and the tensors of the new keys and values (B, H, T, DK)."""

    q: onnx.NodeProto
    bias_u: str
    bias_v: str
    k: onnx.NodeProto
    v: onnx.NodeProto
    past_k: str
    past_v: str
    pos: str
    scale: float
    k_new: str
    v_new: str
    merged: str  # the (B, T, H*DK) attention output the out product reads


def _source(g: Graph, tensor: str) -> str:
    """The initializer behind a chain of Identity nodes (the exporter's aliases of a shared initializer)."""
    while (node := g.producer.get(tensor)) is not None and node.op_type == "Identity":
        tensor = node.input[0]
    return tensor


def _one(g: Graph, tensor: str, op_type: str) -> onnx.NodeProto:
    """The one node of `op_type` reading `tensor` (others may read its shape)."""
    users = [n for n in g.consumers.get(tensor, []) if n.op_type == op_type]
    if len(users) != 1:
        raise RewriteError(f"{tensor!r} feeds {len(users)} {op_type} nodes, expected one")
    return users[0]


def _product(g: Graph, heads: str) -> onnx.NodeProto:
    """The Int8MatMul behind a per-head view: Reshape(product) -> Transpose."""
    return g.made_by(g.made_by(g.made_by(heads, "Transpose").input[0], "Reshape").input[0], INT8_OP_NAME)


def _half_cache(g: Graph, view: str, inputs: set[str]) -> str:
    """The float16 graph input behind Cast(input) (-> Transpose) that a score or value product reads."""
    node = g.producer.get(view)
    if node is not None and node.op_type == "Transpose":
        view = node.input[0]
    cache = g.made_by(view, "Cast").input[0]
    if cache not in inputs:
        raise RewriteError(f"{view!r}: not a cast of a float16 cache input")
    return cache


def _heads_view(g: Graph, product: onnx.NodeProto) -> str:
    """The (B, H, T, DK) view of a product: Transpose(perm 0,2,1,3) of Reshape(product)."""
    reshape = _one(g, product.output[0], "Reshape")
    views = [n for n in g.consumers.get(reshape.output[0], []) if n.op_type == "Transpose" and attr(n, "perm") == [0, 2, 1, 3]]
    if len(views) != 1:
        raise RewriteError(f"{product.name}: expected one (B, H, T, DK) view of its output")
    return views[0].output[0]


def _scores(g: Graph, softmax: onnx.NodeProto, inputs: set[str]) -> tuple[list[onnx.NodeProto], list[str], float]:
    """([q product, k product], [pos_bias_u, pos_bias_v, past_k, pos], scale) from Softmax(Div(Concat(q_u · past_kᵀ,
    q_u · kᵀ) + GatherElements(q_v · posᵀ), sqrt dk) + mask)."""
    divided, _mask = g.made_by_either(g.made_by(softmax.input[0], "Add"), "Div")
    gathered, content = g.made_by_either(g.made_by(divided.input[0], "Add"), "GatherElements")
    past_scores, new_scores = (g.made_by(name, "MatMul") for name in g.made_by(content, "Concat").input)
    q_heads, bias_u = g.made_by_either(g.made_by(past_scores.input[0], "Add"), "Transpose")
    positional = g.made_by(gathered.input[0], "MatMul")
    v_heads, bias_v = g.made_by_either(g.made_by(positional.input[0], "Add"), "Transpose")
    if v_heads is not q_heads or new_scores.input[0] != past_scores.input[0]:
        raise RewriteError(f"{softmax.name}: the scores do not read one query with its two positional biases")
    pos = g.made_by(positional.input[1], "Transpose").input[0]
    if pos not in inputs:
        raise RewriteError(f"{softmax.name}: the positional scores do not read a graph input")
    scale = 1.0 / float(np.asarray(g.constant(divided.input[1])).reshape(-1)[0])
    past_k = _half_cache(g, past_scores.input[1], inputs)
    products = [_product(g, q_heads.output[0]), _product(g, new_scores.input[1])]
    return products, [_source(g, bias_u), _source(g, bias_v), past_k, pos], scale


def _attention(g: Graph, softmax: onnx.NodeProto, inputs: set[str]) -> _Attention:
    """The attention around `softmax` (RewriteError where it is not the exporter's)."""
    (q, k), (bias_u, bias_v, past_k, pos), scale = _scores(g, softmax, inputs)
    products = [g.only_consumer(s.output[0], "MatMul") for s in g.consumers.get(softmax.output[0], [])]
    if len(products) != 2 or products[0].input[1] == products[1].input[1]:
        raise RewriteError(f"{softmax.name}: expected a value product over the cache and one over the new positions")
    new_product = next((p for p in products if g.producer.get(p.input[1], onnx.NodeProto()).op_type == "Transpose"), None)
    past_product = next((p for p in products if p is not new_product), None)
    if new_product is None or past_product is None:
        raise RewriteError(f"{softmax.name}: no value product over the new positions")
    past_v = _half_cache(g, past_product.input[1], inputs)
    v = _product(g, new_product.input[1])
    total = g.only_consumer(past_product.output[0], "Add")
    merged = _one(g, g.only_consumer(total.output[0], "Transpose").output[0], "Reshape").output[0]
    k_new, v_new = _heads_view(g, k), _heads_view(g, v)
    if v_new != new_product.input[1]:
        raise RewriteError(f"{softmax.name}: the values are not the (B, H, T, DK) view of the v product")
    return _Attention(q, bias_u, bias_v, k, v, past_k, past_v, pos, scale, k_new, v_new, merged)


def _norm_inputs(g: Graph, output: str) -> tuple[str, str, str, float]:
    """(input, weight, bias, epsilon) of the LayerNorm making `output`, its weight and bias as initializer names."""
    _, x, _, _, eps = layer_norm_pattern(g, output)
    shifted = g.made_by(output, "Add")
    scaled, bias = g.made_by_either(shifted, "Mul")
    _, weight = g.made_by_either(scaled, "Div")
    return x, _source(g, weight), _source(g, bias), eps


def _weights(node: onnx.NodeProto) -> list[str]:
    """An Int8MatMul's weight inputs (packed, colsum, scale, bias): every product of the layer has a bias."""
    if node.op_type != INT8_OP_NAME or len(node.input) != 5 or not node.input[4]:
        raise RewriteError(f"{node.name}: expected an {INT8_OP_NAME} with a bias")
    return list(node.input[1:])


def _layer(g: Graph, softmax: onnx.NodeProto, inputs: set[str], index: int) -> onnx.NodeProto:
    """The RelPosLayer node replacing the decoder layer around `softmax`."""
    a = _attention(g, softmax, inputs)
    x, ln1_w, ln1_b, eps1 = _norm_inputs(g, a.q.input[0])
    if a.k.input[0] != a.q.input[0] or a.v.input[0] != a.q.input[0]:
        raise RewriteError(f"{softmax.name}: q, k and v are not products of one LayerNorm")
    out = g.only_consumer(a.merged, INT8_OP_NAME)
    residual1 = g.only_consumer(out.output[0], "Add")
    if g.other_input(residual1, out.output[0]) != x:
        raise RewriteError(f"{residual1.name}: not the attention's residual")
    h = residual1.output[0]
    ends = [n for n in g.consumers.get(h, []) if n.op_type == "Add"]
    if len(ends) != 1:
        raise RewriteError(f"{h!r}: expected one residual Add after the feed-forward")
    ff2 = g.made_by(g.other_input(ends[0], h), INT8_OP_NAME)
    ff1 = g.made_by(g.made_by(ff2.input[0], "Relu").input[0], INT8_OP_NAME)  # the kernel's activation: ReLU
    h_in, ln2_w, ln2_b, eps2 = _norm_inputs(g, ff1.input[0])
    if h_in != h:
        raise RewriteError(f"{ff1.name}: the feed-forward does not read the attention's residual")
    head_dim = int(np.asarray(g.constant(a.bias_u)).shape[-1])
    if not np.isclose(a.scale, head_dim**-0.5, rtol=1e-6):
        raise RewriteError(f"{softmax.name}: scores scaled by {a.scale}, not 1 / sqrt({head_dim})")
    inputs_of_node = [
        x, PAST_LEN_INPUT, a.past_k, a.past_v, a.pos, ln1_w, ln1_b, *_weights(a.q), *_weights(a.k), *_weights(a.v),
        a.bias_u, a.bias_v, *_weights(out), ln2_w, ln2_b, *_weights(ff1), *_weights(ff2),
    ]  # fmt: skip
    return helper.make_node(
        RELPOS_OP_NAME, inputs_of_node, [ends[0].output[0], a.k_new, a.v_new], name=f"relpos_layer_{index}",
        domain=NATIVE_DOMAIN, heads=int(attr(a.q, "n")) // head_dim, ff=int(attr(ff1, "n")), scale=a.scale,
        eps1=eps1, eps2=eps2,
    )  # fmt: skip


def fuse_relpos_layers(model: onnx.ModelProto) -> int:
    """Replace each decoder layer of a CosyVoice-300M LLM step (after fuse_int8_matmuls) by one RelPosLayer node (in
    place); returns how many. Its outputs keep the names of the layer's output and of its new keys and values (B, H, T,
    DK), which the graph goes on stacking into new_k and new_v. RewriteError when a layer does not match, or when an
    attention core is left after the rewrite (a layer's intermediate read elsewhere)."""
    graph = model.graph
    g = Graph(graph)
    inputs = {i.name for i in graph.input}
    if PAST_LEN_INPUT not in inputs:
        raise RewriteError(f"llm_step: no graph input {PAST_LEN_INPUT}")
    fused: dict[str, onnx.NodeProto] = {}
    for index, softmax in enumerate(n for n in graph.node if n.op_type == "Softmax"):
        node = _layer(g, softmax, inputs, index)
        fused[node.output[0]] = node
    if fused:
        replace_nodes(model, fused)
    left = [n.name for n in graph.node if n.op_type in ("Softmax", "GatherElements")]
    if left:
        raise RewriteError(f"llm_step: {left[0]} is still read after the layers were fused")
    return len(fused)


def rewrite_relpos_step(model: onnx.ModelProto, manifest: Manifest) -> tuple[int, str]:
    """The CosyVoice-300M step graph: its int8 products, then each decoder layer as one RelPosLayer (the input layer's
    and the decoder head's products stay Int8MatMul nodes), with the step's `decode_spread` input."""
    count = fuse_int8_matmuls(model)
    if count == 0:  # a 4-bit step: nothing of ours to run
        return 0, PRODUCTS
    layers = fuse_relpos_layers(model)
    halved = halve_positions(model)
    add_spread_input(model)
    beside = count - LAYER_PRODUCTS * layers
    return count, (
        f"{PRODUCTS}; decoder layers as {NATIVE_DOMAIN}.{RELPOS_OP_NAME} ({layers}), {beside} product(s) beside; "
        f"{halved} position input(s) float16"
    )


def halve_positions(model: onnx.ModelProto) -> int:
    """Make each `pos_i` graph input float16 where only RelPosLayer nodes read it (after fuse_relpos_layers): a decode
    step reads a layer's projected position rows for every cached position, as many bytes as its float16 keys and
    values in float32, half of that in float16 (the engine builds its table in the input's type). Returns how many."""
    readers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(f"{node.domain}.{node.op_type}")
    ours = f"{NATIVE_DOMAIN}.{RELPOS_OP_NAME}"
    halved = 0
    for graph_input in model.graph.input:
        if graph_input.name.startswith(POS_INPUT_PREFIX) and readers.get(graph_input.name) == {ours}:
            graph_input.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
            halved += 1
    return halved
