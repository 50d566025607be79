"""Our native kernel cosyvoice_lite.Qwen2Layer (service/engine/native/qwen2_layer.c): a CosyVoice2 LLM decoder layer in
one call. The rewrite that puts it into the step twin (export/fuse_layers.fuse_qwen2_layers) against the twin with
only its int8 products as our kernel: prefill, batched decode rows at different cache lengths, several new tokens
per row; the portable code against the vector code; what the rewrite refuses."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from portable import run_portable
from test_native_twin import relative_rms, step_feeds

from export.fuse_layers import fuse_qwen2_layers
from export.fuse_ops import fuse_int8_matmuls
from export.twin_graph import QWEN2_OP_NAME, RewriteError
from service.bundle import ModelBundle


def unfused_step(tiny_v2_bundle: Path) -> onnx.ModelProto:
    model = onnx.load(str(tiny_v2_bundle / "llm_step.onnx"))
    fuse_int8_matmuls(model)
    return model


def session(native_library: Path, model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(native_library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def fused_step(tiny_v2_bundle: Path) -> onnx.ModelProto:
    model = unfused_step(tiny_v2_bundle)
    layers = ModelBundle.load(tiny_v2_bundle).constants.llm_num_layers
    assert fuse_qwen2_layers(model) == layers
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count(QWEN2_OP_NAME) == layers and ops.count("Int8MatMul") == 1  # the speech decoder's product stays
    assert "Softmax" not in ops and "Sigmoid" not in ops
    return model


@pytest.mark.parametrize(
    ("past_len", "cached", "steps"),
    [([0], 0, 9), ([7], 7, 1), ([12, 5, 9], 12, 1), ([6, 2], 6, 3)],
    ids=["prefill", "decode", "batch at different lengths", "several new tokens"],
)
def test_the_layer_rewrite_computes_what_the_unfused_twin_computes(
    tiny_v2_bundle: Path, native_library: Path, fused_step: onnx.ModelProto, past_len: list[int], cached: int, steps: int
) -> None:
    unfused = session(native_library, unfused_step(tiny_v2_bundle))
    feeds = step_feeds(unfused, len(past_len), steps, cached, past_len)
    want = unfused.run(None, feeds)
    got = session(native_library, fused_step).run(None, feeds)
    for name, a, b in zip(("logp", "new_k", "new_v"), want, got, strict=True):
        assert a.shape == b.shape, name
        # the same products; RMSNorm's sum, SiLU and the softmax in another order can flip a rounding of the next
        # layer's activation quantization
        assert relative_rms(a, b) < 0.02, name


def test_the_portable_kernel_computes_the_same(native_library: Path, fused_step: onnx.ModelProto, tmp_path: Path) -> None:
    fused = session(native_library, fused_step)
    feeds = step_feeds(fused, 2, 2, 12, [12, 5])
    fast = fused.run(None, feeds)
    portable = run_portable(native_library, fused_step.SerializeToString(), feeds)
    for name, a, b in zip(("logp", "new_k", "new_v"), fast, portable, strict=True):
        assert relative_rms(a, b) < 0.02, name


def test_a_layer_without_its_pieces_is_refused(tiny_v2_bundle: Path) -> None:
    model = unfused_step(tiny_v2_bundle)
    gate = next(n for n in model.graph.node if n.output[0] == "/layers.1/mlp/gate_proj/MatMul_output_0")
    gate.output[0] = "elsewhere"
    with pytest.raises(RewriteError, match="gate"):
        fuse_qwen2_layers(model)
