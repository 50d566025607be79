"""NormMish (service/layers/native/norm_mish.h, export/fuse_resnet.py): each flow estimator ResNet block's norm and
Mish, with the mask and addend after them, as one node; the float32 estimators rewritten so compute what they computed
(the kernel's arithmetic is float32 too), on every code path this host has and on the portable C."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from portable import native_session
from test_native_twin import estimator_feeds
from test_native_v1_twin import relative_rms, velocity_feeds

from export.fuse_resnet import fuse_norm_mish
from export.twin_graph import NORM_MISH_OP_NAME
from service.bundle import NATIVE_DOMAIN
from service.engine import native

CEILINGS = ("auto", "portable")


@pytest.fixture(scope="module")
def library() -> Path:
    if not native.LIBRARY_PATH.is_file():
        pytest.skip(native.probe().reason)
    return native.LIBRARY_PATH


def fused(path: Path, mask_input: str | None = None) -> tuple[onnx.ModelProto, int, list[str]]:
    """The graph at `path` with its norms and Mish fused: (model, nodes fused, the core graph's op types)."""
    core_ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    model = onnx.load(str(path))
    count = fuse_norm_mish(model, mask_input)
    onnx.checker.check_model(model)
    return model, count, core_ops


@pytest.mark.parametrize("ceiling", CEILINGS)
def test_cosyvoice2_layer_norms_fuse_and_compute_the_same(cv2_ref_bundle: Path, library: Path, ceiling: str) -> None:
    model, count, core_ops = fused(cv2_ref_bundle / "flow_estimator.onnx")
    ops = [n.op_type for n in model.graph.node]
    assert count > 0 and ops.count(NORM_MISH_OP_NAME) == count  # two a ResNet block, one in the final block
    assert ops.count("ReduceMean") == core_ops.count("ReduceMean") - 2 * count  # each LayerNorm's two reductions gone
    core = ort.InferenceSession(str(cv2_ref_bundle / "flow_estimator.onnx"), providers=["CPUExecutionProvider"])
    twin = native_session(library, model.SerializeToString(), ceiling, threads=2)  # type: ignore[arg-type]
    for cached, new in ((0, 9), (13, 8)):
        feeds = estimator_feeds(core, cached, new)
        for output, want, got in zip(core.get_outputs(), core.run(None, feeds), twin.run(None, feeds), strict=True):
            assert relative_rms(want, got) < 1e-5, (output.name, cached, new)


@pytest.mark.parametrize("ceiling", CEILINGS)
def test_cosyvoice1_group_norms_fuse_with_their_mask_and_compute_the_same(tiny_bundle: Path, library: Path, ceiling: str) -> None:
    """Frames masked out at the end (padding): the mask is read where the graph reads it, the GroupNorm's moments
    still over every frame, as torch's GroupNorm takes them."""
    model, count, core_ops = fused(tiny_bundle / "flow_estimator.onnx", "mask")
    ops = [n.op_type for n in model.graph.node]
    assert count == core_ops.count("InstanceNormalization") > 0 and "InstanceNormalization" not in ops
    masked = [n for n in model.graph.node if n.op_type == NORM_MISH_OP_NAME and len(n.input) >= 4 and n.input[3]]
    assert len(masked) == count  # every one takes its block's mask product along
    core = ort.InferenceSession(str(tiny_bundle / "flow_estimator.onnx"), providers=["CPUExecutionProvider"])
    twin = native_session(library, model.SerializeToString(), ceiling, threads=2)  # type: ignore[arg-type]
    for frames in (1, 36, 69):
        feeds = velocity_feeds(frames)
        feeds["mask"][:, :, frames - frames // 4 :] = 0.0
        (want,), (got,) = core.run(None, feeds), twin.run(None, feeds)
        assert relative_rms(want, got) < 1e-5, frames


def mish_after(op: str) -> onnx.ModelProto:
    """x (2, 3, 4) through `op` (Relu, or a one-group InstanceNormalization) then torch's exported Mish."""
    c = {n: numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("max", 20.0), ("two", 2.0))}
    nodes = [helper.make_node("Relu", ["x"], ["v"])]
    if op == "InstanceNormalization":
        nodes = [helper.make_node("InstanceNormalization", ["x", "ones", "zeros"], ["v"], epsilon=1e-5)]
    nodes += [
        helper.make_node("Clip", ["v", "", "max"], ["clipped"]), helper.make_node("Exp", ["clipped"], ["e"]),
        helper.make_node("Add", ["e", "two"], ["e2"]), helper.make_node("Mul", ["e", "e2"], ["m"]),
        helper.make_node("Add", ["m", "two"], ["d"]), helper.make_node("Div", ["m", "d"], ["t"]),
        helper.make_node("Mul", ["v", "t"], ["y"]),
    ]  # fmt: skip
    inits = [*c.values(), numpy_helper.from_array(np.ones(3, np.float32), "ones")]
    inits.append(numpy_helper.from_array(np.zeros(3, np.float32), "zeros"))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])
    return helper.make_model(helper.make_graph(nodes, "mish", [x], [y], inits), opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("op", ["Relu", "InstanceNormalization"])
def test_a_mish_after_anything_but_a_resnet_norm_stays(op: str) -> None:
    """A Mish after a ReLU (the DiT's after its position convolutions, the time MLP's), or after an instance norm
    that is not torch's GroupNorm view, is not the kernel's: nothing changes."""
    model = mish_after(op)
    before = model.SerializeToString()
    assert fuse_norm_mish(model, "mask") == 0 and model.SerializeToString() == before


def test_the_operator_refuses_a_mask_with_layer_norm(library: Path) -> None:
    node = helper.make_node(NORM_MISH_OP_NAME, ["x", "g", "b", "m"], ["y"], domain=NATIVE_DOMAIN, groups=0)
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("x", "g", "b", "m")]
    graph = helper.make_graph([node], "bad", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    opsets = [helper.make_opsetid("", 13), helper.make_opsetid(NATIVE_DOMAIN, 1)]
    session = native_session(library, helper.make_model(graph, opset_imports=opsets, ir_version=8).SerializeToString(), "auto")
    x = np.ones((1, 2, 4), np.float32)
    feeds = {"x": x, "g": np.ones(4, np.float32), "b": np.zeros(4, np.float32), "m": np.ones((1, 1, 2), np.float32)}
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match=r"NormMish: .*mask"):
        session.run(None, feeds)
