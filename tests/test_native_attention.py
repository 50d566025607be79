"""Our native kernel cosyvoice_lite.CachedAttention (service/engine/native) through the installed ONNX Runtime: every
shape the estimator gives it against a float64 numpy reference, and a clear error for inputs that disagree."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from service.bundle import NATIVE_DOMAIN
from service.engine import native


def attention_graph(heads: int, head_dim: int) -> bytes:
    node = helper.make_node(
        "CachedAttention", ["q", "k", "v", "past_k", "past_v", "chunk"], ["out"], domain=NATIVE_DOMAIN,
        heads=heads, scale=head_dim**-0.5,
    )  # fmt: skip
    # symbolic sizes: inputs that disagree reach the kernel, which must refuse them itself
    new = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "M", "D"]) for n in ("q", "k", "v")]
    past = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, ["B", "C", "H", "DK"]) for n in ("past_k", "past_v")]
    chunk = helper.make_tensor_value_info("chunk", TensorProto.INT64, ["one"])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", "M", "D"])
    graph = helper.make_graph([node], "attention", [*new, *past, chunk], [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(NATIVE_DOMAIN, 1)])
    model.ir_version = 8
    return model.SerializeToString()


def session(native_library: Path, heads: int, head_dim: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.register_custom_ops_library(str(native_library))
    return ort.InferenceSession(attention_graph(heads, head_dim), so, providers=["CPUExecutionProvider"])


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, pk: np.ndarray, pv: np.ndarray, chunk: int) -> np.ndarray:
    """The estimator's attention (export/cosyvoice2/modules/estimator.py CachedAttention) in float64."""
    b, m, _ = q.shape
    c, heads, head_dim = pk.shape[1:]
    split = lambda x: x.astype(np.float64).reshape(b, -1, heads, head_dim).transpose(0, 2, 1, 3)  # noqa: E731
    keys = np.concatenate([split(pk.reshape(b, c, heads * head_dim)), split(k)], axis=2)
    values = np.concatenate([split(pv.reshape(b, c, heads * head_dim)), split(v)], axis=2)
    scores = split(q) @ keys.transpose(0, 1, 3, 2) * head_dim**-0.5
    pos = c + np.arange(m)
    seen = np.concatenate([np.ones((m, c), bool), pos[None, :] // chunk <= pos[:, None] // chunk], axis=1)
    scores = np.where(seen, scores, -1e10)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ values).transpose(0, 2, 1, 3).reshape(b, m, heads * head_dim)


CASES = [  # batch, new frames, cached frames, heads, head dim, frames per attention chunk
    (1, 50, 200, 8, 64, 50),  # a streamed chunk after the prompt window and three chunks
    (2, 26, 37, 8, 64, 50),  # both guidance rows, a first chunk that ends inside its attention chunk
    (1, 70, 0, 8, 64, 50),  # more frames than one tile of query lanes, two attention chunks among them
    (1, 130, 30, 2, 64, 1 << 30),  # full attention (a sentence not streamed), odd key count
    (1, 1, 0, 8, 64, 50),  # one frame, nothing cached
    (1, 7, 600, 8, 32, 50),
    (2, 5, 1, 8, 16, 4),  # the tiny test model's heads
    (1, 9, 11, 3, 24, 5),  # a head size the bf16 kernel does not take: the portable kernel
]


def attention_feeds(batch: int, new: int, cached: int, heads: int, head_dim: int, chunk: int) -> dict[str, np.ndarray]:
    """Random q, k, v of `new` frames and float16 caches of `cached`, seeded by the shape."""
    rng = np.random.default_rng(new * 1000 + cached)
    q, k, v = (rng.standard_normal((batch, new, heads * head_dim)).astype(np.float32) for _ in range(3))
    pk, pv = (rng.standard_normal((batch, cached, heads, head_dim)).astype(np.float16) for _ in range(2))
    return {"q": q, "k": k, "v": v, "past_k": pk, "past_v": pv, "chunk": np.array([chunk], np.int64)}


def feeds_reference(feeds: dict[str, np.ndarray]) -> np.ndarray:
    return reference(feeds["q"], feeds["k"], feeds["v"], feeds["past_k"], feeds["past_v"], int(feeds["chunk"][0]))


@pytest.mark.parametrize(("batch", "new", "cached", "heads", "head_dim", "chunk"), CASES)
def test_cached_attention_matches_the_estimators_attention(
    native_library: Path, batch: int, new: int, cached: int, heads: int, head_dim: int, chunk: int
) -> None:
    feeds = attention_feeds(batch, new, cached, heads, head_dim, chunk)
    got = session(native_library, heads, head_dim).run(["out"], feeds)[0]
    want = feeds_reference(feeds)
    rel = float(np.sqrt(((got - want) ** 2).mean() / (want**2).mean()))
    # bf16 products (8-bit mantissa) with float32 sums: ~0.3 % relative; the AVX2 and portable kernels are float32
    bound = 1e-2 if native.probe(native_library, head_dim).variant.endswith("bf16") else 1e-5
    assert got.shape == want.shape
    assert rel < bound, f"relative RMS {rel:.2e}"


def test_inputs_that_disagree_are_an_error_not_a_crash(native_library: Path) -> None:
    sess = session(native_library, 8, 64)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 512)).astype(np.float32)
    past = rng.standard_normal((1, 3, 4, 128)).astype(np.float16)  # 4 heads in the cache, 8 in the node
    feeds = {"q": q, "k": q, "v": q, "past_k": past, "past_v": past, "chunk": np.array([50], np.int64)}
    with pytest.raises(Exception, match="CachedAttention: q, k, v"):
        sess.run(["out"], feeds)
    feeds |= {"past_k": past.reshape(1, 3, 8, 64), "past_v": past.reshape(1, 3, 8, 64), "chunk": np.array([0], np.int64)}
    with pytest.raises(Exception, match="chunk must be >= 1"):
        sess.run(["out"], feeds)


def test_the_probe_says_why_the_kernels_cannot_run(tmp_path: Path) -> None:
    missing = native.probe(tmp_path / "libcosyvoice_lite_native.so")
    assert not missing.usable and "make native" in missing.reason
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"not a library")
    assert not native.probe(broken).usable and "does not load" in native.probe(broken).reason
