"""Our native kernel cosyvoice_lite.EstimatorBlock (service/engine/native/estimator_block.c): one transformer block of
the CosyVoice2 flow estimator against a numpy reference of the block (LayerNorms, per-row quantized int8 products, the
chunk-masked cached attention, exact GELU, residuals); the rewrite that puts it into the estimator twin
(export/fuse_layers.fuse_blocks) against the twin without it."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from portable import run_portable
from test_native_int8 import reference as int8_product

from export.fuse_layers import fuse_blocks
from export.fuse_ops import fuse_attention, fuse_int8_matmuls, pack_int8_weight
from export.twin_graph import BLOCK_OP_NAME, RewriteError
from service.bundle import NATIVE_DOMAIN, ModelBundle
from service.families.cosyvoice2.contract import constants_of


def block_params(dim: int, heads: int, head_dim: int, ff: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hd = heads * head_dim

    def w(k: int, n: int) -> np.ndarray:
        return rng.integers(-64, 64, (k, n), dtype=np.int8)

    def f(n: int, scale: float = 1.0, shift: float = 0.0) -> np.ndarray:
        return (rng.standard_normal(n) * scale + shift).astype(np.float32)

    return {
        "ln1_w": f(dim, 0.2, 1.0), "ln1_b": f(dim, 0.1), "ln3_w": f(dim, 0.2, 1.0), "ln3_b": f(dim, 0.1),
        "wq": w(dim, hd), "wk": w(dim, hd), "wv": w(dim, hd), "qkv_scales": np.array([0.004, 0.005, 0.003], np.float32),
        "w_out": w(hd, dim), "out_scale": np.array([0.002], np.float32), "out_bias": f(dim, 0.1),
        "w_ff1": w(dim, ff), "ff1_scale": np.array([0.003], np.float32), "ff1_bias": f(ff, 0.1),
        "w_ff2": w(ff, dim), "ff2_scale": np.array([0.001], np.float32), "ff2_bias": f(dim, 0.1),
    }  # fmt: skip


def block_graph(p: dict[str, np.ndarray], heads: int, scale: float, eps: float = 1e-5) -> bytes:
    hd = p["wq"].shape[1]
    qkv_packed, qkv_colsum = pack_int8_weight(np.concatenate([p["wq"], p["wk"], p["wv"]], axis=1))
    arrays: list[tuple[str, np.ndarray]] = [
        ("ln1_w", p["ln1_w"]), ("ln1_b", p["ln1_b"]),
        ("qkv_packed", qkv_packed), ("qkv_colsum", qkv_colsum), ("qkv_scale", np.repeat(p["qkv_scales"], hd)),
    ]  # fmt: skip
    for part in ("out", "ff1", "ff2"):
        if part == "ff1":
            arrays += [("ln3_w", p["ln3_w"]), ("ln3_b", p["ln3_b"])]
        packed, colsum = pack_int8_weight(p[f"w_{part}"])
        arrays += [(f"{part}_packed", packed), (f"{part}_colsum", colsum), (f"{part}_scale", p[f"{part}_scale"])]
        arrays.append((f"{part}_bias", p[f"{part}_bias"]))
    node = helper.make_node(
        BLOCK_OP_NAME, ["x", "past_k", "past_v", "chunk", *(name for name, _ in arrays)], ["y", "k", "v"],
        domain=NATIVE_DOMAIN, heads=heads, scale=scale, eps1=eps, eps3=eps,
    )  # fmt: skip
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "M", "D"]),
        helper.make_tensor_value_info("past_k", TensorProto.FLOAT16, ["B", "C", heads, hd // heads]),
        helper.make_tensor_value_info("past_v", TensorProto.FLOAT16, ["B", "C", heads, hd // heads]),
        helper.make_tensor_value_info("chunk", TensorProto.INT64, [1]),
    ]
    outputs = [
        helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("k", TensorProto.FLOAT16, None),
        helper.make_tensor_value_info("v", TensorProto.FLOAT16, None),
    ]
    model = helper.make_model(
        helper.make_graph([node], "block", inputs, outputs, [numpy_helper.from_array(a, n) for n, a in arrays]),
        opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(NATIVE_DOMAIN, 1)],
    )
    model.ir_version = 8
    return model.SerializeToString()


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    x = x.astype(np.float64)
    mean = x.mean(-1, keepdims=True)
    return ((x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * w + b).astype(np.float32)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, past_k: np.ndarray, past_v: np.ndarray, heads: int,
              scale: float, chunk: int) -> np.ndarray:  # fmt: skip
    """Each new frame i (position C + i) sees every cached position and new position C + j in a chunk not after its
    own (cached_attention.h)."""
    b, m, hd = q.shape
    c, dk = past_k.shape[1], hd // heads
    keys = np.concatenate([past_k.astype(np.float64), k.reshape(b, m, heads, dk)], axis=1)
    values = np.concatenate([past_v.astype(np.float64), v.reshape(b, m, heads, dk)], axis=1)
    pos = np.arange(c + m)
    seen = (pos[None, :] // chunk) <= ((c + np.arange(m))[:, None] // chunk)  # (m, c + m)
    scores = np.einsum("bmhd,bthd->bhmt", q.reshape(b, m, heads, dk).astype(np.float64), keys) * scale
    scores = np.where(seen[None, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhmt,bthd->bmhd", probs, values).reshape(b, m, hd).astype(np.float32)


def block_reference(p: dict[str, np.ndarray], x: np.ndarray, past_k: np.ndarray, past_v: np.ndarray, heads: int,
                    scale: float, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    h1 = layer_norm(x, p["ln1_w"], p["ln1_b"])
    q, k, v = (
        int8_product(h1, p[w], float(s), None).astype(np.float32)
        for w, s in zip(("wq", "wk", "wv"), p["qkv_scales"], strict=True)
    )
    att = attention(q, k, v, past_k, past_v, heads, scale, chunk)
    h = int8_product(att, p["w_out"], float(p["out_scale"][0]), p["out_bias"]).astype(np.float32) + x
    f = int8_product(layer_norm(h, p["ln3_w"], p["ln3_b"]), p["w_ff1"], float(p["ff1_scale"][0]), p["ff1_bias"])
    f = (0.5 * f * (1.0 + np.vectorize(math.erf)(f / math.sqrt(2.0)))).astype(np.float32)
    y = int8_product(f, p["w_ff2"], float(p["ff2_scale"][0]), p["ff2_bias"]).astype(np.float32) + h
    return y, k, v


def relative_rms(want: np.ndarray, got: np.ndarray) -> float:
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    return float(np.sqrt(((got - want) ** 2).mean() / max((want**2).mean(), 1e-30)))


def block_inputs(
    batch: int, frames: int, cached: int, dim: int, heads: int, head_dim: int, seed: int = 1
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((batch, frames, dim)).astype(np.float32),
        "past_k": rng.standard_normal((batch, cached, heads, head_dim)).astype(np.float16),
        "past_v": rng.standard_normal((batch, cached, heads, head_dim)).astype(np.float16),
        "chunk": np.array([4], np.int64),
    }


def session(native_library: Path, model: bytes) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.register_custom_ops_library(str(native_library))
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


# (batch, frames, cached, dim, heads, head_dim, ff): the estimator's shapes shrunk; head_dim 12 takes the portable
# attention and the path where q, k, v are not written in place (heads x head_dim not a multiple of 16)
SHAPES = [(1, 9, 0, 64, 4, 16, 128), (1, 7, 13, 64, 8, 16, 256), (2, 5, 6, 96, 2, 32, 192), (1, 6, 5, 40, 2, 12, 80)]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_block_computes_the_reference_block(native_library: Path, shape: tuple[int, ...]) -> None:
    batch, frames, cached, dim, heads, head_dim, ff = shape
    p = block_params(dim, heads, head_dim, ff)
    scale = head_dim**-0.5
    feeds = block_inputs(batch, frames, cached, dim, heads, head_dim)
    y, k, v = session(native_library, block_graph(p, heads, scale)).run(None, feeds)
    want_y, want_k, want_v = block_reference(p, feeds["x"], feeds["past_k"], feeds["past_v"], heads, scale, 4)
    # k and v are the block's first products: exactly the reference's (same quantization, same integer sums), handed
    # out as the caches keep them: float16 (rounded as a Cast rounds), (1, B, M, H, DK)
    assert k.shape == v.shape == (1, batch, frames, heads, head_dim) and k.dtype == np.float16
    np.testing.assert_array_equal(k.reshape(want_k.shape), want_k.astype(np.float16))
    np.testing.assert_array_equal(v.reshape(want_v.shape), want_v.astype(np.float16))
    # y passes the bf16 attention (fast kernel) and three re-quantizations: a rounding that flips moves a value by
    # one step of its row's scale
    assert y.shape == want_y.shape
    assert relative_rms(want_y, y) < 2e-2


def test_a_rows_result_does_not_depend_on_its_batch(native_library: Path) -> None:
    p = block_params(64, 4, 16, 128)
    sess = session(native_library, block_graph(p, 4, 0.25))
    feeds = block_inputs(3, 7, 5, 64, 4, 16)
    together = sess.run(None, feeds)
    alone = sess.run(None, {name: a[1:2] if name != "chunk" else a for name, a in feeds.items()})
    np.testing.assert_array_equal(together[0][1:2], alone[0])
    for got, want in zip(together[1:], alone[1:], strict=True):
        np.testing.assert_array_equal(got[:, 1:2], want)


def test_inputs_that_disagree_are_an_error_not_a_crash(native_library: Path) -> None:
    p = block_params(64, 4, 16, 128)
    sess = session(native_library, block_graph(p, 4, 0.25))
    feeds = block_inputs(1, 3, 2, 64, 4, 16)
    feeds["x"] = feeds["x"][..., :32]  # the LayerNorm and the weights are for 64
    with pytest.raises(Exception, match="EstimatorBlock: x"):
        sess.run(None, feeds)
    feeds = block_inputs(1, 3, 2, 64, 4, 16)
    feeds["chunk"] = np.array([0], np.int64)
    with pytest.raises(Exception, match="chunk must be >= 1"):
        sess.run(None, feeds)
    empty = sess.run(None, block_inputs(1, 0, 2, 64, 4, 16))
    assert [a.shape for a in empty] == [(1, 0, 64), (1, 1, 0, 4, 16), (1, 1, 0, 4, 16)]


def test_the_portable_kernels_compute_the_same(native_library: Path, tmp_path: Path) -> None:
    """Without AVX-512 (forced here) the block runs the portable products, attention (float32) and element-wise
    code: close to the reference in float32."""
    p = block_params(64, 4, 16, 128)
    feeds = block_inputs(1, 7, 13, 64, 4, 16)
    y, k, _ = run_portable(native_library, block_graph(p, 4, 0.25), feeds)
    want, want_k, _ = block_reference(p, feeds["x"], feeds["past_k"], feeds["past_v"], 4, 0.25, 4)
    assert relative_rms(want, y) < 5e-3
    np.testing.assert_array_equal(k.reshape(want_k.shape), want_k.astype(np.float16))


def unfused_twin(tiny_v2_bundle: Path) -> onnx.ModelProto:
    model = onnx.load(str(tiny_v2_bundle / "flow_estimator.onnx"))
    fuse_attention(model)
    fuse_int8_matmuls(model)
    return model


@pytest.mark.parametrize(("cached", "new"), [(0, 9), (13, 8), (40, 3)])
def test_the_block_rewrite_computes_what_the_unfused_twin_computes(
    tiny_v2_bundle: Path, native_library: Path, tmp_path: Path, cached: int, new: int
) -> None:
    from test_native_twin import estimator_feeds

    model = unfused_twin(tiny_v2_bundle)
    onnx.save(model, str(tmp_path / "unfused.onnx"))
    blocks = constants_of(ModelBundle.load(tiny_v2_bundle).manifest).estimator_blocks
    assert fuse_blocks(model) == blocks
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count(BLOCK_OP_NAME) == blocks and "CachedAttention" not in ops and "Erf" not in ops
    onnx.save(model, str(tmp_path / "fused.onnx"))
    unfused = session(native_library, (tmp_path / "unfused.onnx").read_bytes())
    fused = session(native_library, (tmp_path / "fused.onnx").read_bytes())
    feeds = estimator_feeds(unfused, cached, new)
    for output, want, got in zip(unfused.get_outputs(), unfused.run(None, feeds), fused.run(None, feeds), strict=True):
        # the same products on the same quantized rows; GELU's erf and the LayerNorms' sums in another order can flip
        # a rounding of the next quantization (measured: 0 to 2 % full-size, 0 to 1.3 % here)
        assert relative_rms(want, got) < 0.03, output.name


def test_a_block_read_from_outside_is_refused(tiny_v2_bundle: Path) -> None:
    """A tensor inside a block that something else reads (here: made a graph output) cannot disappear into the kernel."""
    model = unfused_twin(tiny_v2_bundle)
    attention = next(n for n in model.graph.node if n.op_type == "CachedAttention")
    model.graph.output.append(helper.make_tensor_value_info(attention.output[0], TensorProto.FLOAT, None))
    with pytest.raises(RewriteError, match="is read outside it"):
        fuse_blocks(model)


def test_the_committed_twins_are_what_the_exporter_writes_now(tiny_v2_bundle: Path, tmp_path: Path) -> None:
    """`python -m export.add_twins --replace` writes the committed twin again unchanged (it is the exporter's)."""
    copy = tmp_path / "bundle"
    shutil.copytree(tiny_v2_bundle, copy)
    from export.add_twins import main

    assert main(["--replace", str(copy)]) == 0
    for name in ("flow_estimator_native.onnx", "llm_step_native.onnx"):
        assert (copy / name).read_bytes() == (tiny_v2_bundle / name).read_bytes(), name
