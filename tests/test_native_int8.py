"""Our native kernel cosyvoice_lite.Int8MatMul (service/engine/native/int8_matmul.c) through the installed ONNX
Runtime: per-row dynamic quantization and int8 products against an exact numpy reference for every shape class
(padding of K and N, row tiles, the parallel path), ONNX Runtime's own operators on one row, batch invariance, and a
clear error for inputs that disagree."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from portable import run_portable

from export.fuse_ops import pack_int8_weight
from service.bundle import NATIVE_DOMAIN
from service.engine import native


def weights(k: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(-64, 64, (k, n), dtype=np.int8), rng.standard_normal(n).astype(np.float32)


def product_graph(
    w: np.ndarray, w_scale: float, bias: np.ndarray | None, rank: int = 2, window: int = 1, spread: bool = False
) -> bytes:
    packed, colsum = pack_int8_weight(w)
    inits = [
        numpy_helper.from_array(packed, "packed"),
        numpy_helper.from_array(colsum, "colsum"),
        numpy_helper.from_array(np.array([w_scale], np.float32), "w_scale"),
    ]
    inputs = ["x", "packed", "colsum", "w_scale"]
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "bias"))
        inputs.append("bias")
    extra = {"window": window} if window > 1 else {}
    graph_inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*[f"d{i}" for i in range(rank - 1)], "K"])]
    if spread:  # as export/native_twin.py's add_spread_input writes it: an input backed by an initializer of 1
        inputs = [*inputs, *[""] * (5 - len(inputs)), native.SPREAD_INPUT]
        inits.append(numpy_helper.from_array(np.array([1], np.int64), native.SPREAD_INPUT))
        graph_inputs.append(helper.make_tensor_value_info(native.SPREAD_INPUT, TensorProto.INT64, [1]))
    node = helper.make_node("Int8MatMul", inputs, ["y"], domain=NATIVE_DOMAIN, n=w.shape[1], **extra)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [*[f"d{i}" for i in range(rank - 1)], "N"])
    model = helper.make_model(
        helper.make_graph([node], "product", graph_inputs, [y], inits),
        opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(NATIVE_DOMAIN, 1)],
    )
    model.ir_version = 8
    return model.SerializeToString()


def session(native_library: Path, model: bytes, threads: int = 1) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(str(native_library))
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def reference(x: np.ndarray, w: np.ndarray, w_scale: float, bias: np.ndarray | None) -> np.ndarray:
    """DynamicQuantizeLinear of each row (ONNX's definition), the integer product, then the scales and bias."""
    rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
    out = np.empty((rows.shape[0], w.shape[1]), np.float64)
    for i, row in enumerate(rows):
        lo, hi = min(0.0, float(row.min())), max(0.0, float(row.max()))
        scale = np.float32((hi - lo) / 255.0) if hi != lo else np.float32(1.0)
        zp = np.clip(np.round(-lo / scale), 0, 255)  # np.round: half to even, as ONNX
        q = np.clip(np.round(row / scale) + zp, 0, 255).astype(np.int64)
        acc = (q - int(zp)) @ w.astype(np.int64)
        out[i] = acc.astype(np.float64) * float(np.float32(scale * np.float32(w_scale)))
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], w.shape[1])


@pytest.mark.parametrize(
    ("rows", "k", "n", "with_bias"),
    [
        (1, 896, 896, True),  # a decode step's projection
        (1, 64, 6564, True),  # a vocabulary head: N not a multiple of 64
        (3, 30, 10, False),  # K not a multiple of 4, N under one vector
        (6, 256, 128, True),  # one whole row tile
        (7, 100, 200, False),  # a tile and one row
        (13, 520, 300, True),  # two tiles and a partial one
        (50, 256, 512, False),  # an estimator call's frames
    ],
)
def test_products_match_the_exact_reference(native_library: Path, rows: int, k: int, n: int, with_bias: bool) -> None:
    w, b = weights(k, n, rows)
    bias = b if with_bias else None
    x = np.random.default_rng(k).standard_normal((rows, k)).astype(np.float32)
    x[0, 0] = 0.0  # a row with zeros and both signs; the last row all positive (zero point 0)
    x[-1] = np.abs(x[-1])
    got = session(native_library, product_graph(w, 0.0123, bias)).run(["y"], {"x": x})[0]
    want = reference(x, w, 0.0123, bias)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_one_row_is_what_onnx_runtime_computes_bit_for_bit(native_library: Path) -> None:
    """DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul(scales) -> Add(bias), the graph our quantizer writes."""
    w, bias = weights(96, 80)
    w_scale = np.array(0.02, np.float32)
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
        helper.make_node("MatMulInteger", ["xq", "w", "xz", "wz"], ["acc"]),
        helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["xs", "ws"], ["scale"]),
        helper.make_node("Mul", ["accf", "scale"], ["prod"]),
        helper.make_node("Add", ["prod", "bias"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(np.array(0, np.int8), "wz"),
        numpy_helper.from_array(w_scale, "ws"),
        numpy_helper.from_array(bias, "bias"),
    ]
    graph = helper.make_graph(
        nodes, "ort", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 96])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 80])], inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    x = np.random.default_rng(1).standard_normal((1, 1, 96)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]
    got = session(native_library, product_graph(w, float(w_scale), bias, rank=3)).run(["y"], {"x": x})[0]
    assert np.array_equal(got, want)


def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads(native_library: Path) -> None:
    """Each row is quantized on its own (ONNX Runtime's operator takes one range for the whole batch), and the work
    shared over two threads (many rows: several tasks) gives the same numbers as one."""
    w, bias = weights(640, 384)
    model = product_graph(w, 0.01, bias, rank=3)
    x = np.random.default_rng(2).standard_normal((2, 20, 640)).astype(np.float32)
    x[1] *= 40.0  # a batch row with a far wider range
    one_thread = session(native_library, model).run(["y"], {"x": x})[0]
    two_threads = session(native_library, model, threads=2).run(["y"], {"x": x})[0]
    alone = session(native_library, model).run(["y"], {"x": x[:1, :1]})[0]
    assert np.array_equal(one_thread, two_threads)
    assert np.array_equal(alone[0, 0], one_thread[0, 0])


@pytest.mark.parametrize("with_bias", [True, False])
def test_a_spread_decode_product_gives_the_same_numbers(native_library: Path, with_bias: bool) -> None:
    """A product of a decode step's few rows split over two threads (its spread input, per run: while the other core
    is idle) gives the numbers the calling thread alone gives: each weight panel's sums are the same. The spread is a
    call's argument, not a setting of the process: a second session beside it is not affected."""
    w, b = weights(896, 1000)
    bias = b if with_bias else None
    two_threads = session(native_library, product_graph(w, 0.02, bias, rank=3, spread=True), threads=2)
    x = np.random.default_rng(3).standard_normal((1, 3, 896)).astype(np.float32)
    alone = two_threads.run(["y"], {"x": x})[0]  # the initializer's 1: the calling thread
    spread = two_threads.run(["y"], {"x": x, native.SPREAD_INPUT: np.array([4], np.int64)})[0]
    most = two_threads.run(["y"], {"x": x, native.SPREAD_INPUT: np.array([1000], np.int64)})[0]  # clamped to 16
    assert np.array_equal(spread, alone) and np.array_equal(most, alone)
    want = reference(x, w, 0.02, bias)
    np.testing.assert_allclose(alone, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_inputs_that_disagree_are_an_error_not_a_crash(native_library: Path) -> None:
    w, bias = weights(64, 32)
    sess = session(native_library, product_graph(w, 0.01, bias))
    with pytest.raises(Exception, match="Int8MatMul: x"):
        sess.run(["y"], {"x": np.zeros((2, 60), np.float32)})  # K 60 where the packed weight has 64
    assert sess.run(["y"], {"x": np.zeros((0, 64), np.float32)})[0].shape == (0, 32)


def im2col(x: np.ndarray, width: int) -> np.ndarray:
    """(B, T, C) -> (B, T - width + 1, width * C): each row `width` frames side by side."""
    frames = x.shape[1] - width + 1
    return np.concatenate([x[:, i : i + frames] for i in range(width)], axis=2)


@pytest.mark.parametrize("frames", [23, 60, 5, 2])
def test_a_window_product_is_the_im2col_product_bit_for_bit(native_library: Path, frames: int) -> None:
    """window=3 reads each run of 3 frames where it lies (a causal convolution of our estimator twin): the same rows
    quantized the same way as the im2col copy's, so the same numbers, on one thread and two; too few frames: none."""
    w, bias = weights(3 * 40, 70)
    x = np.random.default_rng(frames).standard_normal((2, frames, 40)).astype(np.float32)
    x[1] *= 30.0
    copies = session(native_library, product_graph(w, 0.01, bias, rank=3)).run(["y"], {"x": im2col(x, 3)})[0]
    for threads in (1, 2):
        got = session(native_library, product_graph(w, 0.01, bias, rank=3, window=3), threads).run(["y"], {"x": x})[0]
        assert got.shape == (2, max(frames - 2, 0), 70)
        assert np.array_equal(got, copies)
    if frames > 2:
        want = reference(im2col(x, 3), w, 0.01, bias)
        np.testing.assert_allclose(copies, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_a_window_needs_frames_and_a_matching_weight(native_library: Path) -> None:
    w, bias = weights(3 * 16, 32)
    sess = session(native_library, product_graph(w, 0.01, bias, rank=1, window=3))
    with pytest.raises(Exception, match="Int8MatMul: window"):
        sess.run(["y"], {"x": np.zeros(16, np.float32)})  # no frame axis
    sess = session(native_library, product_graph(w, 0.01, bias, rank=3, window=3))
    with pytest.raises(Exception, match="Int8MatMul: x"):
        sess.run(["y"], {"x": np.zeros((1, 8, 20), np.float32)})  # 3 x 20 where the weight has 48


def test_the_probe_reports_the_int8_kernel(native_library: Path) -> None:
    """The variant comes from the library's one CPU probe and the operator's own table; the reason names the flags."""
    probe = native.probe(native_library, kernel="Int8MatMul")
    flags = native.cpu_features(native_library)
    assert flags is not None
    has_vnni = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags
    has_avx2 = {"avx2", "fma", "f16c"} <= flags
    assert probe.usable == (has_vnni or has_avx2)
    if has_vnni:
        assert probe.variant in ("avx512_vnni", "amx_int8")
    elif has_avx2:  # no AVX-512 VNNI: the AVX2 code (this host's, AMD Zen 3)
        assert probe.variant == "avx2"
        off = native.probe(native_library, kernel="Int8MatMul", avx2=False)  # native_on_avx2=false
        assert not off.usable and "native_on_avx2=false" in off.reason and "avx512_vnni" in off.reason
    else:
        assert "avx2, fma, f16c (Int8MatMul's avx2)" in probe.reason
    forced = native.probe(native_library, kernel="Int8MatMul", kernels="portable")
    assert forced.usable and forced.variant == "portable"  # asked for: the twins then run the portable C


def test_the_portable_kernel_computes_the_same(native_library: Path) -> None:
    """The kernel for CPUs without AVX-512 VNNI (forced here by the session's ceiling, on any CPU)."""
    w, bias = weights(70, 90)
    x = np.random.default_rng(3).standard_normal((9, 70)).astype(np.float32)
    (y,) = run_portable(native_library, product_graph(w, 0.01, bias), {"x": x})
    want = reference(x, w, 0.01, bias)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    frames = np.random.default_rng(4).standard_normal((1, 12, 35)).astype(np.float32)  # 2 x 35 = 70: a window of 2
    (y,) = run_portable(native_library, product_graph(w, 0.01, bias, rank=3, window=2), {"x": frames})
    want = reference(im2col(frames, 2), w, 0.01, bias)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


class _Exec(ctypes.Structure):
    """exec.h's cvl_exec."""

    _fields_ = [
        ("have", ctypes.c_uint32),
        ("spread", ctypes.c_int),
        ("parallel", ctypes.c_void_p),
        ("runner", ctypes.c_void_p),
    ]


class _Weight(ctypes.Structure):
    """int8_matmul.h's cvl_int8_weight."""

    _fields_ = [
        ("n", ctypes.c_int64),
        ("packed", ctypes.c_void_p),
        ("colsum", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("scale_count", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
    ]


@pytest.mark.parametrize("rows", [1, 7, 20])
def test_products_of_one_quantization_equal_separate_products(native_library: Path, rows: int) -> None:
    """cvl_int8_weight_matmuls (q, k and v, or gate and up, of one input) quantizes the rows once: each result is
    cvl_int8_weight_matmul's bit for bit, per-tensor or per-column scales, with or without a bias."""
    lib = ctypes.CDLL(str(native_library))
    lib.cvl_cpu_features.restype = ctypes.c_uint32
    ex = ctypes.byref(_Exec(lib.cvl_cpu_features(), 1, None, None))  # every variant the CPU has, one thread
    x = np.random.default_rng(rows).standard_normal((rows, 96)).astype(np.float32)
    keep: list[np.ndarray] = []  # the arrays the structs point into

    def weight(n: int, seed: int, scales: int, bias: bool) -> _Weight:
        w, b = weights(96, n, seed)
        packed, colsum = pack_int8_weight(w)
        s = np.random.default_rng(seed).uniform(0.001, 0.01, scales).astype(np.float32)
        keep.extend([packed, colsum, s, b])
        ptr = ctypes.c_void_p
        return _Weight(n, packed.ctypes.data, colsum.ctypes.data, s.ctypes.data, scales, ptr(b.ctypes.data if bias else None))

    ws = [weight(80, 1, 1, True), weight(64, 2, 64, False), weight(17, 3, 17, True)]
    alone = []
    for w in ws:
        y = np.zeros((rows, w.n), np.float32)
        assert lib.cvl_int8_weight_matmul(x.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(rows), ctypes.c_int64(96),
                                          ctypes.byref(w), y.ctypes.data_as(ctypes.c_void_p), None, ex) == 0  # fmt: skip
        alone.append(y)
    together = [np.zeros((rows, w.n), np.float32) for w in ws]
    weight_ptrs = (ctypes.POINTER(_Weight) * 3)(*(ctypes.pointer(w) for w in ws))
    outs = (ctypes.c_void_p * 3)(*(y.ctypes.data for y in together))
    assert lib.cvl_int8_weight_matmuls(x.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(rows), ctypes.c_int64(96),
                                       weight_ptrs, outs, 3, ex) == 0  # fmt: skip
    for a, b in zip(alone, together, strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.abs(together[0]).max() > 0
