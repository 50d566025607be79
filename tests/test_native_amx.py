"""Our kernels on AMX tiles (service/engine/native/amx.c, attention_amx.c) against their AVX-512 code in a process that
refuses AMX (COSYVOICE_LITE_AMX=0): the int8 products give the same numbers bit for bit (the same integer sums and
the same quantization), the attention and a whole estimator block agree to bf16 rounding. Skipped on CPUs without AMX,
where the AVX-512 code is the only one (tests/test_native_int8.py and test_native_attention.py check it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from portable import run_isolated
from test_native_attention import attention_graph, reference
from test_native_attention import session as attention_session
from test_native_int8 import product_graph, session, weights

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
    (vnni,) = run_isolated(native_library, model, {"x": x}, tmp_path, "no-amx")
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
    rng = np.random.default_rng(new * 1000 + cached)
    q, k, v = (rng.standard_normal((batch, new, heads * head_dim)).astype(np.float32) for _ in range(3))
    pk, pv = (rng.standard_normal((batch, cached, heads, head_dim)).astype(np.float16) for _ in range(2))
    feeds = {"q": q, "k": k, "v": v, "past_k": pk, "past_v": pv, "chunk": np.array([chunk], np.int64)}
    tiles = attention_session(native_library, heads, head_dim).run(["out"], feeds)[0]
    (vector,) = run_isolated(native_library, attention_graph(heads, head_dim), feeds, tmp_path, "no-amx")
    want = reference(q, k, v, pk, pv, chunk)
    rms = lambda a: float(np.sqrt((a**2).mean()))  # noqa: E731
    # the same bf16 roundings of q, k, v and the probabilities; only the order of the float32 sums differs
    assert rms(tiles - vector) < 1e-3 * rms(want)
    assert rms(tiles - want) < 1e-2 * rms(want)
