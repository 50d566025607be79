"""Native twins (service.bundle GROUP_NATIVE, export/native_twin.py): the CosyVoice2 flow estimator's (attention and
int8 products as our kernels) and the LLM step's (int8 products): what the exporters write, what the manifest
accepts, which graph the engine opens, and that a twin computes what its core graph computes."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from export.add_twins import main
from export.fuse_layers import fuse_blocks
from export.fuse_ops import fuse_attention, fuse_conv_windows, fuse_int8_matmuls
from export.native_twin import write_native_twin
from export.quantize import half_kv_cache, write_quantized_bundle
from export.registry import for_family
from service.bundle import GROUP_NATIVE, MANIFEST_NAME, NATIVE_DOMAIN, ModelBundle
from service.engine import native
from service.engine.acoustic_gate import AcousticGate
from service.engine.options import RuntimeOptions
from service.engine.runtimes import graph_runtime, native_kernels_note
from service.engine.sessions import open_sessions
from service.errors import BundleError
from service.families.cosyvoice1.contract import FAMILY as FAMILY_V1
from service.families.cosyvoice2.assembly import DECODE_SPREAD, decode_spread
from service.families.cosyvoice2.contract import constants_of

TWIN = "flow_estimator_native"
STEP_TWIN = "llm_step_native"


@pytest.fixture(scope="module")
def kernels() -> native.NativeKernels:
    probe = native.probe()
    if not native.LIBRARY_PATH.is_file():
        pytest.skip(probe.reason)
    return probe


def every_node(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The graph's nodes and those of its nodes' branches (the time table's If, export/time_table.py)."""
    found: list[onnx.NodeProto] = []
    for node in graph.node:
        found.append(node)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                found.extend(every_node(attribute.g))
    return found


def estimator_feeds(session: ort.InferenceSession, cached: int, new: int, rows: int = 2) -> dict[str, np.ndarray]:
    """Random inputs of the estimator graph: `rows` guidance rows, `new` frames after `cached` ones."""
    rng = np.random.default_rng(cached * 100 + new)
    feeds: dict[str, np.ndarray] = {}
    for i in session.get_inputs():
        if i.name == "chunk":
            feeds[i.name] = np.array([4], np.int64)
            continue
        if i.name == "t":
            feeds[i.name] = np.full(rows, 0.3, np.float32)
            continue
        shape = [{"B": rows, "M": new, "C": cached}.get(d, 1) if isinstance(d, str) else d for d in i.shape]
        dtype = np.float16 if i.type == "tensor(float16)" else np.float32
        feeds[i.name] = (rng.standard_normal(shape) * 0.5).astype(dtype)
    return feeds


def as_kept(feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The float16 caches of estimator `feeds` as the engine keeps them in a quantized bundle (int8 rows of a frame's
    head, each times max |x| / 127): the feeds of the core graph (those frames widened back to float16) and of the native
    twin (the int8 rows and their scales, `past_k_0_scale` ...), so both read the same values."""
    core, twin = dict(feeds), dict(feeds)
    for name, x in feeds.items():
        if name.startswith(("past_k_", "past_v_")) and x.dtype == np.float16:
            wide = x.astype(np.float32)
            scale = np.abs(wide).max(axis=-1) / np.float32(127)
            scale[scale == 0] = 1.0
            rows = np.rint(wide / scale[..., None]).astype(np.int8)
            twin[name], twin[name + "_scale"] = rows, scale.astype(np.float32)
            core[name] = (rows.astype(np.float32) * scale[..., None]).astype(np.float16)
    return core, twin


def test_the_quantized_tiny_bundle_carries_the_twin(tiny_v2_bundle: Path) -> None:
    bundle = ModelBundle.load(tiny_v2_bundle, verify_hashes=True)
    core, twin = bundle.manifest.graphs["flow_estimator"], bundle.manifest.graphs[TWIN]
    assert (twin.group, twin.precision, twin.outputs) == (GROUP_NATIVE, core.precision, core.outputs)
    caches = [n for n in core.inputs if n.startswith(("past_k_", "past_v_"))]
    assert twin.inputs == (*core.inputs, *(f"{n}_scale" for n in caches))  # the core's, then the int8 caches' scales
    assert bundle.native_graph_path("flow_estimator") == tiny_v2_bundle / twin.file
    vocoder = bundle.manifest.graphs["hift_decode_native"]  # every family's vocoder: bf16 convolutions
    assert (vocoder.group, vocoder.precision, bundle.manifest.graphs["hift_decode"].precision) == (GROUP_NATIVE, "bf16", "fp32")
    assert bundle.native_graph_path("llm_encoder") is None
    model = onnx.load(str(tiny_v2_bundle / twin.file))
    ops = [n.op_type for n in every_node(model.graph) if n.domain == NATIVE_DOMAIN]  # the time table's fallback too
    blocks = constants_of(bundle.manifest).estimator_blocks
    assert ops.count("EstimatorBlock") == blocks and "CachedAttention" not in ops  # each block holds its attention
    assert not any(n.op_type in ("Softmax", "MatMulInteger", "Erf") for n in every_node(model.graph))
    core_products = sum(n.op_type == "MatMulInteger" for n in onnx.load(str(tiny_v2_bundle / "flow_estimator.onnx")).graph.node)
    assert ops.count("Int8MatMul") == core_products - 6 * blocks > 0  # q, k, v, out, ff1, ff2 are in the blocks
    made = {out: n for n in model.graph.node for out in n.output}
    products = [n for n in model.graph.node if n.op_type == "Int8MatMul"]
    windowed = [n for n in products if any(a.name == "window" and a.i == 3 for a in n.attribute)]
    assert windowed  # the convolutions' products read their frames in place
    im2col = [made[n.input[0]] for n in products if n.input[0] in made and made[n.input[0]].op_type == "Concat"]
    assert not [c for c in im2col if all(made[i].op_type == "Slice" for i in c.input)]  # no im2col copy left
    step, step_twin = bundle.manifest.graphs["llm_step"], bundle.manifest.graphs[STEP_TWIN]
    want = (GROUP_NATIVE, step.precision, (*step.inputs, "decode_spread"))
    assert (step_twin.group, step_twin.precision, step_twin.inputs) == want
    step_ops = [n.op_type for n in onnx.load(str(tiny_v2_bundle / step_twin.file)).graph.node]
    core_step = [n.op_type for n in onnx.load(str(tiny_v2_bundle / step.file)).graph.node]
    layers = step_ops.count("Qwen2Layer")  # each decoder layer with its 7 products; the speech decoder's product beside
    assert layers == bundle.constants.llm_num_layers and "MatMulInteger" not in step_ops
    assert step_ops.count("Int8MatMul") + 7 * layers == core_step.count("MatMulInteger") > 0


def test_convolution_windows_read_in_place_compute_the_same_numbers(tiny_v2_bundle: Path, kernels: native.NativeKernels) -> None:
    """fuse_conv_windows: each convolution's product reads its frames where they lie instead of an im2col copy; the rows
    it quantizes are the same, so the estimator's outputs are bit for bit those of the twin with the copies."""
    if not kernels.usable:
        pytest.skip(kernels.reason)
    copies = onnx.load(str(tiny_v2_bundle / "flow_estimator.onnx"))
    fuse_attention(copies)
    fuse_int8_matmuls(copies)
    fuse_blocks(copies)
    windows = onnx.ModelProto()
    windows.CopyFrom(copies)
    assert fuse_conv_windows(windows) > 0
    again = onnx.ModelProto()
    again.CopyFrom(windows)
    assert fuse_conv_windows(again) == 0  # nothing left to rewrite
    a, b = (native_session_bytes(m.SerializeToString()) for m in (copies, windows))
    for cached, new, rows in [(0, 9, 2), (13, 8, 1), (40, 3, 2), (5, 1, 1)]:
        feeds = estimator_feeds(a, cached, new, rows)
        for want, got in zip(a.run(None, feeds), b.run(None, feeds), strict=True):
            assert np.array_equal(want, got)


def relative_rms(want: np.ndarray, got: np.ndarray) -> float:
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    return float(np.sqrt(((got - want) ** 2).mean() / max((want**2).mean(), 1e-30)))


def native_session(path: Path, threads: int = 0) -> ort.InferenceSession:
    return native_session_bytes(str(path), threads)


def native_session_bytes(model: str | bytes, threads: int = 0) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(str(native.LIBRARY_PATH))
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(("cached", "new"), [(0, 9), (13, 8), (40, 3)])
def test_the_rewrite_computes_what_the_float_estimator_computes(
    cv2_ref_bundle: Path, kernels: native.NativeKernels, tmp_path: Path, cached: int, new: int
) -> None:
    """The fp32 estimator of the tiny reference export, its caches taken in float16 as the int8 bundle's are, against
    its rewritten twin: only the kernel's bf16 products differ (a miswired core would be off by O(1))."""
    core_path = tmp_path / "core.onnx"
    shutil.copy2(cv2_ref_bundle / "flow_estimator.onnx", core_path)
    half_kv_cache(core_path)
    model = onnx.load(str(core_path))
    assert fuse_attention(model) == constants_of(ModelBundle.load(cv2_ref_bundle).manifest).estimator_blocks
    onnx.save(model, str(tmp_path / "twin.onnx"))
    core = ort.InferenceSession(str(core_path), providers=["CPUExecutionProvider"])
    feeds = estimator_feeds(core, cached, new)
    bound = 1e-2 if kernels.usable else 1e-5  # bf16 products, or the portable float32 kernel
    for output, want, got in zip(
        core.get_outputs(), core.run(None, feeds), native_session(tmp_path / "twin.onnx").run(None, feeds), strict=True
    ):
        assert relative_rms(want, got) < bound, output.name


def test_the_committed_twin_runs_and_stays_near_the_int8_graph(tiny_v2_bundle: Path, kernels: native.NativeKernels) -> None:
    core = ort.InferenceSession(str(tiny_v2_bundle / "flow_estimator.onnx"), providers=["CPUExecutionProvider"])
    feeds, twin_feeds = as_kept(estimator_feeds(core, 13, 8))
    twin = native_session(tiny_v2_bundle / f"{TWIN}.onnx")
    for output, want, got in zip(core.get_outputs(), core.run(None, feeds), twin.run(None, twin_feeds), strict=True):
        # int8 activations are re-quantized after every block, so the attention's rounding comes out amplified
        # (2-5 % here, measured; the full-size int8 graph is as far from fp32 with either attention)
        assert relative_rms(want, got) < 0.15, output.name


def step_feeds(
    session: ort.InferenceSession, rows: int, positions: int, cached: int, past_len: list[int] | None = None
) -> dict[str, np.ndarray]:
    """Random step inputs: `rows` rows of `positions` new tokens after caches of `cached` columns, of which each row
    uses `past_len` (default: all; the columns past a row's length are garbage the mask hides)."""
    rng = np.random.default_rng(rows * 100 + positions)
    feeds: dict[str, np.ndarray] = {"past_len": np.asarray(past_len or [cached] * rows, np.int64)}
    for i in session.get_inputs():
        if i.name != "past_len":
            shape = [{"B": rows, "T": positions, "C": cached}.get(d, 1) if isinstance(d, str) else d for d in i.shape]
            dtype = np.float16 if i.type == "tensor(float16)" else np.float32
            feeds[i.name] = (rng.standard_normal(shape) * 0.5).astype(dtype)
    return feeds


def test_the_committed_step_twin_decodes_what_the_int8_step_decodes(tiny_v2_bundle: Path, kernels: native.NativeKernels) -> None:
    """One row: the same quantization and integer sums as ONNX Runtime's, around them RMSNorm, SiLU and the softmax
    summed in another order (Qwen2Layer), which can flip a rounding of the next activation quantization; several rows
    differ also by each row's own activation range (ONNX Runtime's operator takes one range for the whole batch)."""
    core = ort.InferenceSession(str(tiny_v2_bundle / "llm_step.onnx"), providers=["CPUExecutionProvider"])
    twin = native_session(tiny_v2_bundle / f"{STEP_TWIN}.onnx")
    feeds = step_feeds(core, 1, 1, 7)
    for output, want, got in zip(core.get_outputs(), core.run(None, feeds), twin.run(None, feeds), strict=True):
        assert relative_rms(want, got) < 0.02, output.name
    feeds = step_feeds(core, 3, 5, 4)
    for output, want, got in zip(core.get_outputs(), core.run(None, feeds), twin.run(None, feeds), strict=True):
        assert relative_rms(want, got) < 0.05, output.name


def test_the_engine_opens_the_twin_only_where_it_can_run(
    tiny_v2_bundle: Path, kernels: native.NativeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = ModelBundle.load(tiny_v2_bundle)
    chosen = graph_runtime(bundle, "flow_estimator", RuntimeOptions(native_estimator=True))
    if kernels.usable:
        assert (chosen.path, chosen.custom_ops) == (tiny_v2_bundle / f"{TWIN}.onnx", native.LIBRARY_PATH)
        assert chosen.fingerprint == bundle.manifest.graphs[TWIN].sha256
        opened = open_sessions(bundle, RuntimeOptions(native_estimator=True), names=("flow_estimator",))["flow_estimator"]
        core = ort.InferenceSession(str(tiny_v2_bundle / "flow_estimator.onnx"), providers=["CPUExecutionProvider"])
        feeds, kept = as_kept(estimator_feeds(core, 5, 4))
        assert opened.run(["v"], kept)[0].shape == core.run(["v"], feeds)[0].shape
    step = graph_runtime(bundle, "llm_step", RuntimeOptions(native_estimator=True))
    assert step.path == tiny_v2_bundle / (f"{STEP_TWIN}.onnx" if kernels.usable else "llm_step.onnx")
    off = graph_runtime(bundle, "flow_estimator", RuntimeOptions(native_kernels="off"))
    assert (off.path, off.custom_ops) == (tiny_v2_bundle / "flow_estimator.onnx", None)
    assert graph_runtime(bundle, "llm_step", RuntimeOptions(native_kernels="off")).custom_ops is None
    monkeypatch.setattr(native, "probe", lambda **_: native.NativeKernels(None, "no AVX-512 BF16"))
    assert graph_runtime(bundle, "flow_estimator", RuntimeOptions(native_estimator=True)).custom_ops is None
    # the estimator's twin needs both kernels: without VNNI it stays on the core graph even where bf16 runs
    monkeypatch.setattr(
        native, "probe",
        lambda **kw: native.NativeKernels(None, "no VNNI") if kw["kernel"] == "Int8MatMul" else kernels,
    )  # fmt: skip
    assert graph_runtime(bundle, "flow_estimator", RuntimeOptions(native_estimator=True)).custom_ops is None
    assert graph_runtime(bundle, "llm_step", RuntimeOptions(native_estimator=True)).custom_ops is None
    with pytest.raises(ValueError, match="native_kernels"):
        RuntimeOptions(native_kernels="on")  # type: ignore[arg-type]


class _Step:
    """A step session that records what each run was fed (the twin's spread input is an overridable initializer)."""

    def __init__(self, spread_input: bool = True) -> None:
        self.fed: list[dict[str, np.ndarray]] = []
        self.spread_input = spread_input

    def get_overridable_initializers(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(name=native.SPREAD_INPUT)] if self.spread_input else []

    def run(self, outputs: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.fed.append(feeds)
        return []


def test_decode_steps_spread_only_over_a_step_kernel_with_threads_while_the_gate_is_idle(
    tiny_v2_bundle: Path, kernels: native.NativeKernels
) -> None:
    """The CosyVoice2 scheduler spreads a decode step's products only where the step runs our int8 kernel on more than
    one thread, its twin takes the spread input and there is a gate to ask; then each step is fed 4 tasks while the
    gate is idle, 1 while an acoustic call runs: an argument of that session's runs, not a setting of the process."""
    bundle = ModelBundle.load(tiny_v2_bundle)
    gate, two = AcousticGate(2), RuntimeOptions(intra_op_threads=2, native_kernels="portable")  # the twin on any CPU
    step = native.DecodeSpread(_Step())
    assert decode_spread(bundle, replace(two, llm_threads=1), gate, step) is None
    assert decode_spread(bundle, two, None, step) is None
    assert decode_spread(bundle, two, gate, None) is None
    assert decode_spread(bundle, replace(two, native_kernels="off"), gate, step) is None
    assert decode_spread(bundle, two, gate, native.DecodeSpread(_Step(spread_input=False))) is None  # an older twin
    spread = decode_spread(bundle, two, gate, step)
    assert spread is not None
    for busy in (False, True, False):
        spread()
        if busy:
            with gate.slot(0.0, pauses_llm=False):
                spread()
        step.run(["logp"], {"x": np.zeros(1, np.float32)})
    fed = [int(f[native.SPREAD_INPUT][0]) for f in step.session.fed]
    assert fed == [DECODE_SPREAD, 1, DECODE_SPREAD]
    assert all("x" in f for f in step.session.fed)


def test_the_committed_step_twin_takes_its_spread_per_run(tiny_v2_bundle: Path, kernels: native.NativeKernels) -> None:
    """The step twin reads `decode_spread` (1 unless a run feeds it); every spread gives the same numbers."""
    twin = native_session(tiny_v2_bundle / f"{STEP_TWIN}.onnx", threads=2)
    assert native.takes_spread(twin) and native.SPREAD_INPUT not in {i.name for i in twin.get_inputs()}
    core = ort.InferenceSession(str(tiny_v2_bundle / "llm_step.onnx"), providers=["CPUExecutionProvider"])
    feeds = step_feeds(core, 2, 1, 6)
    alone = twin.run(None, feeds)
    spread = twin.run(None, {**feeds, native.SPREAD_INPUT: np.array([DECODE_SPREAD], np.int64)})
    for a, b in zip(alone, spread, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_start_up_log_says_whether_the_kernels_run_and_why_not(
    tiny_v2_bundle: Path, tiny_bundle: Path, kernels: native.NativeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = ModelBundle.load(tiny_v2_bundle)
    assert native_kernels_note(ModelBundle.load(tiny_bundle), RuntimeOptions(native_estimator=True)) is None  # v1: no twin
    assert "TTS_ENGINE_PROFILE=native_kernels=off" in str(native_kernels_note(bundle, RuntimeOptions(native_kernels="off")))
    if kernels.usable:  # the variant each kernel takes here (AMX tiles where they run)
        note = str(native_kernels_note(bundle, RuntimeOptions(native_estimator=True)))
        attention = native.probe(kernel="CachedAttention").variant
        products = native.probe(head_dim=64, kernel="Int8MatMul").variant
        assert f"flow_estimator runs its attention: {attention}, its int8 products: {products}" in note
        assert f"llm_step runs its int8 products: {products}" in note
    portable = str(native_kernels_note(bundle, RuntimeOptions(native_kernels="portable")))
    assert "(libcosyvoice_lite_native.so, portable): flow_estimator runs its attention: portable" in portable
    monkeypatch.setattr(native, "probe", lambda **_: native.NativeKernels(None, "this CPU lacks AVX-512 BF16"))
    assert "flow_estimator on ONNX Runtime's graph (this CPU lacks AVX-512 BF16)" in str(
        native_kernels_note(bundle, RuntimeOptions(native_estimator=True))
    )


def test_the_manifest_refuses_a_twin_unlike_its_core_graph(tiny_v2_bundle: Path, tmp_path: Path) -> None:
    data = json.loads((tiny_v2_bundle / MANIFEST_NAME).read_text(encoding="utf-8"))
    for change, message in [
        ({"precision": "fp32"}, "precision of its core graph"),
        ({"outputs": ["v"]}, "inputs and outputs of its core graph"),
        ({"group": "core"}, "expected 'native'"),
    ]:
        bad = json.loads(json.dumps(data))
        bad["graphs"][TWIN] |= change
        copy = tmp_path / f"bad-{len(message)}"
        shutil.copytree(tiny_v2_bundle, copy)
        (copy / MANIFEST_NAME).write_text(json.dumps(bad), encoding="utf-8")
        with pytest.raises(BundleError, match=message):
            ModelBundle.load(copy)


def test_a_bundle_exported_before_twins_gets_one_from_the_command(
    tiny_v2_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "old"
    shutil.copytree(tiny_v2_bundle, old)
    manifest = ModelBundle.load(old).manifest
    graphs = {n: g for n, g in manifest.graphs.items() if n not in (TWIN, STEP_TWIN)}
    (old / MANIFEST_NAME).write_text(replace(manifest, graphs=graphs).to_json(), encoding="utf-8")
    for name in (TWIN, STEP_TWIN):
        (old / f"{name}.onnx").unlink()
    assert ModelBundle.load(old).native_graph_path("flow_estimator") is None
    assert main([str(old)]) == 0
    assert ModelBundle.load(old, verify_hashes=True).native_graph_path("flow_estimator") == old / f"{TWIN}.onnx"
    assert ModelBundle.load(old).native_graph_path("llm_step") == old / f"{STEP_TWIN}.onnx"
    for name in (TWIN, STEP_TWIN):  # reproducible
        assert (old / f"{name}.onnx").read_bytes() == (tiny_v2_bundle / f"{name}.onnx").read_bytes()
    assert main([str(old)]) == 0
    assert "no native twin to add" in capsys.readouterr().out
    (old / f"{STEP_TWIN}.onnx").write_bytes(b"a twin from an older exporter")
    assert main(["--replace", str(old)]) == 0  # every twin written again from the core graphs
    assert ModelBundle.load(old, verify_hashes=True).native_graph_path("llm_step") == old / f"{STEP_TWIN}.onnx"
    assert (old / f"{STEP_TWIN}.onnx").read_bytes() == (tiny_v2_bundle / f"{STEP_TWIN}.onnx").read_bytes()
    assert main([str(tmp_path / "nowhere")]) == 2


def test_float_bundles_take_no_twin_and_quantized_v1_ones_the_step_and_the_estimator(
    tiny_bundle: Path, tmp_path: Path, kernels: native.NativeKernels
) -> None:
    v1 = tmp_path / "v1"
    shutil.copytree(tiny_bundle, v1)
    assert write_native_twin(v1, for_family(FAMILY_V1).native_rewrites) == ()
    assert ModelBundle.load(v1).native_graph_path("llm_step") is None
    quantized = tmp_path / "v1-int8"
    write_quantized_bundle(tiny_bundle, quantized, ModelBundle.load(tiny_bundle).manifest, "int8")
    rewrites = for_family(FAMILY_V1).native_rewrites  # v1's estimator: its blocks over the whole window (no cache)
    assert write_native_twin(quantized, rewrites, log=lambda _: None) == ("hift_decode_native", STEP_TWIN, TWIN)
    bundle = ModelBundle.load(quantized, verify_hashes=True)
    assert bundle.native_graph_path("flow_estimator") == quantized / f"{TWIN}.onnx"  # tests/test_native_v1_twin.py
    core = ort.InferenceSession(str(quantized / "llm_step.onnx"), providers=["CPUExecutionProvider"])
    twin = native_session(quantized / f"{STEP_TWIN}.onnx")
    feeds = step_feeds(core, 1, 1, 0)  # the first step (v1's relative positions need the engine's own feeds later)
    halved = {i.name for i in twin.get_inputs() if i.type == "tensor(float16)" and i.name.startswith("pos_")}
    assert len(halved) == bundle.constants.llm_num_layers  # its positions are float16 inputs (halve_positions)
    feeds = {name: value.astype(np.float16).astype(np.float32) if name in halved else value for name, value in feeds.items()}
    twin_feeds = {name: value.astype(np.float16) if name in halved else value for name, value in feeds.items()}
    for output, want, got in zip(core.get_outputs(), core.run(None, feeds), twin.run(None, twin_feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=output.name)


def test_an_int8_product_unlike_the_quantizers_is_refused() -> None:
    """A MatMulInteger whose activations do not come from DynamicQuantizeLinear (nothing is rewritten)."""
    a = onnx.helper.make_tensor_value_info("a", onnx.TensorProto.UINT8, [1, 4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.INT32, [1, 2])
    w = onnx.numpy_helper.from_array(np.ones((4, 2), np.int8), "w")
    node = onnx.helper.make_node("MatMulInteger", ["a", "w", "", ""], ["y"])
    with pytest.raises(Exception, match="comes from a graph input"):
        fuse_int8_matmuls(onnx.helper.make_model(onnx.helper.make_graph([node], "g", [a], [y], [w])))


def test_a_graph_without_the_attention_cores_is_refused() -> None:
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Softmax", ["x"], ["y"])], "g", [x], [y])
    with pytest.raises(Exception, match="comes from a graph input"):
        fuse_attention(onnx.helper.make_model(graph))
