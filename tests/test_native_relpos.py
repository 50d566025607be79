"""Our native kernel cosyvoice_lite.RelPosLayer (service/families/cosyvoice1/native/relpos_layer.c): a CosyVoice-300M LLM decoder
layer in one call, and the rewrite that puts it into the int8 step's twin (export/cosyvoice1/relpos_twin.py). The
tiny v1 bundle quantized here: its twin against ONNX Runtime's own int8 step (one row: the same numbers; several rows:
each row quantizes its activations on its own) and against the twin with only its int8 products as our kernel (the
same quantization: the same numbers), prefill, decode rows at different cache lengths with garbage past them, several
new tokens per row; the portable code (forced here) against the code this CPU takes; what the rewrite and the kernel
refuse; and a synthesis through the twin."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from portable import native_session
from test_native_twin import relative_rms

from export.cosyvoice1.relpos_twin import fuse_relpos_layers
from export.fuse_ops import fuse_int8_matmuls
from export.native_twin import drop_native_twins, rewrite_int8_products, write_native_twin
from export.quantize import write_quantized_bundle
from export.registry import for_family
from export.twin_graph import RELPOS_OP_NAME, RewriteError
from service.bundle import NATIVE_DOMAIN, ModelBundle
from service.engine import native
from service.engine.options import RuntimeOptions
from service.engine.runtimes import graph_runtime
from service.engine.sessions import open_sessions
from service.engine.types import SynthesisOptions
from service.families.cosyvoice1.contract import FAMILY, RELPOS_LAYER_OP, relative_pe
from service.families.cosyvoice1.engine import Synthesizer
from service.families.cosyvoice1.llm import LLM_GRAPHS, CosyVoice1LLM

TWIN = "llm_step_native"
PORTABLE = RuntimeOptions(intra_op_threads=1, max_batch=0, native_kernels="portable")  # the twin on any CPU


@pytest.fixture(scope="module")
def int8_bundle(tiny_bundle: Path, native_library: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models/tiny quantized to int8, with the twins its family's exporter writes."""
    out = tmp_path_factory.mktemp("v1-int8") / "bundle"
    write_quantized_bundle(tiny_bundle, out, ModelBundle.load(tiny_bundle).manifest, "int8")
    assert TWIN in write_native_twin(out, for_family(FAMILY).native_rewrites, log=lambda _: None)
    return out


@pytest.fixture(scope="module")
def products_bundle(int8_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same bundle whose step twin has only its int8 products as our kernel (the twin before RelPosLayer)."""
    out = tmp_path_factory.mktemp("v1-products") / "bundle"
    shutil.copytree(int8_bundle, out)
    drop_native_twins(out)
    assert TWIN in write_native_twin(out, {"llm_step": rewrite_int8_products}, log=lambda _: None)  # (and the vocoder)
    return out


def sessions(native_library: Path, bundle: Path) -> dict[str, ort.InferenceSession]:
    """ONNX Runtime's int8 step, the products-only twin and the layer twin under each ceiling, one thread each."""
    core = ort.InferenceSession(str(bundle / "llm_step.onnx"), providers=["CPUExecutionProvider"])
    products = onnx.load(str(bundle / "llm_step.onnx"))
    fuse_int8_matmuls(products)
    twin = (bundle / f"{TWIN}.onnx").read_bytes()
    return {
        "core": core,
        "products": native_session(native_library, products.SerializeToString(), "portable"),
        "portable": native_session(native_library, twin, "portable"),
        "auto": native_session(native_library, twin, "auto"),
    }


@pytest.fixture(scope="module")
def steps(native_library: Path, int8_bundle: Path) -> dict[str, ort.InferenceSession]:
    return sessions(native_library, int8_bundle)


def feeds_for(
    bundle: Path, past_len: list[int], cached: int, new: int, rows: int | None = None, *, exact_positions: bool = False
) -> dict[str, np.ndarray]:
    """Step inputs as the engine feeds them: the layers' projected positions (`rows` distances, default those the step
    reads; rounded to float16, the twin's precision for them, unless `exact_positions`), float16 caches of `cached`
    columns whose columns past each row's length hold garbage (1e3). `twin_feeds` hands them to the layer twin."""
    c = ModelBundle.load(bundle).constants
    rng = np.random.default_rng(len(past_len) * 1000 + cached * 10 + new)
    rows = rows or max([*past_len, 0]) + new
    pos_graph = ort.InferenceSession(str(bundle / "llm_pos.onnx"), providers=["CPUExecutionProvider"])
    (pos,) = pos_graph.run(["pos"], {"pe": relative_pe(rows, c.llm_model_dim)})
    if not exact_positions:
        pos = pos.astype(np.float16).astype(np.float32)
    feeds = {
        "x": rng.standard_normal((len(past_len), new, c.llm_model_dim)).astype(np.float32),
        "past_len": np.asarray(past_len, np.int64),
    }
    for i in range(c.llm_num_layers):
        feeds[f"pos_{i}"] = pos[i]
        for name in ("past_k", "past_v"):
            cache = (rng.standard_normal((len(past_len), c.llm_num_heads, cached, c.llm_head_dim)) * 0.5).astype(np.float16)
            for b, n in enumerate(past_len):
                cache[b, :, n:] = 1e3
            feeds[f"{name}_{i}"] = cache
    return feeds


def twin_feeds(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same feeds for the layer twin, whose position inputs are float16."""
    return {name: value.astype(np.float16) if name.startswith("pos_") else value for name, value in feeds.items()}


def test_the_twin_runs_each_decoder_layer_as_one_node(int8_bundle: Path) -> None:
    """Each layer (LayerNorms, six products, the relative-position attention over the float16 cache, ReLU, residuals)
    is one RelPosLayer; the step's shared distance index and mask, the casts of the cache and every attention node go;
    the input layer's and the decoder head's products stay Int8MatMul nodes."""
    bundle = ModelBundle.load(int8_bundle, verify_hashes=True)
    core = [n.op_type for n in onnx.load(str(int8_bundle / "llm_step.onnx")).graph.node]
    twin = onnx.load(str(int8_bundle / f"{TWIN}.onnx"))
    ops = [n.op_type for n in twin.graph.node]
    layers = bundle.constants.llm_num_layers
    assert ops.count(RELPOS_OP_NAME) == layers and ops.count("Int8MatMul") == core.count("MatMulInteger") - 6 * layers == 2
    for gone in ("Softmax", "GatherElements", "MatMul", "MatMulInteger", "Cast", "Where", "Range", "Transpose"):
        assert gone not in ops, gone
    assert len(ops) < len(core) / 5
    nodes = [n for n in twin.graph.node if n.op_type == RELPOS_OP_NAME]
    assert all(n.domain == NATIVE_DOMAIN and n.input[1] == "past_len" and n.input[-1] == native.SPREAD_INPUT for n in nodes)
    assert [n.input[2:5] for n in nodes] == [[f"past_k_{i}", f"past_v_{i}", f"pos_{i}"] for i in range(layers)]
    assert [o.name for o in twin.graph.output] == ["logp", "new_k", "new_v"]
    pos_types = {i.type.tensor_type.elem_type for i in twin.graph.input if i.name.startswith("pos_")}
    assert pos_types == {onnx.TensorProto.FLOAT16}  # read only by the layers: halved (halve_positions)


def test_positions_in_float16_move_the_step_by_their_rounding_only(
    int8_bundle: Path, steps: dict[str, ort.InferenceSession]
) -> None:
    """The twin's one deviation beyond the int8 graph's: the projected positions in float16. Against ONNX Runtime's
    int8 graph on the exact float32 positions, a decode step after 40 positions stays within float16 roundings."""
    exact = feeds_for(int8_bundle, [40], 40, 1, exact_positions=True)
    want = steps["core"].run(None, exact)[0]
    got = steps["auto"].run(None, twin_feeds(exact))[0]
    assert np.abs(got - want).max() < 2e-2 and int(got.argmax()) == int(want.argmax())


@pytest.mark.parametrize(("past_len", "cached"), [([0], 0), ([7], 7), ([40], 63)], ids=["first", "decode", "spare columns"])
@pytest.mark.parametrize("ceiling", ["portable", "auto"])
def test_one_row_steps_are_the_int8_graphs_numbers(
    int8_bundle: Path, steps: dict[str, ort.InferenceSession], past_len: list[int], cached: int, ceiling: str
) -> None:
    """A decode step of one row: the same quantization and integer sums as ONNX Runtime's int8 graph; the LayerNorms,
    the scores and the softmax summed in another order move the log-probabilities by float32 roundings only."""
    feeds = feeds_for(int8_bundle, past_len, cached, 1, rows=128)
    for name, want, got in zip(
        ("logp", "new_k", "new_v"), steps["core"].run(None, feeds), steps[ceiling].run(None, twin_feeds(feeds)), strict=True
    ):
        assert want.shape == got.shape, name
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-4, err_msg=name)


@pytest.mark.parametrize(
    ("past_len", "cached", "new"),
    [([0], 0, 9), ([12, 5, 0], 12, 1), ([6, 2], 6, 7), ([63, 1, 30, 0, 17], 63, 1)],
    ids=["prefill", "batch at different lengths", "several new tokens", "five rows"],
)
@pytest.mark.parametrize("ceiling", ["portable", "auto"])
def test_batches_and_prefills_compute_what_the_products_twin_computes(
    int8_bundle: Path, steps: dict[str, ort.InferenceSession], past_len: list[int], cached: int, new: int, ceiling: str
) -> None:
    """Several rows: each quantizes its activations on its own, in both twins, so the layer twin gives the products
    twin's numbers (float32 roundings apart) whatever lies past a row's length; ONNX Runtime's graph quantizes the rows
    of a call together, a few percent away."""
    feeds = feeds_for(int8_bundle, past_len, cached, new)
    got = steps[ceiling].run(None, twin_feeds(feeds))
    for name, want, out in zip(("logp", "new_k", "new_v"), steps["products"].run(None, feeds), got, strict=True):
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-4, err_msg=name)
    for name, want, out in zip(("logp", "new_k", "new_v"), steps["core"].run(None, feeds), got, strict=True):
        assert relative_rms(want, out) < 0.05, name


def test_positions_shorter_than_a_row_reads_are_refused(int8_bundle: Path, steps: dict[str, ort.InferenceSession]) -> None:
    """A row at length 20 with one new token reads distances 0 .. 20: 20 rows of positions is a clear error (ONNX
    Runtime's gather refuses the same step), never a read past the input."""
    feeds = feeds_for(int8_bundle, [20, 3], 24, 1, rows=20)
    with pytest.raises(Exception, match="RelPosLayer: pos holds fewer relative distances"):
        steps["portable"].run(None, twin_feeds(feeds))
    with pytest.raises(Exception, match="GatherElements"):
        steps["core"].run(None, feeds)


def test_a_layer_with_another_activation_is_refused(int8_bundle: Path) -> None:
    model = onnx.load(str(int8_bundle / "llm_step.onnx"))
    fuse_int8_matmuls(model)
    relu = next(n for n in model.graph.node if n.op_type == "Relu" and "feed_forward" in n.name)
    relu.op_type = "Sigmoid"
    with pytest.raises(RewriteError, match="Relu"):
        fuse_relpos_layers(model)


def test_the_engine_decodes_through_the_twin_what_the_products_twin_decodes(int8_bundle: Path, products_bundle: Path) -> None:
    """A v1 synthesis with the portable kernels forced: the engine opens the layer twin, samples the same tokens under
    the same seeds as with the products-only twin (the same quantization), and speaks the same audio; against ONNX
    Runtime's own graph (a prefill's rows quantized together) its teacher-forced log-probabilities stay close and choose
    the same most likely token. The layer twin reads the whole position table (its kernel reads the distances in use),
    in float16, the products twin windows of it (ONNX Runtime's gather reads every row it is given) in float32 holding
    the same values: the same tokens either way."""
    bundle = ModelBundle.load(int8_bundle)
    chosen = graph_runtime(bundle, "llm_step", PORTABLE)
    assert chosen.path == int8_bundle / f"{TWIN}.onnx" and chosen.custom_ops == native.LIBRARY_PATH
    assert RELPOS_OP_NAME in {n.op_type for n in onnx.load(str(chosen.path)).graph.node}
    step_only = replace(PORTABLE, native_estimator=False)  # both on ONNX Runtime's estimator: the step is compared
    layer, products = Synthesizer.load(int8_bundle, step_only), Synthesizer.load(products_bundle, step_only)
    assert RELPOS_LAYER_OP == RELPOS_OP_NAME
    assert not layer.llm.positions.windowed and products.llm.positions.windowed
    assert layer.llm.positions.dtype == np.float16 and products.llm.positions.dtype == np.float32
    rounded = products.llm.positions  # the values the layer twin reads (float16), held as the products twin takes them
    rounded.hold_as(np.float16)
    rounded.hold_as(np.float32)
    speaker = layer.speakers[0]
    text = [15947, 1002, 13]
    emb = np.asarray(bundle.speakers[speaker], np.float32)
    for seed in range(3):
        want = list(products.llm.generate(text, emb, np.random.default_rng(seed), min_tokens=30, max_tokens=30))
        assert list(layer.llm.generate(text, emb, np.random.default_rng(seed), min_tokens=30, max_tokens=30)) == want
    spoken = [
        np.concatenate([c.audio for c in s.synthesize([text], speaker, SynthesisOptions(seed=3))]) for s in (layer, products)
    ]
    np.testing.assert_array_equal(spoken[0], spoken[1])
    core = CosyVoice1LLM(
        open_sessions(bundle, RuntimeOptions(intra_op_threads=1, native_kernels="off"), names=LLM_GRAPHS), bundle.constants
    )
    forced = np.random.default_rng(1).integers(0, bundle.constants.speech_token_size, 40).tolist()
    got, want = layer.llm.teacher_force(text, emb, forced), core.teacher_force(text, emb, forced)
    assert np.abs(got - want).max() < 0.1 and np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9
