"""A flow estimator ResNet block's norm and Mish, with the mask and addend after them, as one
`cosyvoice_lite.NormMish` node (service/layers/native/norm_mish.h).

Both chunk-causal and full-window estimators build each ResNet block (export/modules/estimator.py) as conv, norm,
Mish, then the time embedding added (first half) or the residual added (second half). CosyVoice-300M normalizes by
GroupNorm over (channels, frames) in (B, C, T) and multiplies by the frame mask before the addend; CosyVoice2 by
LayerNorm over each frame's channels in (B, T, C), with no mask. torch exports GroupNorm as Reshape(x, (0, G, -1)),
InstanceNormalization with unit scale and zero bias, Reshape back, Mul and Add by (C, 1) constants; LayerNorm as the
pattern fuse_layers.layer_norm_pattern reads; Mish as x * E(E + 2) / (E(E + 2) + 2) with E = Exp(Clip(x, max)).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from export.fuse_layers import check_whole_block, layer_norm_pattern
from export.twin_graph import NORM_MISH_OP_NAME, Graph, RewriteError, attr, replace_nodes
from service.bundle import NATIVE_DOMAIN

# The least clip bound under which the graph's Mish is the kernel's: beyond it E(E + 2) / (E(E + 2) + 2) is 1 in float32
# either way (torch's exporter clips at 20).
MIN_MISH_CLIP = 15.0
# What a frame mask may pass through on its way from the estimator's `mask` input (its downsampled copies are slices).
_MASK_OPS = frozenset({"Slice", "Identity", "Unsqueeze", "Squeeze", "Cast"})


def _scalar(g: Graph, tensor: str) -> float:
    return float(np.asarray(g.constant(tensor)).reshape(-1)[0])


def _mish(g: Graph, exp: onnx.NodeProto) -> tuple[list[onnx.NodeProto], str, str]:
    """(nodes, input, output) of the Mish around `exp`: Mul(v, Div(M, Add(M, 2))), M = Mul(E, Add(E, 2)),
    E = Exp(Clip(v, max))."""
    clip = g.made_by(exp.input[0], "Clip")
    v, e = clip.input[0], exp.output[0]
    if len(clip.input) != 3 or clip.input[1] or _scalar(g, clip.input[2]) < MIN_MISH_CLIP:
        raise RewriteError(f"{clip.name}: not Mish's overflow clip")
    plus, square = _user(g, e, "Add"), _user(g, e, "Mul")
    shifted = _user(g, square.output[0], "Add")
    ratio = _user(g, square.output[0], "Div")
    out = g.only_consumer(ratio.output[0], "Mul")
    ok = set(square.input) == {e, plus.output[0]} and list(ratio.input) == [square.output[0], shifted.output[0]]
    ok = ok and set(out.input) == {v, ratio.output[0]}
    if not ok or _scalar(g, g.other_input(plus, e)) != 2.0 or _scalar(g, g.other_input(shifted, square.output[0])) != 2.0:
        raise RewriteError(f"{exp.name}: not Mish")
    return [clip, exp, plus, square, shifted, ratio, out], v, out.output[0]


def _user(g: Graph, tensor: str, op_type: str) -> onnx.NodeProto:
    users = [n for n in g.consumers.get(tensor, []) if n.op_type == op_type]
    if len(users) != 1:
        raise RewriteError(f"{tensor!r} feeds {len(users)} {op_type} nodes, expected one")
    return users[0]


def _group_norm(g: Graph, output: str) -> tuple[list[onnx.NodeProto], str, np.ndarray, np.ndarray, float, int]:
    """(nodes, input, gamma, beta, epsilon, groups) of torch's GroupNorm making `output` (see the module docstring)."""
    shifted = g.made_by(output, "Add")
    scaled, beta = g.made_by_either(shifted, "Mul")
    back, gamma = g.made_by_either(scaled, "Reshape")
    norm = g.made_by(back.input[0], "InstanceNormalization")
    view = g.made_by(norm.input[0], "Reshape")
    x = view.input[0]
    shape = np.asarray(g.constant(view.input[1])).reshape(-1)
    scale, bias = (np.asarray(g.constant(t)).reshape(-1) for t in norm.input[1:3])
    shape_of = g.producer.get(back.input[1])
    ok = shape_of is not None and shape_of.op_type == "Shape" and shape_of.input[0] == x
    if not ok or len(shape) != 3 or shape[0] != 0 or shape[2] != -1 or np.any(scale != 1) or np.any(bias != 0):
        raise RewriteError(f"{norm.name}: not a GroupNorm over (channels, frames)")
    w, b = (np.asarray(g.constant(t), np.float32) for t in (gamma, beta))
    if w.ndim != 2 or w.shape[1] != 1 or b.shape != w.shape:
        raise RewriteError(f"{scaled.name}: GroupNorm's affine is not (C, 1)")
    eps = attr(norm, "epsilon")
    nodes = [view, norm, back, scaled, shifted, *([shape_of] if len(g.consumers[shape_of.output[0]]) == 1 else [])]
    return nodes, x, w.reshape(-1), b.reshape(-1), float(eps if isinstance(eps, float) else 1e-5), int(shape[1])


def _is_frame_mask(g: Graph, tensor: str, mask_input: str) -> bool:
    """Whether `tensor` is the graph input `mask_input` or a slice of it (no other input, no arithmetic)."""
    while tensor != mask_input:
        node = g.producer.get(tensor)
        if node is None or node.op_type not in _MASK_OPS:
            return False
        tensor = node.input[0]
    return True


def _after(g: Graph, output: str, mask_input: str | None) -> tuple[list[onnx.NodeProto], str, str, str]:
    """What follows a Mish's `output` and the fused node takes along: (nodes, mask, addend, final output), each of
    mask and addend "" when absent: a Mul by a frame mask (with `mask_input`), then an Add of any other tensor."""
    nodes: list[onnx.NodeProto] = []
    mask = add = ""
    users = g.consumers.get(output, [])
    if mask_input and len(users) == 1 and users[0].op_type == "Mul":
        other = g.other_input(users[0], output)
        if _is_frame_mask(g, other, mask_input):
            nodes.append(users[0])
            mask, output = other, users[0].output[0]
            users = g.consumers.get(output, [])
    if len(users) == 1 and users[0].op_type == "Add":
        other = g.other_input(users[0], output)
        if other not in g.initializers:
            nodes.append(users[0])
            add, output = other, users[0].output[0]
    return nodes, mask, add, output


def fuse_norm_mish(model: onnx.ModelProto, mask_input: str | None = None) -> int:
    """Replace each norm (LayerNorm or GroupNorm) followed by Mish, with the mask product (a slice of the graph input
    `mask_input`, when given) and the addend after it, by one NormMish node (in place); returns how many. A Mish after
    anything else (the Fun-CosyVoice3 DiT's position convolutions) stays."""
    g = Graph(model.graph)
    fused: dict[str, onnx.NodeProto] = {}
    arrays: list[onnx.TensorProto] = []
    for exp in [n for n in model.graph.node if n.op_type == "Exp"]:
        try:
            mish, norm_out, out = _mish(g, exp)
            norm, x, w, b, eps, groups = _norm(g, norm_out)
        except RewriteError:
            continue  # a Mish after something else, or an Exp of something else
        tail, mask, add, final = _after(g, out, mask_input if groups else None)
        try:
            check_whole_block(g, [*norm, *mish, *tail], {final}, exp.name)
        except RewriteError:
            continue  # an intermediate read elsewhere: the graph keeps computing it
        name = f"norm_mish_{len(fused)}"
        arrays += [numpy_helper.from_array(w, f"{name}_gamma"), numpy_helper.from_array(b, f"{name}_beta")]
        inputs = [x, f"{name}_gamma", f"{name}_beta", mask, add]
        while inputs[-1] == "":
            inputs.pop()
        fused[final] = helper.make_node(
            NORM_MISH_OP_NAME, inputs, [final], name=name, domain=NATIVE_DOMAIN, groups=groups, epsilon=eps
        )
    if fused:
        model.graph.initializer.extend(arrays)
        replace_nodes(model, fused)
    return len(fused)


def _norm(g: Graph, output: str) -> tuple[list[onnx.NodeProto], str, np.ndarray, np.ndarray, float, int]:
    """(nodes, input, gamma, beta, epsilon, groups) of the GroupNorm or LayerNorm (groups 0) making `output`."""
    try:
        return _group_norm(g, output)
    except RewriteError:
        nodes, x, w, b, eps = layer_norm_pattern(g, output)
        return nodes, x, w, b, eps, 0
