"""Fun-CosyVoice3's estimator twin: each DiT block of the int8 `flow_estimator` as one `cosyvoice_lite.DiTBlock` node
(service/families/cosyvoice3/native/dit_block_op.c: the kit's estimator block with its AdaLN-zero modulation), after
its attention cores became CachedAttention nodes and its int8 products Int8MatMul nodes (export/fuse_ops.py).

Our exporter writes a block (export/cosyvoice3/modules/dit.py DiTBlock.chunk_step) as: a LayerNorm without weights,
`* (1 + scale) + shift` from the block's AdaLN product; the q, k and v products (with biases); the first rotary-width
features of q and k turned in pairs by the call's one Cos and Sin tables; the attention over the cached frames; the
out product, `* gate` and the residual; the same modulated LayerNorm; ff1, GELU's tanh approximation, ff2, `* gate`
and the residual. The graph's node names carry no block number, so a block is found from its CachedAttention by that
structure; the node reads the modulation tensors the graph computes once per call (B, 1, D), and the rotary tables.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from export.fuse_layers import check_whole_block, int8_parts, packed_weight, qkv_scales, scaled_norm_pattern, splice_blocks
from export.twin_graph import INT8_OP_NAME, OP_NAME, Graph, RewriteError, attr
from service.bundle import NATIVE_DOMAIN

DIT_OP_NAME = "DiTBlock"
DIT_INPUTS = 28  # a DiTBlock's inputs before the optional pair of int8 caches' scales (dit_block_op.c)
GELU_OPS = frozenset({"Mul", "Add", "Pow", "Tanh"})  # GELU's tanh approximation as torch exports it at opset 13


def _region(g: Graph, end: str, start: str) -> list[onnx.NodeProto]:
    """The nodes on the way from tensor `start` to tensor `end` (those that make `end` or what it reads, and read
    `start` or what it makes), walked back from `end`."""
    depends: dict[str, bool] = {start: True}

    def reads_start(tensor: str) -> bool:
        if tensor not in depends:
            depends[tensor] = False  # cut cycles (there are none in a graph) and what never reaches it
            node = g.producer.get(tensor)
            depends[tensor] = node is not None and any(reads_start(i) for i in node.input if i)
        return depends[tensor]

    found: dict[int, onnx.NodeProto] = {}
    stack = [end]
    while stack:
        tensor = stack.pop()
        node = g.producer.get(tensor)
        if tensor == start or node is None or id(node) in found or not reads_start(tensor):
            continue
        found[id(node)] = node
        stack.extend(i for i in node.input if i)
    return list(found.values())


def _rotated(g: Graph, rotated: str) -> tuple[onnx.NodeProto, list[onnx.NodeProto], str, str]:
    """(the product, the rotation's nodes, the cos table, the sin table) of a rotated q or k."""
    products = [n for n in _ancestors_until_product(g, rotated) if n.op_type == INT8_OP_NAME]
    if len(products) != 1:
        raise RewriteError(f"{rotated!r}: not one int8 product turned by the rotary tables")
    product = products[0]
    nodes = _region(g, rotated, product.output[0])
    tables: dict[str, str] = {}
    for node in (n for n in nodes if n.op_type == "Mul"):
        for name in node.input:
            maker = g.producer.get(name)
            if maker is not None and maker.op_type in ("Cos", "Sin"):
                tables.setdefault(maker.op_type, name)
    if set(tables) != {"Cos", "Sin"}:
        raise RewriteError(f"{rotated!r}: the rotation reads no Cos and Sin tables")
    return product, nodes, tables["Cos"], tables["Sin"]


def _ancestors_until_product(g: Graph, tensor: str) -> list[onnx.NodeProto]:
    """Nodes making `tensor` or what it reads, not walking past an int8 product or a rotary table."""
    found: dict[int, onnx.NodeProto] = {}
    stack = [tensor]
    while stack:
        node = g.producer.get(stack.pop())
        if node is None or id(node) in found:
            continue
        found[id(node)] = node
        if node.op_type not in (INT8_OP_NAME, "Cos", "Sin", "Shape"):
            stack.extend(i for i in node.input if i)
    return list(found.values())


def _gated_residual(g: Graph, product: onnx.NodeProto, residual_of: str) -> tuple[list[onnx.NodeProto], str, str]:
    """(nodes, gate, output) of `residual_of + gate * product`."""
    gated = g.only_consumer(product.output[0], "Mul")
    gate = g.other_input(gated, product.output[0])
    summed = g.only_consumer(gated.output[0], "Add")
    if g.other_input(summed, gated.output[0]) != residual_of:
        raise RewriteError(f"{summed.name}: not the gated residual of {residual_of!r}")
    return [gated, summed], gate, summed.output[0]


def fuse_dit_blocks(model: onnx.ModelProto) -> int:
    """Replace each DiT block around a CachedAttention node (after fuse_attention and fuse_int8_matmuls) by one DiTBlock
    node (in place); returns how many. Its first output keeps the block output's name, and its float16 new keys
    (rotated) and values, side by side, become the graph's new_k and new_v. RewriteError when a block does not match."""
    g = Graph(model.graph)
    blocks: list[tuple[list[onnx.NodeProto], onnx.NodeProto]] = []
    inits: list[onnx.TensorProto] = []
    new_kv: dict[str, str] = {}
    for attention in [n for n in model.graph.node if n.op_type == OP_NAME]:
        q_rot, k_rot, v = attention.input[:3]
        q_mm, q_turn, cos, sin = _rotated(g, q_rot)
        k_mm, k_turn, k_cos, k_sin = _rotated(g, k_rot)
        v_mm = g.made_by(v, INT8_OP_NAME)
        h1 = q_mm.input[0]
        if k_mm.input[0] != h1 or v_mm.input[0] != h1 or (k_cos, k_sin) != (cos, sin):
            raise RewriteError(f"{attention.name}: q, k and v are not products of one input turned by one table")
        ln1, x, mul1, add1, eps1 = scaled_norm_pattern(g, h1)
        out_mm = g.only_consumer(attention.output[0], INT8_OP_NAME)
        residual1, gate1, h = _gated_residual(g, out_mm, x)
        ends = [n for n in g.consumers.get(h, []) if n.op_type == "Add"]
        if len(ends) != 1:
            raise RewriteError(f"{h!r}: expected one gated residual after the feed-forward")
        gated2, _ = g.made_by_either(ends[0], "Mul")
        ff2_mm, _ = g.made_by_either(gated2, INT8_OP_NAME)
        residual2, gate3, y = _gated_residual(g, ff2_mm, h)
        ff1_mm = next((n for n in _ancestors_until_product(g, ff2_mm.input[0]) if n.op_type == INT8_OP_NAME), None)
        if ff1_mm is None:
            raise RewriteError(f"{ff2_mm.name}: no ff1 product before it")
        gelu = _region(g, ff2_mm.input[0], ff1_mm.output[0])
        if {n.op_type for n in gelu} - GELU_OPS or [n.op_type for n in gelu].count("Tanh") != 1:
            raise RewriteError(f"{ff2_mm.name}: its input is not GELU's tanh approximation of ff1's output")
        ln3, h_in, mul3, add3, eps3 = scaled_norm_pattern(g, ff1_mm.input[0])
        if h_in != h:
            raise RewriteError(f"{ff1_mm.name}: the feed-forward does not read the attention's residual")
        nodes = [*ln1, q_mm, *q_turn, k_mm, *k_turn, v_mm, attention, out_mm, *residual1, *ln3, ff1_mm, *gelu, ff2_mm]
        nodes += residual2
        check_whole_block(g, nodes, {k_rot, v, y}, attention.name)
        (wq, sq, bq), (wk, sk, bk), (wv, sv, bv) = (int8_parts(g, mm, True) for mm in (q_mm, k_mm, v_mm))
        scales = qkv_scales((sq, sk, sv), wq.shape[1])
        if bq is None or bk is None or bv is None:
            raise RewriteError(f"{attention.name}: q, k and v have no biases")
        bias = np.concatenate([bq, bk, bv]).astype(np.float32)
        base = f"dit_{attention.input[3]}"
        arrays = [
            *packed_weight("qkv", np.concatenate([wq, wk, wv], axis=1), scales, bias),
            *packed_weight("out", *int8_parts(g, out_mm, True)),
            *packed_weight("ff1", *int8_parts(g, ff1_mm, True)),
            *packed_weight("ff2", *int8_parts(g, ff2_mm, True)),
        ]
        inits += [numpy_helper.from_array(a, f"{base}_{name}") for name, a in arrays]
        weights = [f"{base}_{name}" for name, _ in arrays]
        inputs = [x, *attention.input[3:6], cos, sin, mul1, add1, gate1, *weights[:8], mul3, add3, gate3, *weights[8:]]
        fused = helper.make_node(
            DIT_OP_NAME, inputs, [y, f"{base}_new_k", f"{base}_new_v"], name=base, domain=NATIVE_DOMAIN,
            heads=attr(attention, "heads"), scale=attr(attention, "scale"), eps1=eps1, eps3=eps3,
        )  # fmt: skip
        blocks.append((nodes, fused))
        new_kv[k_rot], new_kv[v] = fused.output[1], fused.output[2]
    splice_blocks(model, g, blocks, new_kv, inits)
    return len(blocks)
