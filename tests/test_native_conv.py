"""The vocoder's native twin (export/native_twin.py `rewrite_bf16_convs`, every family): each stride-1 convolution of
HiFT's decode graph as one `cosyvoice_lite.BF16Conv1d` (bf16 products, float32 sums). What the twin computes against
the float32 graph, the packing, and where the engine runs it."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from export.external_data import load_inline
from export.fuse_ops import bf16_bits, fuse_bf16_convs, pack_bf16_conv_weight
from export.twin_graph import CONV_OP_NAME
from service.bundle import NATIVE_DOMAIN, ModelBundle
from service.engine import native
from service.engine.options import RuntimeOptions
from service.engine.runtimes import graph_runtime, native_kernels_note

TWIN = "hift_decode_native"


@pytest.fixture(scope="module")
def kernels() -> native.NativeKernels:
    if not native.LIBRARY_PATH.is_file():
        pytest.skip(native.probe().reason)
    return native.probe(kernel=CONV_OP_NAME)


def session(path: Path | bytes, ceiling: str = "auto", threads: int = 1) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(str(native.LIBRARY_PATH))
    so.add_session_config_entry("cosyvoice_lite.kernels", ceiling)
    return ort.InferenceSession(path if isinstance(path, bytes) else str(path), so, providers=["CPUExecutionProvider"])


def vocoder_feeds(bundle: ModelBundle, frames: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A mel of `frames` frames and a source STFT of the length the vocoder takes with it (one STFT frame per sample
    hop, service/layers/hift.py)."""
    rng = np.random.default_rng(seed)
    steps = frames * math.prod(bundle.constants.upsample_rates) + 1
    mel = rng.standard_normal((1, 80, frames)).astype(np.float32)
    return {"mel": mel, "s_stft": (rng.standard_normal((1, 18, steps)) * 0.1).astype(np.float32)}


def test_bf16_rounding_is_to_nearest_with_ties_to_even_and_the_pairs_are_channel_pairs() -> None:
    values = np.array([1.0, -2.0, np.float32(1.0) + np.float32(2**-8), np.float32(1.0) + np.float32(3 * 2**-8)], np.float32)
    assert [hex(int(b)) for b in bf16_bits(values)] == ["0x3f80", "0xc000", "0x3f80", "0x3f82"]
    assert int(bf16_bits(np.array([np.nan], np.float32))[0]) & 0x7F80 == 0x7F80
    w = np.random.default_rng(1).standard_normal((5, 3, 2)).astype(np.float32)  # C_out 5, C_in 3 (odd), taps 2
    packed = pack_bf16_conv_weight(w).view(np.uint32)
    assert packed.shape == (2, 2, 5)  # (taps, pairs, C_out)
    rounded = (bf16_bits(w).astype(np.uint32) << 16).view(np.float32)
    low = ((packed & 0xFFFF) << 16).view(np.float32)
    high = ((packed >> 16) << 16).view(np.float32)
    np.testing.assert_array_equal(low[:, 0], rounded[:, 0].T)  # channel 0, every tap and output
    np.testing.assert_array_equal(high[:, 0], rounded[:, 1].T)
    np.testing.assert_array_equal(low[:, 1], rounded[:, 2].T)
    assert not high[:, 1].any()  # the zero channel after an odd count


@pytest.mark.parametrize("bundle_name", ["tiny-cosyvoice2", "tiny-cosyvoice3"])
def test_the_committed_vocoder_twin_computes_what_the_float_graph_computes(
    bundle_name: str, kernels: native.NativeKernels
) -> None:
    """Every stride-1 convolution is ours; outputs within bf16's reach of the float32 graph (a miswired convolution
    would be off by O(1)), for lengths that are no multiple of the kernel's tiles, and the same numbers from the
    portable C and the fast code, on one thread and two."""
    root = Path(__file__).resolve().parents[1] / "models" / bundle_name
    bundle = ModelBundle.load(root, verify_hashes=True)
    twin_path = bundle.native_graph_path("hift_decode")
    assert twin_path == root / f"{TWIN}.onnx" and bundle.manifest.graphs[TWIN].precision == "bf16"
    twin_model = onnx.load(str(twin_path))
    ours = [n for n in twin_model.graph.node if n.domain == NATIVE_DOMAIN]
    core_model = onnx.load(str(root / "hift_decode.onnx"))
    convs = [n for n in core_model.graph.node if n.op_type == "Conv"]
    strided = [n for n in convs if any(a.name == "strides" and a.ints != [1] for a in n.attribute)]
    assert {n.op_type for n in ours} == {CONV_OP_NAME}
    # each Snake activation is read by its convolution alone (CosyVoice3's through a causal zero Pad): the kernel takes
    # both, the pads computed by the Pad's constant subgraph joining the convolution's own
    made = {out: n for n in twin_model.graph.node for out in n.output}
    assert not any(n.op_type == "Sin" for n in twin_model.graph.node)
    assert not any(n.input[0] in made and made[n.input[0]].op_type == "Pad" for n in ours)
    assert sum(len(n.input) == 5 for n in ours) == sum(n.op_type == "Sin" for n in core_model.graph.node) > 0
    assert len(ours) + len(strided) == sum(n.op_type == "Conv" for n in core_model.graph.node)
    core = ort.InferenceSession(str(root / "hift_decode.onnx"), providers=["CPUExecutionProvider"])
    for frames in (7, 33):
        feeds = vocoder_feeds(bundle, frames, seed=frames)
        want = core.run(None, feeds)[0]
        for threads in (1, 2):  # (ONNX Runtime's own kernels sum in another order on two threads)
            portable = session(twin_path, "portable", threads).run(None, feeds)[0]
            assert np.linalg.norm(portable - want) / np.linalg.norm(want) < 2e-2
            np.testing.assert_array_equal(session(twin_path, "auto", threads).run(None, feeds)[0], portable)


def test_a_convolution_the_kernel_does_not_take_stays(tmp_path: Path) -> None:
    """Strided convolutions, grouped ones whose groups have an odd count of input channels, two-dimensional ones and
    one whose weight is an input stay ONNX Conv nodes."""
    from onnx import TensorProto, helper, numpy_helper

    w1 = numpy_helper.from_array(np.ones((4, 2, 3), np.float32), "w1")
    w2 = numpy_helper.from_array(np.ones((4, 1, 3), np.float32), "w2")
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1]),
        helper.make_node("Conv", ["x", "w1"], ["b"], strides=[2]),
        helper.make_node("Conv", ["x", "w2"], ["c"], group=2),
        helper.make_node("Conv", ["x", "wi"], ["d"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("x", "wi")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "abcd"], [w1, w2],
    )  # fmt: skip
    model = helper.make_model(graph)
    assert fuse_bf16_convs(model) == 1
    assert [n.op_type for n in model.graph.node] == [CONV_OP_NAME, "Conv", "Conv", "Conv"]
    attrs = {a.name: a.i for a in model.graph.node[0].attribute}
    assert attrs == {"dilation": 1, "pad_left": 1, "pad_right": 1}


@pytest.mark.parametrize("threads", [1, 2])
def test_a_grouped_convolution_computes_what_onnx_runtime_computes(kernels: native.NativeKernels, threads: int) -> None:
    """Groups of an even count of input channels (the v3 DiT's position convolutions: 16 groups, 31 taps) are taken,
    with a bias and pads; the kernel's fast code gives the portable C's numbers bit for bit."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    w = rng.standard_normal((12, 4, 5)).astype(np.float32) * 0.3
    bias = rng.standard_normal(12).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], group=3, pads=[2, 1])
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 12, None])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "b")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    want_session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert fuse_bf16_convs(model) == 1
    (twin,) = model.graph.node
    assert (twin.op_type, {a.name: a.i for a in twin.attribute}["group"]) == (CONV_OP_NAME, 3)
    x = rng.standard_normal((2, 12, 77)).astype(np.float32)
    (want,) = want_session.run(None, {"x": x})
    portable = session(model.SerializeToString(), "portable", threads).run(None, {"x": x})[0]
    assert portable.shape == want.shape == (2, 12, 76)
    assert np.linalg.norm(portable - want) / np.linalg.norm(want) < 1e-2  # bf16 products
    if kernels.usable:
        np.testing.assert_array_equal(session(model.SerializeToString(), "auto", threads).run(None, {"x": x})[0], portable)


def test_a_pad_joins_the_convolution_only_when_it_is_zeros_along_time_read_by_it_alone() -> None:
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 2, 3), np.float32), "w")
    time_pads = numpy_helper.from_array(np.array([0, 0, 2, 0, 0, 1], np.int64), "time_pads")
    channel_pads = numpy_helper.from_array(np.array([0, 1, 2, 0, 0, 1], np.int64), "channel_pads")
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    nodes = [
        helper.make_node("Pad", ["x", "time_pads"], ["p1"], mode="constant"),
        helper.make_node("Conv", ["p1", "w"], ["a"], pads=[1, 0]),
        helper.make_node("Pad", ["x", "channel_pads"], ["p2"]),
        helper.make_node("Conv", ["p2", "w"], ["b"]),
        helper.make_node("Pad", ["x", "time_pads", "one"], ["p3"]),
        helper.make_node("Conv", ["p3", "w"], ["c"]),
        helper.make_node("Pad", ["x", "time_pads"], ["p4"], mode="reflect"),
        helper.make_node("Conv", ["p4", "w"], ["d"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "abcd"], [w, time_pads, channel_pads, one],
    )  # fmt: skip
    model = helper.make_model(graph)
    assert fuse_bf16_convs(model) == 4
    convs = {n.output[0]: n for n in model.graph.node if n.op_type == CONV_OP_NAME}
    attrs = {a.name: a.i for a in convs["a"].attribute}
    assert (convs["a"].input[0], attrs["pad_left"], attrs["pad_right"]) == ("x", 3, 1)
    assert all(convs[o].input[0] != "x" for o in "bcd")  # across channels, not zeros, or reflected: the Pad stays


def test_the_engine_runs_the_vocoder_twin_only_where_its_kernel_has_avx512(
    tiny_v2_bundle: Path, kernels: native.NativeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vocoder's twin runs on the kernel's AVX-512 code, with BF16 or without; never on its AVX2 code (slower than
    ONNX Runtime's float32 graph), whatever native_on_avx2 says; the portable C only when asked."""
    bundle = ModelBundle.load(tiny_v2_bundle)
    chosen = graph_runtime(bundle, "hift_decode", RuntimeOptions())
    fast = kernels.usable and kernels.variant in ("avx512", "avx512_bf16")
    assert chosen.path == tiny_v2_bundle / (f"{TWIN}.onnx" if fast else "hift_decode.onnx")
    assert graph_runtime(bundle, "hift_decode", RuntimeOptions(native_kernels="portable")).path == tiny_v2_bundle / f"{TWIN}.onnx"
    off = graph_runtime(bundle, "hift_decode", RuntimeOptions(native_kernels="off", acoustic_backend="ort"))
    assert (off.path, off.custom_ops) == (tiny_v2_bundle / "hift_decode.onnx", None)
    note = native_kernels_note(bundle, RuntimeOptions(native_kernels="portable"))
    assert note is not None and "hift_decode runs its bf16 convolutions: portable" in note
    library = native.LIBRARY_PATH

    def host(variant: str) -> Callable[..., native.NativeKernels]:
        def probe(
            path: Path = library, head_dim: int = 64, kernel: str = "", kernels: str = "auto", avx2: bool = True
        ) -> native.NativeKernels:
            if variant == native.AVX2_VARIANT and not avx2:
                return native.NativeKernels(None, "avx2 left out")
            return native.NativeKernels(library, "", variant)

        return probe

    monkeypatch.setattr(native, "runtime_refusal", lambda path: "")
    monkeypatch.setattr(native, "probe", host("avx512"))  # AVX-512 without BF16: bf16 widened to float32
    assert graph_runtime(bundle, "hift_decode", RuntimeOptions()).path == tiny_v2_bundle / f"{TWIN}.onnx"
    monkeypatch.setattr(native, "probe", host(native.AVX2_VARIANT))
    for avx2 in (True, False):
        ort_graph = graph_runtime(bundle, "hift_decode", RuntimeOptions(acoustic_backend="ort", native_on_avx2=avx2))
        assert (ort_graph.path, ort_graph.custom_ops) == (tiny_v2_bundle / "hift_decode.onnx", None)
    monkeypatch.setattr(native, "probe", lambda **_: native.NativeKernels(None, "no AVX-512 BF16"))
    assert graph_runtime(bundle, "hift_decode", RuntimeOptions(acoustic_backend="ort")).custom_ops is None


def test_the_rewrite_of_a_float_vocoder_is_the_committed_twin(tiny_v2_bundle: Path) -> None:
    """The twin is the rewrite of the bundle's own graph, reproducibly (the exporter and `export.add_twins` write it)."""
    model = load_inline(tiny_v2_bundle / "hift_decode.onnx")
    fuse_bf16_convs(model)
    committed = onnx.load(str(tiny_v2_bundle / f"{TWIN}.onnx"))
    assert [n.op_type for n in model.graph.node] == [n.op_type for n in committed.graph.node]
    got = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    for init in committed.graph.initializer:
        np.testing.assert_array_equal(got[init.name], onnx.numpy_helper.to_array(init), err_msg=init.name)
