"""Weight quantization schemes on the tiny bundle: which graphs change, the 4-bit node settings, deviation, and that it speaks."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest

from export.quantize import (
    INT4_BLOCK_SIZE,
    kv_cache_dtype,
    quantize_embeddings,
    quantize_graph,
    step_deviation,
    write_quantized_bundle,
)
from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.engine.scheduler import BatchScheduler
from service.engine.sessions import open_sessions
from service.engine.types import SynthesisOptions
from service.families.cosyvoice1.engine import Synthesizer
from service.families.cosyvoice1.llm import LLM_GRAPHS, CosyVoice1LLM


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


def test_quantized_decode_steps_take_a_float16_kv_cache(tiny_bundle: Path, quantized: dict[str, Path]) -> None:
    """Both quantized bundles widen a float16 cache inside the graph; the fp32 bundle (parity) keeps float32."""
    assert kv_cache_dtype(tiny_bundle / "llm_step.onnx") == "float32"
    for scheme in ("int8", "int4"):
        path = quantized[scheme] / "llm_step.onnx"
        assert kv_cache_dtype(path) == "float16"
        widen = [n for n in _ops(path)["Cast"] if n.input[0].startswith(("past_k_", "past_v_"))]
        assert len(widen) == 2 * ModelBundle.load(tiny_bundle).constants.llm_num_layers


def test_engine_keeps_the_cache_in_the_graph_type(tiny_bundle: Path, quantized: dict[str, Path]) -> None:
    """The runner reads the cache type off the graph. Teacher-forced log-probs through a float16 cache stay within
    the int8 deviation of the fp32 bundle, and batched requests run to their lengths. (Batched int8 rows do not
    equal single rows token for token: activations are quantized per tensor, over the whole batch.)"""
    bundle, reference = ModelBundle.load(quantized["int8"]), ModelBundle.load(tiny_bundle)
    runner = CosyVoice1LLM(open_sessions(bundle, RuntimeOptions(intra_op_threads=1), names=LLM_GRAPHS), bundle.constants)
    fp32 = CosyVoice1LLM(open_sessions(reference, RuntimeOptions(intra_op_threads=1), names=LLM_GRAPHS), reference.constants)
    assert runner.kv_dtype is np.float16 and runner.new_batch().cache.k[0].dtype == np.float16
    assert fp32.kv_dtype is np.float32
    emb = np.random.default_rng(0).standard_normal(bundle.constants.spk_embed_dim).astype(np.float32)
    forced = np.random.default_rng(1).integers(0, bundle.constants.speech_token_size, 40).tolist()
    got, want = runner.teacher_force([15947, 1002, 13], emb, forced), fp32.teacher_force([15947, 1002, 13], emb, forced)
    assert got.shape == want.shape == (41, bundle.constants.speech_token_size + 1)
    assert np.abs(got - want).max() < 0.5 and np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9
    scheduler = BatchScheduler(runner, max_batch=4)
    try:
        streams = [
            scheduler.generate([13, 1002], emb, np.random.default_rng(k), min_tokens=n, max_tokens=n)
            for k, n in enumerate((30, 20, 25))
        ]
        assert [len(list(s)) for s in streams] == [30, 20, 25]
        assert scheduler.stats.max_rows > 1
    finally:
        scheduler.close()


def test_quantizing_leaves_the_callers_logging_as_it_was(tiny_bundle: Path, tmp_path: Path) -> None:
    """ORT's quantizer is quieted for the call only: a served app's (or a test's) warnings still reach the root."""
    root = logging.getLogger()
    before = root.level
    root.setLevel(logging.WARNING)
    try:
        quantize_graph(ModelBundle.load(tiny_bundle).graph_path("flow_estimator"), tmp_path / "q.onnx")
        assert root.level == logging.WARNING
    finally:
        root.setLevel(before)
