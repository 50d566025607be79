"""Our kernels on AMX tiles (service/engine/native/amx.c, attention_heads.c) against their AVX-512 code in a process that
refuses AMX (COSYVOICE_LITE_AMX=0): the int8 products give the same numbers bit for bit (the same integer sums and
the same quantization), the estimator's attention and an LLM layer's prefill agree to bf16 rounding. Skipped on CPUs
without AMX, where the AVX-512 code is the only one (tests/test_native_int8.py, test_native_attention.py and
test_native_qwen2.py check it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from portable import run_isolated
from test_native_attention import attention_feeds, attention_graph, feeds_reference
from test_native_attention import session as attention_session
from test_native_int8 import product_graph, session, weights

from export.fuse_ops import pack_int8_weight
from service.bundle import NATIVE_DOMAIN
from service.engine import native


@pytest.fixture(scope="module")
def amx(native_library: Path) -> None:
    if not native.amx_tiles(native_library):
        pytest.skip("this CPU (or the kernel) gives no AMX tiles: the AVX-512 code is the only one")


PRODUCTS = [  # rows, k, n, with bias
    (8, 64, 64, True),  # the fewest rows that take tiles: one row tile of 8 zero rows, one k block, one panel
    (12, 256, 768, False),  # an estimator chunk's frames
    (17, 256, 768, False),  # a second row tile of one row
    (33, 100, 130, True),  # a partial k block (copied beside zeros) and a partial panel
    (50, 256, 1024, False),  # a whole attention chunk's frames
    (100, 1024, 256, True),  # both guidance rows, a product over ff's width
    (285, 896, 200, False),  # a 10 s prompt's prefill: many row blocks
]


@pytest.mark.parametrize(("rows", "k", "n", "with_bias"), PRODUCTS)
def test_tile_products_are_the_vnni_products_bit_for_bit(
    native_library: Path, amx: None, tmp_path: Path, rows: int, k: int, n: int, with_bias: bool
) -> None:
    w, b = weights(k, n, rows)
    bias = b if with_bias else None
    x = np.random.default_rng(rows + k).standard_normal((rows, k)).astype(np.float32)
    x[-1] = np.abs(x[-1])  # a row with zero point 0
    model = product_graph(w, 0.0123, bias)
    tiles = session(native_library, model).run(["y"], {"x": x})[0]
    (vnni,) = run_isolated(native_library, model, {"x": x}, "no-amx")
    np.testing.assert_array_equal(tiles, vnni)


def test_tile_products_are_the_same_on_two_threads(native_library: Path, amx: None) -> None:
    """Panels shared over ONNX Runtime's threads: every task configures and releases its own tiles."""
    w, _ = weights(512, 1536, 3)
    x = np.random.default_rng(3).standard_normal((64, 512)).astype(np.float32)
    model = product_graph(w, 0.01, None)
    one = session(native_library, model, threads=1).run(["y"], {"x": x})[0]
    two = session(native_library, model, threads=2).run(["y"], {"x": x})[0]
    np.testing.assert_array_equal(one, two)


ATTENTION = [  # batch, new frames, cached frames, heads, head dim, frames per attention chunk
    (1, 50, 200, 8, 64, 50),
    (2, 26, 37, 8, 64, 50),  # both guidance rows, a chunk ending inside its attention chunk
    (1, 6, 0, 8, 64, 50),  # a first chunk: one frame block, one key block
    (1, 130, 30, 2, 64, 1 << 30),  # full attention, keys not a multiple of 32
    (1, 7, 600, 8, 32, 50),  # head size 32: one query half
]


@pytest.mark.parametrize(("batch", "new", "cached", "heads", "head_dim", "chunk"), ATTENTION)
def test_tile_attention_agrees_with_the_vector_kernel(
    native_library: Path, amx: None, tmp_path: Path, batch: int, new: int, cached: int, heads: int, head_dim: int, chunk: int
) -> None:
    feeds = attention_feeds(batch, new, cached, heads, head_dim, chunk)
    tiles = attention_session(native_library, heads, head_dim).run(["out"], feeds)[0]
    (vector,) = run_isolated(native_library, attention_graph(heads, head_dim), feeds, "no-amx")
    want = feeds_reference(feeds)
    rms = lambda a: float(np.sqrt((a**2).mean()))  # noqa: E731
    # the same bf16 roundings of q, k, v and the probabilities; only the order of the float32 sums differs
    assert rms(tiles - vector) < 1e-3 * rms(want)
    assert rms(tiles - want) < 1e-2 * rms(want)


def qwen2_layer_graph(dim: int, heads: int, kv_heads: int, head_dim: int, ff: int, seed: int = 0) -> bytes:
    """One cosyvoice_lite.Qwen2Layer node with random int8 weights (per-tensor scales, q/k/v biases)."""
    rng = np.random.default_rng(seed)
    arrays: list[tuple[str, np.ndarray]] = [("rms1", (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32))]

    def weight(name: str, k: int, n: int, bias: bool) -> None:
        packed, colsum = pack_int8_weight(rng.integers(-64, 64, (k, n), dtype=np.int8))
        arrays.extend(
            [(f"{name}_packed", packed), (f"{name}_colsum", colsum), (f"{name}_scale", np.array([0.6 / k], np.float32))]
        )
        if bias:
            arrays.append((f"{name}_bias", (0.1 * rng.standard_normal(n)).astype(np.float32)))

    weight("q", dim, heads * head_dim, True)
    weight("k", dim, kv_heads * head_dim, True)
    weight("v", dim, kv_heads * head_dim, True)
    weight("o", heads * head_dim, dim, False)
    arrays.append(("rms2", (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)))
    for name, (k, n) in (("gate", (dim, ff)), ("up", (dim, ff)), ("down", (ff, dim))):
        weight(name, k, n, False)
    names = ["x", "past_k", "past_v", "mask", "cos", "sin", *(name for name, _ in arrays)]
    node = helper.make_node(
        "Qwen2Layer", names, ["y", "k", "v"], domain=NATIVE_DOMAIN, heads=heads, ff=ff, scale=head_dim**-0.5, eps=1e-6
    )
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", dim]),
        helper.make_tensor_value_info("past_k", TensorProto.FLOAT16, ["B", kv_heads, "C", head_dim]),
        helper.make_tensor_value_info("past_v", TensorProto.FLOAT16, ["B", kv_heads, "C", head_dim]),
        helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["B", 1, "T", "W"]),
        helper.make_tensor_value_info("cos", TensorProto.FLOAT, ["B", 1, "T", head_dim]),
        helper.make_tensor_value_info("sin", TensorProto.FLOAT, ["B", 1, "T", head_dim]),
    ]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "k", "v")]
    model = helper.make_model(
        helper.make_graph([node], "layer", inputs, outputs, [numpy_helper.from_array(a, n) for n, a in arrays]),
        opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(NATIVE_DOMAIN, 1)],
    )
    model.ir_version = 8
    return model.SerializeToString()


def prefill_feeds(batch: int, steps: int, cached: int, dim: int, kv_heads: int, head_dim: int) -> dict[str, np.ndarray]:
    """A prefill of `steps` tokens after `cached` ones: causal mask, and in row 1 a few padded columns dropped."""
    rng = np.random.default_rng(steps + cached)
    angle = rng.uniform(0, 6.3, (batch, 1, steps, head_dim)).astype(np.float32)
    mask = np.zeros((batch, 1, steps, cached + steps), np.float32)
    mask[..., cached:] = np.where(np.triu(np.ones((steps, steps), bool), 1), -1e30, 0.0)
    if batch > 1:
        mask[1, ..., 1:3] = -1e30  # dropped in the middle of a row, as a padded prompt's are
    return {
        "x": rng.standard_normal((batch, steps, dim)).astype(np.float32),
        "past_k": rng.standard_normal((batch, kv_heads, cached, head_dim)).astype(np.float16),
        "past_v": rng.standard_normal((batch, kv_heads, cached, head_dim)).astype(np.float16),
        "mask": mask,
        "cos": np.cos(angle),
        "sin": np.sin(angle),
    }


@pytest.mark.parametrize(("batch", "steps", "cached", "head_dim"), [(1, 40, 0, 64), (2, 17, 5, 64), (1, 33, 0, 32)])
def test_a_prefill_takes_its_attention_on_tiles(
    native_library: Path, amx: None, tmp_path: Path, batch: int, steps: int, cached: int, head_dim: int
) -> None:
    """16 new tokens or more: the attention on bf16 tiles (grouped heads, the additive mask), the products as ever.
    The new keys and values come before the attention (the same bits); the layer's output within bf16 rounding."""
    dim, heads, kv_heads, ff = 256, 4, 2, 384
    model = qwen2_layer_graph(dim, heads, kv_heads, head_dim, ff)
    feeds = prefill_feeds(batch, steps, cached, dim, kv_heads, head_dim)
    tiles = session(native_library, model).run(None, feeds)
    vector = run_isolated(native_library, model, feeds, "no-amx")
    np.testing.assert_array_equal(tiles[1], vector[1])
    np.testing.assert_array_equal(tiles[2], vector[2])
    y, want = tiles[0].astype(np.float64), vector[0].astype(np.float64)
    assert np.isfinite(y).all()
    # bf16 products in the attention (~0.3 % on its own), then amplified where a rounding of the next products'
    # activation quantization flips: the bound test_native_qwen2.py gives two float32 summation orders
    assert float(np.sqrt(((y - want) ** 2).mean() / (want**2).mean())) < 0.02
