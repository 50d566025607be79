"""The CosyVoice-300M flow estimator's native twin (export/cosyvoice1/native_twin.py): each transformer block as one
cosyvoice_lite.EstimatorBlock with no cache and full attention over the call's frames. What the exporter writes into a
quantized v1 bundle, that it computes what ONNX Runtime's int8 graph computes (the portable C forced: this suite runs
on hosts without AVX-512), which graph the v1 engine opens, and what the rewrite refuses."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper
from portable import native_session

from export.native_twin import drop_native_twins, write_native_twin
from export.quantize import write_quantized_bundle
from export.registry import EXPORTERS, FamilyExporter, for_family
from export.twin_graph import RewriteError
from loadtest.bundles import _refresh_native_twins
from service.bundle import GROUP_NATIVE, ModelBundle
from service.engine import native
from service.engine.options import RuntimeOptions
from service.engine.runtimes import graph_runtime, native_kernels_note
from service.engine.sessions import open_sessions
from service.families.cosyvoice1.contract import FAMILY
from service.families.cosyvoice1.flow import FlowRunner
from service.families.registry import family, open_bundle

TWIN = "flow_estimator_native"
# Relative RMS of the twin's velocity from ONNX Runtime's int8 graph: the same int8 weights, but each row of a product
# quantized on its own (ONNX Runtime takes one range for the whole batch), LayerNorm, GELU and the softmax summed in
# another order; measured 1.4-2.3 % on the tiny bundle.
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def v1_int8(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The committed tiny v1 bundle quantized to int8, with the native twins its exporter writes."""
    out = tmp_path_factory.mktemp("v1-int8") / "bundle"
    write_quantized_bundle(tiny_bundle, out, ModelBundle.load(tiny_bundle).manifest, "int8")
    write_native_twin(out, for_family(FAMILY).native_rewrites, log=lambda _: None)
    return out


def velocity_feeds(frames: int, rows: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    """Estimator inputs as the v1 flow feeds them: the first half of the rows conditioned, the rest zeros (guidance)."""
    rng = np.random.default_rng(seed + frames)
    half = rows // 2

    def conditioned(*shape: int) -> np.ndarray:
        a = rng.standard_normal((rows, *shape)).astype(np.float32)
        a[half:] = 0.0
        return a

    return {
        "x": rng.standard_normal((rows, 80, frames)).astype(np.float32), "mask": np.ones((rows, 1, frames), np.float32),
        "mu": conditioned(80, frames), "t": np.full(rows, 0.3, np.float32), "spks": conditioned(80) * 0.1,
        "cond": conditioned(80, frames),
    }  # fmt: skip


def relative_rms(want: np.ndarray, got: np.ndarray) -> float:
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    return float(np.sqrt(((got - want) ** 2).mean() / max((want**2).mean(), 1e-30)))


def test_a_quantized_v1_bundle_carries_the_estimator_twin(v1_int8: Path) -> None:
    bundle = ModelBundle.load(v1_int8, verify_hashes=True)
    core, twin = bundle.manifest.graphs["flow_estimator"], bundle.manifest.graphs[TWIN]
    assert (twin.group, twin.precision, twin.inputs, twin.outputs) == (GROUP_NATIVE, core.precision, core.inputs, core.outputs)
    core_ops = [n.op_type for n in onnx.load(str(v1_int8 / core.file)).graph.node]
    ops = [n.op_type for n in onnx.load(str(v1_int8 / twin.file)).graph.node]
    blocks = core_ops.count("Softmax")
    assert blocks > 0 and ops.count("EstimatorBlock") == blocks  # every block, its attention inside
    assert not {"Softmax", "MatMulInteger", "Erf", "CachedAttention"} & set(ops)
    assert ops.count("Int8MatMul") == core_ops.count("MatMulInteger") - 6 * blocks  # the time and ResNet projections
    assert ops.count("ConstantOfShape") == core_ops.count("ConstantOfShape") + 1  # one empty cache for all blocks
    twin_graph = onnx.load(str(v1_int8 / twin.file)).graph
    strided = [n for n in twin_graph.node if n.op_type == "Conv"]
    assert strided and all(helper.get_attribute_value(a) == [2] for n in strided for a in n.attribute if a.name == "strides")
    assert ops.count("BF16Conv1d") == core_ops.count("Conv") - len(strided) > 0  # the ResNet blocks' convolutions
    norms = core_ops.count("InstanceNormalization")  # two GroupNorms a ResNet block, each followed by Mish
    assert norms > 0 and ops.count("NormMish") == norms and "InstanceNormalization" not in ops


@pytest.mark.parametrize(("frames", "rows"), [(1, 2), (7, 2), (36, 2), (69, 4), (200, 2)])
def test_the_twin_computes_what_the_int8_graph_computes(v1_int8: Path, native_library: Path, frames: int, rows: int) -> None:
    """Odd and even frame counts (the U-Net halves and doubles the time axis), pooled first chunks (4 rows), a long
    window; the portable kernels, which every host runs."""
    core = ort.InferenceSession(str(v1_int8 / "flow_estimator.onnx"), providers=["CPUExecutionProvider"])
    twin = native_session(native_library, (v1_int8 / f"{TWIN}.onnx").read_bytes(), "portable")
    feeds = velocity_feeds(frames, rows)
    (want,), (got,) = core.run(None, feeds), twin.run(None, feeds)
    assert got.shape == want.shape == (rows, 80, frames)
    assert relative_rms(want, got) < TOLERANCE


def test_a_rows_velocity_does_not_depend_on_its_batch(v1_int8: Path, native_library: Path) -> None:
    """Each row quantizes its own activations and attends over its own frames: a pooled solve's rows are the rows'
    own solves (what lets the flow pool first chunks and split the guidance rows over two threads)."""
    twin = native_session(native_library, (v1_int8 / f"{TWIN}.onnx").read_bytes(), "portable")
    feeds = velocity_feeds(23, 4)
    together = twin.run(None, feeds)[0]
    alone = twin.run(None, {name: a[1:2] for name, a in feeds.items()})[0]
    np.testing.assert_array_equal(together[1:2], alone)


def test_the_v1_engine_runs_the_twin_unless_a_lever_says_no(v1_int8: Path, native_library: Path) -> None:
    bundle = ModelBundle.load(v1_int8)
    portable = RuntimeOptions(native_kernels="portable", intra_op_threads=1)
    assert graph_runtime(bundle, "flow_estimator", portable).path == v1_int8 / f"{TWIN}.onnx"
    off = replace(portable, native_estimator=False)
    assert graph_runtime(bundle, "flow_estimator", off).path == v1_int8 / "flow_estimator.onnx"
    assert graph_runtime(bundle, "llm_step", off).custom_ops is not None  # the lever leaves the step's twin alone
    assert "flow_estimator on its core graph (TTS_ENGINE_PROFILE=native_estimator=false)" in str(native_kernels_note(bundle, off))
    graphs = ("flow_encoder", "flow_lr", "flow_estimator")
    flows = [FlowRunner(open_sessions(bundle, opts, names=graphs), bundle.constants) for opts in (portable, off)]
    rng = np.random.default_rng(5)
    mu, z = rng.standard_normal((2, 80, 40)).astype(np.float32)
    spks = rng.standard_normal(80).astype(np.float32) * 0.1
    native_mel, core_mel = (flow.solve(mu, spks, z, n_timesteps=3) for flow in flows)
    assert relative_rms(core_mel, native_mel) < TOLERANCE  # a whole guided solve through the twin


def test_an_attention_bias_other_than_the_padding_mask_is_refused(v1_int8: Path) -> None:
    """The twin drops the attention bias, which is only right for the padding bias (zero where the mask is 1): a bias
    from anything else keeps the core graph (nothing is written)."""
    model = onnx.load(str(v1_int8 / "flow_estimator.onnx"))
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    masked = next(n for n in model.graph.node if n.output[0] == softmax.input[0])
    bias = next(name for name in masked.input if "attn1" not in name)
    model.graph.node.append(helper.make_node("Exp", [bias], ["other_bias"], name="other_bias"))
    masked.input[list(masked.input).index(bias)] = "other_bias"
    rewrite = for_family(FAMILY).native_rewrites["flow_estimator"]
    with pytest.raises(RewriteError, match="not the padding bias"):
        rewrite(model, ModelBundle.load(v1_int8).manifest)


def test_the_refreshed_bench_bundle_gains_the_twin(v1_int8: Path, tmp_path: Path) -> None:
    """loadtest/bundles.py _refresh_native_twins gives a v1 int8 bundle written before the twin its estimator's twin."""
    old = tmp_path / "old"
    shutil.copytree(v1_int8, old)
    drop_native_twins(old)
    assert ModelBundle.load(old).native_graph_path("flow_estimator") is None
    _refresh_native_twins(old)
    assert ModelBundle.load(old, verify_hashes=True).native_graph_path("flow_estimator") == old / f"{TWIN}.onnx"
    assert (old / f"{TWIN}.onnx").read_bytes() == (v1_int8 / f"{TWIN}.onnx").read_bytes()  # reproducible


def test_the_service_opens_a_bundle_with_every_twin(v1_int8: Path) -> None:
    """The served family's layout lists every graph its exporter writes a twin of (the check the server runs at start)."""
    bundle = open_bundle(v1_int8)
    twins = {name for name, g in bundle.manifest.graphs.items() if g.group == GROUP_NATIVE}
    assert twins == {"llm_step_native", TWIN, "hift_decode_native"}


@pytest.mark.parametrize("exporter", EXPORTERS, ids=lambda e: e.family)
def test_every_family_layout_accepts_the_twins_its_exporter_writes(exporter: FamilyExporter) -> None:
    assert set(exporter.native_rewrites) <= set(family(exporter.family).layout.native_graphs)


def test_auto_keeps_the_estimator_twin_off_the_kernels_avx2_code(v1_int8: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU where the kernels would take their AVX2 code, native_estimator "auto" runs ONNX Runtime's estimator
    (its AVX2 twin was the slower) and still the step's twin; true runs both; the portable ceiling runs both."""
    library = native.LIBRARY_PATH

    def avx2_host(
        path: Path = library, head_dim: int = 64, kernel: str = "", kernels: str = "auto", avx2: bool = True
    ) -> native.NativeKernels:
        if kernels == "portable":
            return native.NativeKernels(library, "", "portable")
        return native.NativeKernels(library, "", "avx2") if avx2 else native.NativeKernels(None, "avx2 left out")

    monkeypatch.setattr(native, "probe", avx2_host)
    monkeypatch.setattr(native, "runtime_refusal", lambda path: "")
    bundle = ModelBundle.load(v1_int8)
    auto = RuntimeOptions(intra_op_threads=1)
    assert auto.native_estimator == "auto"
    assert graph_runtime(bundle, "flow_estimator", auto).path == v1_int8 / "flow_estimator.onnx"
    assert graph_runtime(bundle, "llm_step", auto).custom_ops is not None
    assert "native_estimator=true runs the twin" in str(native_kernels_note(bundle, auto))
    assert graph_runtime(bundle, "flow_estimator", replace(auto, native_estimator=True)).path == v1_int8 / f"{TWIN}.onnx"
    portable = replace(auto, native_kernels="portable")
    assert graph_runtime(bundle, "flow_estimator", portable).path == v1_int8 / f"{TWIN}.onnx"
