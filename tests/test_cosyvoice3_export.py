"""The Fun-CosyVoice3 exporter on the official-layout tiny checkpoint: every graph at opset 13 with the contract's
inputs and outputs, the manifest's constants, the 278 special tokens, the HiFT noise as an mt19937 position that
reproduces the official buffers (tiny and full size, checked against the digests the official code's buffers have),
the int8 twin with float16 DiT caches and native twins, and clear refusals."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from cosyvoice2_checkpoint import run_export

from service.bundle import ModelBundle
from service.families.cosyvoice3.contract import END_OF_PROMPT_ID, GRAPH_IO, constants_of
from service.families.cosyvoice3.noise import SineNoise
from service.layers.qwen_tokenizer import Qwen2Tokenizer

pytestmark = pytest.mark.export
REPO = Path(__file__).resolve().parents[1]
REF = REPO / "tests" / "reference" / "tiny-cosyvoice3"
FULL_SHAPES = REPO / "tests" / "reference" / "fun-cosyvoice3-0.5b.shapes.json"
HARMONICS = 9


def test_bundle_holds_every_cosyvoice3_graph_at_opset_13(cv3_ref_bundle: Path) -> None:
    bundle = ModelBundle.load(cv3_ref_bundle, verify_hashes=True)
    assert bundle.family == "cosyvoice3" and bundle.constants.sample_rate == 24000
    for name in GRAPH_IO:
        model = onnx.load(str(cv3_ref_bundle / bundle.manifest.graphs[name].file), load_external_data=False)
        assert next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == 13, name


def test_manifest_states_the_special_ids_and_the_noise_recipe(cv3_ref_bundle: Path) -> None:
    manifest = ModelBundle.load(cv3_ref_bundle).manifest
    extra = constants_of(manifest)
    assert (extra.sos, extra.eos, extra.task, extra.stop_tokens) == (6561, 6562, 6563, 200)
    assert manifest.constants.eos_token == 6561  # the first stop id, the one the official sampling masks
    meta = json.loads((REF / "fixtures_meta.json").read_text(encoding="utf-8"))["noise"]["digests"]
    assert extra.hift_noise_sha256 == meta["hift_sine_waves"]["sha256"]
    assert manifest.capabilities.prompt_analysis and manifest.capabilities.instruct2
    assert manifest.test_model and manifest.random_weights


def test_the_runtime_regenerates_the_official_noise_the_tiny_fixtures_used(cv3_ref_bundle: Path) -> None:
    extra = constants_of(ModelBundle.load(cv3_ref_bundle).manifest)
    want = np.load(REF / "noise.npz")["hift_sine_waves"]
    noise = SineNoise(extra.hift_noise_seed, extra.hift_noise_offset, extra.hift_noise_samples, HARMONICS)
    assert np.array_equal(noise.rows(0, want.shape[0]), want)


def test_the_noise_recipe_reproduces_the_full_size_official_buffer() -> None:
    from export.cosyvoice3.config import load_config
    from export.cosyvoice3.noise import sine_noise_offset

    cfg = load_config(REPO / "export" / "configs" / "fun-cosyvoice3-0.5b")
    noise = SineNoise(0, sine_noise_offset(cfg), 7_200_000, HARMONICS)
    digest = hashlib.sha256(np.ascontiguousarray(noise.rows(0, 7_200_000), dtype="<f4").tobytes()).hexdigest()
    want = json.loads(FULL_SHAPES.read_text(encoding="utf-8"))["_noise_buffers"]["hift_sine_waves"]["sha256"]
    assert digest == want


def test_tokenizer_file_carries_the_cosyvoice3_special_tokens(cv3_ref_bundle: Path) -> None:
    tokenizer = Qwen2Tokenizer.load(cv3_ref_bundle / "tokenizer.json")
    assert tokenizer.encode("<|endofprompt|>") == [END_OF_PROMPT_ID]
    assert tokenizer.encode("[AA]") == [151664] and tokenizer.encode("[ǜ]") == [151923]
    assert tokenizer.encode("<|endofsystem|>") == [151663]


def test_int8_twin_quantizes_weights_and_halves_the_dit_caches(cv3_ref_bundle: Path) -> None:
    int8 = cv3_ref_bundle.with_name(cv3_ref_bundle.name + "-int8")
    bundle = ModelBundle.load(int8, verify_hashes=True)
    graphs = bundle.manifest.graphs
    assert graphs["flow_estimator"].precision == "int8" and graphs["llm_step"].precision == "int8"
    assert {"flow_estimator_native", "llm_step_native"} <= set(graphs)
    model = onnx.load(str(int8 / graphs["flow_estimator"].file), load_external_data=False)
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert types["past_k_0"] == onnx.TensorProto.FLOAT16 and types["start"] == onnx.TensorProto.INT64
    twin = onnx.load(str(int8 / graphs["flow_estimator_native"].file), load_external_data=False)
    ops = [n.op_type for n in twin.graph.node]
    assert ops.count("DiTBlock") == constants_of(bundle.manifest).estimator_blocks  # every block one kernel call
    assert "CachedAttention" not in ops and "Int8MatMul" in ops  # the input, time and output products stay apart
    step = onnx.load(str(int8 / graphs["llm_step_native"].file), load_external_data=False)
    assert any(n.op_type == "Qwen2Layer" for n in step.graph.node)


def test_missing_weights_is_one_line(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(REF, ckpt, ignore=shutil.ignore_patterns("*.npz", "flow.pt"))
    proc = run_export("--model-dir", ckpt, "--out", tmp_path / "out")
    assert proc.returncode == 2 and "missing checkpoint file(s): flow.pt" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_yaml_with_a_long_skip_dit_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(REF, ckpt, ignore=shutil.ignore_patterns("*.npz"))
    yaml = ckpt / "cosyvoice3.yaml"
    yaml.write_text(
        yaml.read_text(encoding="utf-8").replace(
            "            ff_mult: 2\n", "            ff_mult: 2\n            long_skip_connection: true\n"
        ),
        encoding="utf-8",
    )
    proc = run_export("--model-dir", ckpt, "--out", tmp_path / "out")
    assert proc.returncode == 2 and "long_skip_connection" in proc.stderr


def test_the_dit_twin_with_our_kernels_is_as_near_fp32_as_the_int8_graph(cv3_ref_bundle: Path, native_library: Path) -> None:
    """One estimator call over cached frames: the native twin (each block one DiTBlock: modulated LayerNorms, rotary q
    and k, cached attention, gated residuals, tanh GELU, int8 products quantizing each frame on its own; the portable C
    and this host's variants) against the fp32 graph, no farther than ONNX Runtime's int8 graph is."""
    from service.engine.options import RuntimeOptions
    from service.engine.sessions import open_sessions

    rng = np.random.default_rng(0)
    frames = {n: rng.standard_normal((1, 80, 50)).astype(np.float32) for n in ("x", "mu", "cond")}
    feeds = frames | {"t": np.array([0.3], np.float32), "spks": rng.standard_normal((1, 80)).astype(np.float32)}
    feeds |= {"chunk": np.array([50], np.int64), "start": np.array([100], np.int64)}
    feeds["tails"] = rng.standard_normal((1, 128, 30)).astype(np.float32)
    # the caches as the engine keeps them in a quantized bundle: int8 rows (a frame's head) times a scale; every graph
    # reads the same values (the twin the int8 rows and scales, the others them widened)
    int8_caches = {}
    for kv in "kv":
        for i in range(2):
            cache = rng.standard_normal((1, 100, 4, 16)).astype(np.float32)
            scale = np.abs(cache).max(axis=-1) / np.float32(127)
            rows = np.rint(cache / scale[..., None]).astype(np.int8)
            int8_caches |= {f"past_{kv}_{i}": rows, f"past_{kv}_{i}_scale": scale}
            feeds[f"past_{kv}_{i}"] = rows.astype(np.float32) * scale[..., None]
    int8 = ModelBundle.load(cv3_ref_bundle.with_name(cv3_ref_bundle.name + "-int8"))

    def velocity(bundle: ModelBundle, mode: str) -> np.ndarray:
        opts = RuntimeOptions(intra_op_threads=1, native_kernels=mode, native_estimator=True)  # the twin on AVX2 too
        session = open_sessions(bundle, opts, names=("flow_estimator",))["flow_estimator"]
        types = {i.name: i.type for i in getattr(session, "session", session).get_inputs()}
        if types["past_k_0"] == "tensor(int8)":  # the twin reads the caches as kept
            given = feeds | int8_caches
        else:
            given = {k: v.astype(np.float16) if k.startswith("past_") and bundle is int8 else v for k, v in feeds.items()}
        return np.asarray(session.run(None, given)[0], np.float32)

    want = velocity(ModelBundle.load(cv3_ref_bundle), "off")
    core, native, fast = (np.abs(velocity(int8, mode) - want).max() for mode in ("off", "portable", "auto"))
    assert 0 < native <= 1.5 * core + 1e-3, (native, core)
    assert fast <= 1.5 * core + 1e-3, (fast, core)  # this host's variants (AVX2 or AVX-512) of the DiT block


def test_the_dit_rewrite_fuses_whole_blocks_only(cv3_ref_bundle: Path) -> None:
    """A block whose inside something else reads (here: its gated attention output made a graph output) is refused
    with that tensor's name, not fused around it; the graph as exported fuses every block."""
    from export.cosyvoice3.dit_twin import fuse_dit_blocks
    from export.external_data import load_inline
    from export.fuse_ops import fuse_attention, fuse_int8_matmuls
    from export.twin_graph import RewriteError

    int8 = ModelBundle.load(cv3_ref_bundle.with_name(cv3_ref_bundle.name + "-int8"))

    def prepared() -> onnx.ModelProto:
        model = load_inline(int8.root / int8.manifest.graphs["flow_estimator"].file)
        fuse_attention(model)
        fuse_int8_matmuls(model)
        return model

    model = prepared()
    assert fuse_dit_blocks(model) == constants_of(int8.manifest).estimator_blocks
    onnx.checker.check_model(model)
    model = prepared()
    attention = next(n for n in model.graph.node if n.op_type == "CachedAttention")
    out = next(n for n in model.graph.node if attention.output[0] in n.input)
    gated = next(n for n in model.graph.node if out.output[0] in n.input)
    model.graph.output.append(onnx.helper.make_tensor_value_info(gated.output[0], onnx.TensorProto.FLOAT, None))
    with pytest.raises(RewriteError, match="read outside it"):
        fuse_dit_blocks(model)
