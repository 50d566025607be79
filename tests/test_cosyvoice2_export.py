"""export_onnx.py on a CosyVoice2 checkpoint: the bundle it writes, its manifest, the int8 twin, and the error cases."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from cosyvoice2_checkpoint import build_checkpoint, run_export

from export.cosyvoice2.config import load_config
from export.cosyvoice2.modules.flow import flow_noise
from export.onnx_io import OPSET
from service.bundle import MANIFEST_NAME, ModelBundle, sha256_file
from service.engine.options import RuntimeOptions
from service.engine.types import SynthesisOptions
from service.families.cosyvoice2.contract import FAMILY as FAMILY_V2
from service.families.cosyvoice2.contract import GRAPH_IO as V2_GRAPH_IO
from service.families.cosyvoice2.contract import NOISE_NAME as V2_NOISE_NAME
from service.families.cosyvoice2.contract import TOKENIZER_NAME as V2_TOKENIZER_NAME
from service.families.cosyvoice2.contract import constants_of
from service.families.cosyvoice2.engine import CosyVoice2Engine
from service.families.cosyvoice2.voice import Voice2

pytestmark = pytest.mark.export


@pytest.fixture(scope="module")
def checkpoint(cv2_checkpoint: Path) -> Path:
    return cv2_checkpoint


@pytest.fixture(scope="module")
def exported(cv2_bundle: Path) -> Path:
    return cv2_bundle


def test_bundle_holds_every_cosyvoice2_graph_at_opset_13(exported: Path) -> None:
    bundle = ModelBundle.load(exported, verify_hashes=True)
    assert bundle.family == FAMILY_V2 and constants_of(bundle.manifest) is not None
    assert set(bundle.manifest.graphs_in("core")) == set(V2_GRAPH_IO)
    assert set(bundle.manifest.graphs_in("prompt")) == {"campplus", "speech_tokenizer"}
    for name in V2_GRAPH_IO:
        model = onnx.load(str(bundle.graph_path(name)), load_external_data=False)
        assert {o.domain or "ai.onnx": o.version for o in model.opset_import} == {"ai.onnx": OPSET}, name


def test_manifest_states_the_model_and_its_constants(exported: Path, checkpoint: Path) -> None:
    manifest = ModelBundle.load(exported).manifest
    cfg = load_config(checkpoint)
    c, e = manifest.constants, constants_of(manifest)
    assert e is not None
    assert (c.sample_rate, c.token_rate_hz, c.mel_hop_samples, c.speech_token_size) == (24000, 25, 480, 6561)
    assert (c.llm_num_layers, c.llm_num_heads, c.llm_head_dim) == (2, 2, 8)  # K/V heads of the grouped attention
    assert (c.token_hop_len, c.token_max_hop_len, c.stream_scale_factor, c.mel_cache_len) == (25, 100, 2.0, 8)
    assert (e.chunk_tokens, e.pre_lookahead, e.encoder_blocks, e.estimator_blocks) == (25, 3, 1, 4)
    assert e.estimator_tail_channels == 320 + 16 * 2 + 16 * 4 + 32 + 16 * 3
    assert manifest.model == "CosyVoice2-0.5B" and manifest.test_model and manifest.random_weights
    caps = manifest.capabilities
    assert (caps.builtin_speakers, caps.prompt_analysis, caps.instruct, caps.instruct2) == (False, True, False, True)
    assert manifest.source_files["llm.pt"] == sha256_file(checkpoint / "llm.pt")
    assert cfg.llm.qwen.num_kv_heads == c.llm_num_heads
    data = json.loads((exported / MANIFEST_NAME).read_text(encoding="utf-8"))
    assert data["family"] == "cosyvoice2" and data["capabilities"]["instruct2"] is True


def test_noise_file_is_the_official_buffer(exported: Path) -> None:
    noise = np.load(exported / V2_NOISE_NAME, allow_pickle=False)
    assert noise.shape == (80, 15000) and noise.dtype == np.float32
    np.testing.assert_array_equal(noise, flow_noise()[0].numpy())


def test_tokenizer_file_carries_the_cosyvoice2_special_tokens(exported: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(exported / V2_TOKENIZER_NAME))
    word = tok.encode(" then").ids
    assert tok.encode(" then").tokens == ["Ġthe", "n"]  # the checkpoint's merges, byte-level
    endofprompt, laughter = tok.token_to_id("<|endofprompt|>"), tok.token_to_id("[laughter]")
    assert tok.encode(" then<|endofprompt|>[laughter] then").ids == [*word, endofprompt, laughter, *word]
    assert endofprompt == 256 + 6 + 3  # bytes + merges, then <|endoftext|>, <|im_start|>, <|im_end|>


def test_int8_twin_quantizes_weights_and_halves_the_caches(exported: Path) -> None:
    twin = ModelBundle.load(exported.with_name(exported.name + "-int8"), verify_hashes=True)
    estimator = onnx.load(str(twin.graph_path("flow_estimator")), load_external_data=False)
    outputs = {o.name: o.type.tensor_type.elem_type for o in estimator.graph.output}
    assert outputs["new_k"] == outputs["new_v"] == onnx.TensorProto.FLOAT16  # appended to float16 caches as they come
    ops = {n.op_type for n in estimator.graph.node}
    assert "Conv" not in ops and "MatMulInteger" in ops  # the causal convolutions are int8 matrix products too
    assert twin.manifest.model.endswith("-int8") and twin.family == FAMILY_V2
    precisions = {n: g.precision for n, g in twin.manifest.graphs.items()}
    int8 = {n for n, p in precisions.items() if p == "int8"}
    assert int8 == {
        "llm_step", "llm_step_native", "flow_encoder", "flow_estimator", "flow_estimator_native", "llm_prompt", "llm_embed"
    }  # fmt: skip
    # the estimator's attention and int8 products, the step's int8 products as our kernels
    assert twin.manifest.graphs["flow_estimator_native"].group == twin.manifest.graphs["llm_step_native"].group == "native"
    for name in ("llm_step", "flow_estimator"):
        model = onnx.load(str(twin.graph_path(name)), load_external_data=False)
        kinds = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
        assert kinds["past_k_0"] == onnx.TensorProto.FLOAT16 and kinds["x"] == onnx.TensorProto.FLOAT
    # the native twin reads the engine's int8 frames as they are kept: each cache int8 with its scales (B, C, H)
    native = onnx.load(str(twin.graph_path("flow_estimator_native")), load_external_data=False)
    inputs = {i.name: i.type.tensor_type for i in native.graph.input}
    caches = [n for n in inputs if n.startswith(("past_k_", "past_v_")) and not n.endswith("_scale")]
    assert caches and all(inputs[n].elem_type == onnx.TensorProto.INT8 for n in caches)
    for n in caches:
        scale = inputs[n + "_scale"]
        assert scale.elem_type == onnx.TensorProto.FLOAT and len(scale.shape.dim) == 3
        dims = [d.dim_value or d.dim_param for d in inputs[n].shape.dim]
        assert [d.dim_value or d.dim_param for d in scale.shape.dim] == dims[:3]
    blocks = [node for node in native.graph.node if node.op_type == "EstimatorBlock"]
    assert blocks and all(list(node.input[23:]) == [node.input[1] + "_scale", node.input[2] + "_scale"] for node in blocks)


def test_missing_weights_is_one_line(checkpoint: Path, tmp_path: Path) -> None:
    broken = tmp_path / "ck"
    shutil.copytree(checkpoint, broken)
    (broken / "flow.pt").unlink()
    proc = run_export("--model-dir", broken, "--out", tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {broken}: missing checkpoint file(s): flow.pt"]
    assert not (tmp_path / "out").exists()


def test_an_estimator_with_two_levels_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    broken = tmp_path / "ck"
    shutil.copytree(checkpoint, broken)
    yaml = broken / "cosyvoice2.yaml"
    yaml.write_text(yaml.read_text(encoding="utf-8").replace("channels: [16]", "channels: [16, 16]"), encoding="utf-8")
    proc = run_export("--model-dir", broken, "--out", tmp_path / "out")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "channels [16, 16] has 2 levels" in line


def test_int4_twin_has_a_4_bit_decode_step_and_speaks(checkpoint: Path, tmp_path: Path) -> None:
    proc = run_export("--model-dir", checkpoint, "--out", tmp_path / "out", "--quantize", "int4")
    assert proc.returncode == 0, proc.stderr
    assert "int4 llm_step vs fp32 (deviation, not a failure): max |dlogp|" in proc.stdout
    twin = ModelBundle.load(tmp_path / "out-int4", verify_hashes=True)
    assert twin.manifest.model.endswith("-int4") and twin.manifest.precision == "int4" and twin.family == FAMILY_V2
    precisions = {n: g.precision for n, g in twin.manifest.graphs.items()}
    assert precisions["llm_step"] == "int4"
    int8 = {n for n, p in precisions.items() if p == "int8"}
    assert int8 == {"flow_encoder", "flow_estimator", "flow_estimator_native", "llm_prompt", "llm_embed"}
    step = onnx.load(str(twin.graph_path("llm_step")), load_external_data=False)
    assert any(n.op_type == "MatMulNBits" for n in step.graph.node)
    assert {i.name: i.type.tensor_type.elem_type for i in step.graph.input}["past_k_0"] == onnx.TensorProto.FLOAT16
    engine = CosyVoice2Engine.load(twin, RuntimeOptions(intra_op_threads=1, max_batch=0, acoustic_slots=0))
    try:
        voice = Voice2.builtin("x", np.random.default_rng(0).standard_normal(192).astype(np.float32))
        chunks = list(engine.synthesize([[11, 12, 13, 14]], voice, SynthesisOptions(seed=0, stream=True)))
    finally:
        engine.close()
    audio = np.concatenate([c.audio for c in chunks])
    assert audio.size > 0 and np.isfinite(audio).all() and chunks[-1].is_final and chunks[-1].sample_rate == 24000


def test_random_init_needs_only_the_configs(tmp_path: Path) -> None:
    ck = build_checkpoint(tmp_path / "ck", prompt_models=True)
    for name in ("llm.pt", "flow.pt", "hift.pt"):
        (ck / name).unlink()
    out = tmp_path / "bench"
    proc = run_export("--model-dir", ck, "--out", out, "--random-init", "--model-name", "tiny")
    assert proc.returncode == 0, proc.stderr
    manifest = ModelBundle.load(out).manifest
    assert manifest.model == "tiny-random-init" and manifest.random_weights and not manifest.test_model
    assert "llm.pt" not in manifest.source_files
