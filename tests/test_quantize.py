"""Weight quantization schemes on the tiny bundle: which graphs change, the 4-bit node settings, deviation, and that it speaks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from export.quantize import INT4_BLOCK_SIZE, quantize_embeddings, step_deviation, write_quantized_bundle
from service.bundle import ModelBundle
from service.engine.sessions import RuntimeOptions
from service.engine.synthesizer import SynthesisOptions, Synthesizer


@pytest.fixture(scope="module")
def quantized(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    manifest = ModelBundle.load(tiny_bundle).manifest
    root = tmp_path_factory.mktemp("quantized")
    for scheme in ("int8", "int4"):
        write_quantized_bundle(tiny_bundle, root / scheme, manifest, scheme)  # type: ignore[arg-type]
    return {"int8": root / "int8", "int4": root / "int4"}


def _ops(path: Path) -> dict[str, list[onnx.NodeProto]]:
    nodes: dict[str, list[onnx.NodeProto]] = {}
    for node in onnx.load(str(path)).graph.node:
        nodes.setdefault(node.op_type, []).append(node)
    return nodes


def test_int4_changes_only_the_decode_step(quantized: dict[str, Path]) -> None:
    bundle = ModelBundle.load(quantized["int4"], verify_hashes=True)
    precisions = {n: g.precision for n, g in bundle.manifest.graphs.items()}
    assert bundle.manifest.precision == "int4" and bundle.manifest.model.endswith("-int4")
    assert precisions["llm_step"] == "int4"
    assert {n for n, p in precisions.items() if p == "int8"} == {"llm_encoder", "llm_embed", "flow_encoder", "flow_estimator"}
    assert all(precisions[n] == "fp32" for n in ("llm_pos", "flow_lr", "hift_f0", "hift_source", "hift_decode"))


def test_int4_step_uses_4bit_blocks_with_int8_compute(quantized: dict[str, Path]) -> None:
    ops = _ops(quantized["int4"] / "llm_step.onnx")
    nbits = ops.get("MatMulNBits", [])
    assert nbits, "no MatMulNBits node: the step was not quantized"
    for node in nbits:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (4, INT4_BLOCK_SIZE, 4)
    # only the attention products (two activations) are left as plain MatMul
    weights = {i.name for i in onnx.load(str(quantized["int4"] / "llm_step.onnx")).graph.initializer}
    assert not [n for n in ops.get("MatMul", []) if n.input[1] in weights]


def test_deviation_from_fp32_is_small_and_int4_is_coarser_than_int8(tiny_bundle: Path, quantized: dict[str, Path]) -> None:
    constants = ModelBundle.load(tiny_bundle).constants
    same = step_deviation(tiny_bundle, tiny_bundle, constants, tokens=8)
    int8 = step_deviation(tiny_bundle, quantized["int8"], constants, tokens=8)
    int4 = step_deviation(tiny_bundle, quantized["int4"], constants, tokens=8)
    assert same["logp_max_abs"] == 0.0 and same["top1_agreement"] == 1.0
    assert 0.0 < int8["logp_max_abs"] < int4["logp_max_abs"] < 1.0
    assert int4["top1_agreement"] >= 0.5


def test_int4_bundle_synthesizes(quantized: dict[str, Path]) -> None:
    synth = Synthesizer.load(quantized["int4"], RuntimeOptions(intra_op_threads=1, max_batch=0))
    chunks = list(synth.synthesize([[15947, 1002, 13]], synth.speakers[0], SynthesisOptions(seed=0)))
    audio = np.concatenate([c.audio for c in chunks])
    assert audio.size > 0 and np.isfinite(audio).all() and chunks[-1].is_final


def test_lookup_tables_become_int8_rows_with_row_scales(tiny_bundle: Path, tmp_path: Path) -> None:
    import onnxruntime as ort

    path = tmp_path / "llm_embed.onnx"
    path.write_bytes((tiny_bundle / "llm_embed.onnx").read_bytes())
    assert quantize_embeddings(path) == ["model.speech_embedding.weight"]
    assert quantize_embeddings(path) == []  # nothing left to convert
    tables = {i.name: i for i in onnx.load(str(path)).graph.initializer}
    assert tables["model.speech_embedding.weight.rows_int8"].data_type == onnx.TensorProto.INT8
    tokens = np.arange(0, 4096, 7, dtype=np.int64).reshape(1, -1)
    want = ort.InferenceSession(str(tiny_bundle / "llm_embed.onnx")).run(None, {"token": tokens})[0]
    got = ort.InferenceSession(str(path)).run(None, {"token": tokens})[0]
    row_peak = np.abs(want).max(axis=-1, keepdims=True)
    assert np.all(np.abs(got - want) <= row_peak / 254 + 1e-7)  # half a quantization step per row
    assert np.abs(got - want).max() > 0
