"""Rewrites of whole layers into one node each: an estimator transformer block as EstimatorBlock (with or without a
cache) and a Qwen2 decoder layer as Qwen2Layer, both after their int8 products became Int8MatMul nodes."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import helper, numpy_helper

from export.fuse_ops import pack_int8_weight, unpack_int8_weight
from export.twin_graph import (
    BLOCK_OP_NAME,
    INT8_OP_NAME,
    OP_NAME,
    QWEN2_OP_NAME,
    Graph,
    RewriteError,
    attr,
    install,
    live_nodes,
    replace_nodes,
)
from service.bundle import NATIVE_DOMAIN

SQRT_HALF = 0.5**0.5


def layer_norm_pattern(g: Graph, output: str) -> tuple[list[onnx.NodeProto], str, np.ndarray, np.ndarray, float]:
    """(nodes, input, weight, bias, epsilon) of the LayerNorm pattern making `output` (opset 13 has no LayerNorm op):
    Add(Mul(Div(Sub(x, ReduceMean(x)), Sqrt(Add(ReduceMean(Pow(Sub, 2)), eps))), weight), bias), over the last axis."""
    nodes, x, weight, bias, eps = scaled_norm_pattern(g, output)
    w, b = (np.asarray(g.constant(t), np.float32).reshape(-1) for t in (weight, bias))
    return nodes, x, w, b, eps


def scaled_norm_pattern(g: Graph, output: str) -> tuple[list[onnx.NodeProto], str, str, str, float]:
    """(nodes, input, weight tensor, bias tensor, epsilon) of a LayerNorm without weights of its own, then `* weight +
    bias` (constants, or a DiT's per-batch modulation (B, 1, D)): Add(Mul(norm, weight), bias) as layer_norm_pattern
    reads it."""
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
    return nodes, x, weight, bias, float(np.asarray(g.constant(eps)).reshape(-1)[0])


def _gelu(g: Graph, output: str) -> tuple[list[onnx.NodeProto], str]:
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


def int8_parts(g: Graph, node: onnx.NodeProto, bias: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(int8 (K, N) weight, scale, bias) of an Int8MatMul node."""
    if node.op_type != INT8_OP_NAME or len(node.input) != (5 if bias else 4):
        raise RewriteError(f"{node.name}: expected an {INT8_OP_NAME} {'with' if bias else 'without'} a bias")
    n = next(a.i for a in node.attribute if a.name == "n")
    packed = g.constant(node.input[1])
    w = unpack_int8_weight(packed, packed.shape[1] * 4, n)  # K padded to a multiple of 4 with zero rows, as packed
    scale = np.asarray(g.constant(node.input[3]), np.float32).reshape(-1)
    return w, scale, np.asarray(g.constant(node.input[4]), np.float32).reshape(-1) if bias else None


def check_whole_block(g: Graph, nodes: list[onnx.NodeProto], kept: set[str], around: str) -> None:
    """RewriteError when a tensor made by the block's `nodes`, other than those in `kept` (its output, and its keys
    and values, which splice_blocks checks against the cache stacks), is read outside the block or is a graph output:
    it cannot disappear into the kernel."""
    members = {id(n) for n in nodes}
    graph_outputs = {o.name for o in g.graph.output}
    for node in nodes:
        for out in node.output:
            outside = out in graph_outputs or any(id(c) not in members for c in g.consumers.get(out, []))
            if out not in kept and outside:
                raise RewriteError(f"{out!r} of the block around {around} is read outside it")


def qkv_scales(scales: tuple[np.ndarray, ...], width: int) -> np.ndarray:
    """The scales of one q|k|v product from each part's (one scale, or one per column, over `width` columns): one per
    column, or a single one when they all agree."""
    out = np.concatenate([np.repeat(s, width) if s.size == 1 else s for s in scales]).astype(np.float32)
    return out[:1] if np.all(out == out[0]) else out


def packed_weight(part: str, w: np.ndarray, scale: np.ndarray, bias: np.ndarray | None) -> list[tuple[str, np.ndarray]]:
    """A fused block's weight inputs: packed, colsum, scale(s) and, with one, the bias."""
    packed, colsum = pack_int8_weight(w)
    arrays = [(f"{part}_packed", packed), (f"{part}_colsum", colsum), (f"{part}_scale", scale)]
    return arrays if bias is None else [*arrays, (f"{part}_bias", bias)]


def fuse_blocks(model: onnx.ModelProto) -> int:
    """Replace each transformer block around a CachedAttention node (after fuse_attention and fuse_int8_matmuls) by
    one EstimatorBlock node (in place); returns how many. Its first output keeps the block output's name; in a graph
    with caches its float16 new keys and values, side by side, become the graph's new_k and new_v (_cache_output).
    RewriteError when a block or the stacks do not match."""
    graph = model.graph
    g = Graph(graph)
    blocks: list[tuple[list[onnx.NodeProto], onnx.NodeProto]] = []
    inits: list[onnx.TensorProto] = []
    new_kv: dict[str, str] = {}  # a block's k (v) product -> its float16 slice of new_k (new_v) from the fused node
    attentions = [n for n in graph.node if n.op_type == OP_NAME]
    readers = Counter(n.input[3] for n in attentions)  # a cache input per block, or one empty cache they all read
    for attention in attentions:
        q_mm, k_mm, v_mm = (g.made_by(t, INT8_OP_NAME) for t in attention.input[:3])
        h1 = q_mm.input[0]
        if k_mm.input[0] != h1 or v_mm.input[0] != h1:
            raise RewriteError(f"{attention.name}: q, k and v are not products of one input")
        ln1, x, ln1_w, ln1_b, eps1 = layer_norm_pattern(g, h1)
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
        ln3, h_in, ln3_w, ln3_b, eps3 = layer_norm_pattern(g, ff1_mm.input[0])
        if h_in != h:
            raise RewriteError(f"{ff1_mm.name}: the feed-forward does not read the attention's residual")
        nodes = [*ln1, q_mm, k_mm, v_mm, attention, out_mm, residual1, *ln3, ff1_mm, *gelu, ff2_mm, residual2]
        check_whole_block(g, nodes, {k_mm.output[0], v_mm.output[0], residual2.output[0]}, attention.name)
        (wq, sq, _), (wk, sk, _), (wv, sv, _) = (int8_parts(g, mm, False) for mm in (q_mm, k_mm, v_mm))
        w_out, s_out, b_out = int8_parts(g, out_mm, True)
        w_ff1, s_ff1, b_ff1 = int8_parts(g, ff1_mm, True)
        w_ff2, s_ff2, b_ff2 = int8_parts(g, ff2_mm, True)
        scales = qkv_scales((sq, sk, sv), wq.shape[1])
        base = f"block_{attention.input[3] if readers[attention.input[3]] == 1 else attention.name}"
        arrays: list[tuple[str, np.ndarray]] = [
            ("ln1_w", ln1_w),
            ("ln1_b", ln1_b),
            *packed_weight("qkv", np.concatenate([wq, wk, wv], axis=1), scales, None),
            *packed_weight("out", w_out, s_out, b_out),
            ("ln3_w", ln3_w),
            ("ln3_b", ln3_b),
            *packed_weight("ff1", w_ff1, s_ff1, b_ff1),
            *packed_weight("ff2", w_ff2, s_ff2, b_ff2),
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
    splice_blocks(model, g, blocks, new_kv, inits)
    return len(blocks)


def splice_blocks(
    model: onnx.ModelProto,
    g: Graph,
    blocks: list[tuple[list[onnx.NodeProto], onnx.NodeProto]],
    new_kv: dict[str, str],
    inits: list[onnx.TensorProto],
) -> None:
    """Put each fused block node where its first node was, drop its nodes and what nothing reads any more, and in a
    graph with caches make new_k and new_v the fused nodes' float16 slices side by side (`new_kv`: a block's k or v
    tensor -> that slice). RewriteError when something else still reads a block's keys or values."""
    graph = model.graph
    graph_outputs = {o.name for o in graph.output}
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
    live = live_nodes(kept, [o.name for o in graph.output])
    stray = sorted({name for node in live for name in node.input if name in new_kv})
    if stray:
        raise RewriteError(f"{stray[0]!r}: a block's keys/values are read elsewhere than in new_k/new_v")
    install(graph, live)


def _cache_output(g: Graph, output: str, new_kv: dict[str, str]) -> tuple[onnx.NodeProto, onnx.NodeProto]:
    """(the Cast making the estimator's `output`, the Concat of the fused blocks' float16 slices to put there).

    Our exporter stacks each block's new keys as Cast(float16, Transpose(0,1,3,2,4, Concat(axis 0, Unsqueeze(0,
    Transpose(0,2,1,3, Reshape(k, (B,M,H,DK))))))): that is (NB,B,M,H,DK), each block's (B,M,H*DK) product in place, so
    the blocks' (1,B,M,H,DK) float16 outputs side by side are the same tensor."""
    cast = g.made_by(output, "Cast")
    outer = g.made_by(cast.input[0], "Transpose")
    stack = g.made_by(outer.input[0], "Concat")
    ok = attr(cast, "to") == onnx.TensorProto.FLOAT16 and attr(outer, "perm") == [0, 1, 3, 2, 4]
    if not ok or attr(stack, "axis") != 0:
        raise RewriteError(f"{output!r}: not the float16 stack of the blocks' new keys/values the kernel writes")
    slices = []
    for name in stack.input:
        unsqueeze = g.made_by(name, "Unsqueeze")
        inner = g.made_by(unsqueeze.input[0], "Transpose")
        reshape = g.made_by(inner.input[0], "Reshape")
        if attr(inner, "perm") != [0, 2, 1, 3] or [int(a) for a in g.constant(unsqueeze.input[1]).reshape(-1)] != [0]:
            raise RewriteError(f"{output!r}: {name!r} is not a block's keys/values in (B,H,M,DK)")
        if reshape.input[0] not in new_kv:
            raise RewriteError(f"{output!r}: {reshape.input[0]!r} is not a fused block's k or v product")
        slices.append(new_kv[reshape.input[0]])
    return cast, helper.make_node("Concat", slices, [output], name=f"{output}_stack", axis=0)


def fuse_qwen2_layers(model: onnx.ModelProto) -> int:
    """Replace each decoder layer of a CosyVoice2 LLM step (after fuse_int8_matmuls) by one Qwen2Layer node (in place);
    returns how many. The layer is found by the names our exporter gives its nodes (export/cosyvoice2/modules/llm.py:
    `/layers.{i}/...`): its input, RMSNorm weights and epsilon, the seven Int8MatMul products, the float16 caches (the
    inputs of their Casts), the shared mask and rotary tables, and its three outputs (y, the rotated new keys, the new
    values), whose names the node keeps. RewriteError when a piece is missing."""
    graph = model.graph
    g = Graph(graph)
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
            heads=int(attr(q, "n")) // head_dim, ff=int(attr(gate, "n")),
            scale=float(scale),
            eps=float(g.constant(node("input_layernorm/Add").input[1])),
        )  # fmt: skip
        layer += 1
    if fused:
        replace_nodes(model, fused)
    return len(fused)
