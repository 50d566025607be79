"""Graph weights in files of their own (export.external_data): ONNX Runtime maps them instead of copying them onto its
heap, the bundle records and hashes them, the engine's audio is unchanged, and an unused table costs no memory."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from export import external_data
from export.native_twin import drop_native_twins
from service.bundle import GROUP_NATIVE, MANIFEST_NAME, ModelBundle
from service.errors import BundleError

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"
MiB = 1 << 20


def _table_graph(path: Path, rows: int, dim: int) -> np.ndarray:
    """A Gather over an int8 table (rows, dim) (a text embedding's shape); returns the table."""
    table = np.random.default_rng(0).integers(-127, 127, (rows, dim), dtype=np.int8)
    node = helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0)
    graph = helper.make_graph(
        [node], "table", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("rows", TensorProto.INT8, ["n", dim])], [numpy_helper.from_array(table, "table")],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7), str(path))
    return table


def _rss_anon_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_weights_move_out_page_aligned_and_answers_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(external_data, "GRAPH_BYTES", 1 << 16)
    path = tmp_path / "table.onnx"
    table = _table_graph(path, 1000, 96)
    ids = np.array([3, 999, 0, 3], dtype=np.int64)
    assert external_data.externalize_graph(path)
    weights = tmp_path / "table.weights"
    assert weights.is_file() and path.stat().st_size < 4096
    model = onnx.load(str(path), load_external_data=False)
    (tensor,) = model.graph.initializer
    info = {e.key: e.value for e in tensor.external_data}
    assert tensor.data_location == TensorProto.EXTERNAL and info["location"] == "table.weights"
    assert int(info["offset"]) % external_data.ALIGN == 0
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {"ids": ids})[0], table[ids])
    assert external_data.externalize_graph(path)  # again: reads its weights file and writes the same bytes
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(onnx.load(str(path)).graph.initializer[0]), table)


def test_small_graph_stays_one_file(tmp_path: Path) -> None:
    path = tmp_path / "small.onnx"
    _table_graph(path, 100, 16)
    assert not external_data.externalize_graph(path)
    assert not (tmp_path / "small.weights").exists()


def test_mapped_table_costs_only_the_rows_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 64 MB table opened from a weights file adds far less than 64 MB to the process's own (anonymous) memory; the
    same graph with the table inside the .onnx file copies all of it onto the heap."""
    monkeypatch.setattr(external_data, "GRAPH_BYTES", 1 << 16)
    inline = tmp_path / "inline" / "table.onnx"
    mapped = tmp_path / "mapped" / "table.onnx"
    for path in (inline, mapped):
        path.parent.mkdir()
        _table_graph(path, 65536, 1024)
    external_data.externalize_graph(mapped)
    ids = {"ids": np.arange(0, 65536, 4096, dtype=np.int64)}
    grown = {}
    for path in (mapped, inline):
        before = _rss_anon_mb()
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        session.run(None, ids)
        grown[path.parent.name] = _rss_anon_mb() - before
        del session
    assert grown["inline"] > 48, grown  # the table copied onto the heap
    assert grown["mapped"] < 16, grown  # only the pages of the rows read, and those are the file's


@pytest.fixture
def tiny_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    copy = tmp_path / "tiny"
    shutil.copytree(TINY, copy)
    monkeypatch.setattr(external_data, "GRAPH_BYTES", 0)  # every graph of the tiny bundle moves its weights out
    return copy


def test_bundle_records_and_hashes_weights(tiny_copy: Path) -> None:
    moved = external_data.externalize_bundle(tiny_copy)
    manifest = ModelBundle.load(tiny_copy, verify_hashes=True).manifest
    assert moved and all(manifest.graphs[name].weights == f"{Path(manifest.graphs[name].file).stem}.weights" for name in moved)
    assert not any(manifest.graphs[name].weights for name in manifest.graphs if name not in moved)
    weights = tiny_copy / manifest.graphs[moved[0]].weights
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x01")
    with pytest.raises(BundleError, match="sha256 mismatch"):
        ModelBundle.load(tiny_copy, verify_hashes=True)
    weights.unlink()
    with pytest.raises(BundleError, match="incomplete"):
        ModelBundle.load(tiny_copy)


def test_inline_manifest_keeps_its_identity() -> None:
    """A bundle without weights files writes no `weights` keys: its manifest (and the audio cache's keys) stay as
    they were."""
    bundle = ModelBundle.load(TINY)
    on_disk = json.loads((TINY / MANIFEST_NAME).read_text(encoding="utf-8"))
    assert json.loads(bundle.manifest.to_json()) == on_disk
    assert all("weights" not in g for g in json.loads(bundle.manifest.to_json())["graphs"].values())


def test_engine_audio_unchanged(tiny_copy: Path) -> None:
    from service.engine.options import RuntimeOptions
    from service.engine.types import SynthesisOptions
    from service.families.registry import family

    external_data.externalize_bundle(tiny_copy)
    runtime = RuntimeOptions(max_batch=0, acoustic_slots=0)
    audio = []
    for path in (TINY, tiny_copy):
        bundle = ModelBundle.load(path)
        engine = family(bundle.family).load_engine(bundle, runtime)
        chunks = engine.synthesize([[5, 9, 14, 20]], next(iter(bundle.speakers)), SynthesisOptions(seed=3, stream=True))  # type: ignore[attr-defined]
        audio.append(np.concatenate([c.audio for c in chunks]))
    np.testing.assert_array_equal(audio[0], audio[1])


def test_dropped_twin_takes_its_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / "tiny-cosyvoice2"
    shutil.copytree(REPO / "models" / "tiny-cosyvoice2", copy)
    monkeypatch.setattr(external_data, "GRAPH_BYTES", 0)
    external_data.externalize_bundle(copy)
    twins = {n: g for n, g in ModelBundle.load(copy).manifest.graphs.items() if g.group == GROUP_NATIVE}
    assert twins and all(g.weights for g in twins.values())
    drop_native_twins(copy)
    assert not any((copy / g.weights).exists() for g in twins.values())
    ModelBundle.load(copy, verify_hashes=True)


def _mappings_of(path: Path) -> int:
    target = str(path.resolve())
    return sum(1 for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(" " + target))


def test_both_vocoder_sessions_read_one_mapping_of_their_weights(tiny_copy: Path) -> None:
    """The one- and two-thread HiFT decode sessions (SHARED_WEIGHTS_GRAPHS) read the weights file through one mapping
    (ONNX Runtime maps each tensor of it per session otherwise), and compute what a session of their own does."""
    from service.bundle.external import external_tensors
    from service.engine.options import RuntimeOptions
    from service.engine.sessions import open_sessions
    from service.layers.acoustic_plan import wide_hift_decode
    from service.layers.dsp import hann_window, stft

    external_data.externalize_bundle(tiny_copy)
    bundle = ModelBundle.load(tiny_copy)
    graph = tiny_copy / bundle.manifest.graphs["hift_decode"].file
    weights = tiny_copy / bundle.manifest.graphs["hift_decode"].weights
    tensors = external_tensors(graph)
    assert tensors and {t.location for t in tensors} == {weights.name} and all(t.length == t.nbytes() for t in tensors)
    runtime = RuntimeOptions(max_batch=0, acoustic_slots=0)
    narrow = open_sessions(bundle, runtime, names=("hift_decode",))["hift_decode"]
    wide = wide_hift_decode(bundle, runtime)
    assert _mappings_of(weights) == 1
    own = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    c = bundle.constants
    samples = 12 * int(np.prod(c.upsample_rates)) * c.istft_hop  # the source of 12 mel frames
    spectrum = stft(np.random.default_rng(5).standard_normal(samples), c.istft_n_fft, c.istft_hop, hann_window(c.istft_n_fft))
    feeds = {
        "mel": np.random.default_rng(6).standard_normal((1, c.n_mels, 12)).astype(np.float32),
        "s_stft": np.concatenate([spectrum.real, spectrum.imag])[None].astype(np.float32),
    }
    want = own.run(None, feeds)[0]
    for session in (narrow, wide):
        np.testing.assert_array_equal(session.run(None, feeds)[0], want)
    del narrow, wide, own, session
    gc.collect()
    assert _mappings_of(weights) == 0  # gone with the sessions (a session of its own maps each tensor: 21 here)


def test_a_file_that_is_not_onnx_is_left_to_onnx_runtime(tmp_path: Path) -> None:
    from service.bundle.external import external_tensors
    from service.engine.sessions import shared_weights

    for junk in (b"not an onnx graph", b"\x3a\xff", bytes(range(256))):
        path = tmp_path / "graph.onnx"
        path.write_bytes(junk)
        with pytest.raises(ValueError):
            external_tensors(path)
        assert shared_weights(path) is None


def test_operator_types_are_read_from_the_protobuf(tiny_copy: Path, tmp_path: Path) -> None:
    """op_types names what onnx finds in every graph of a bundle, weights outside or inside; junk is a ValueError."""
    from service.bundle.external import op_types

    external_data.externalize_bundle(tiny_copy)
    for entry in ModelBundle.load(tiny_copy).manifest.graphs.values():
        path = tiny_copy / entry.file
        assert op_types(path) == {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
    junk = tmp_path / "graph.onnx"
    junk.write_bytes(b"\x3a\xff")
    with pytest.raises(ValueError):
        op_types(junk)
