"""The acoustic runtime choice (ORT or OpenVINO) made in one place, OpenVINO sessions, and int8 bundles' float twins."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from export.quantize import FLOAT_TWIN_GRAPHS, FLOAT_TWIN_PRECISION, float_twin, write_quantized_bundle
from service.bundle import FLOAT_SUFFIX, GROUP_FLOAT, ModelBundle
from service.engine import native, ov_session
from service.engine.options import OPENVINO_GRAPHS, RuntimeOptions
from service.engine.runtimes import graph_runtime
from service.engine.sessions import open_sessions
from service.engine.types import SynthesisOptions
from service.families.cosyvoice1.engine import Synthesizer
from service.runtime import runtime_options
from service.settings import Settings

pytestmark = pytest.mark.skipif(not ov_session.available(), reason="the openvino package is not installed")


def estimator_feeds(frames: int = 40, rows: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return {
        "x": g.standard_normal((rows, 80, frames), dtype=np.float32),
        "mask": np.ones((rows, 1, frames), np.float32),
        "mu": g.standard_normal((rows, 80, frames), dtype=np.float32),
        "t": np.full(rows, 0.3, np.float32),
        "spks": g.standard_normal((rows, 80), dtype=np.float32),
        "cond": g.standard_normal((rows, 80, frames), dtype=np.float32),
    }


def rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


@pytest.fixture(scope="module")
def int8_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path) -> ModelBundle:
    src = ModelBundle.load(tiny_bundle)
    dst = tmp_path_factory.mktemp("int8") / "bundle"
    write_quantized_bundle(tiny_bundle, dst, src.manifest, "int8")
    return ModelBundle.load(dst, verify_hashes=True)


def test_the_runtime_of_each_graph_is_chosen_in_one_place(tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = ModelBundle.load(tiny_bundle)
    ov = RuntimeOptions(acoustic_backend="openvino")
    assert {n for n in bundle.manifest.graphs if graph_runtime(bundle, n, ov).backend == "openvino"} == OPENVINO_GRAPHS
    assert all(graph_runtime(bundle, n, RuntimeOptions()).backend == "ort" for n in bundle.manifest.graphs)  # engine default
    monkeypatch.setattr(ov_session, "native_bf16", lambda: False)  # an AVX2-only host: bf16 would be emulated
    auto = RuntimeOptions(acoustic_backend="auto")
    assert graph_runtime(bundle, "flow_estimator", auto).backend == "ort"
    assert graph_runtime(bundle, "flow_estimator", ov).precision == "f32"  # asked for by name: OpenVINO without bf16
    monkeypatch.setattr(ov_session, "native_bf16", lambda: True)
    chosen = graph_runtime(bundle, "flow_estimator", ov)
    assert (chosen.backend, chosen.precision, chosen.path) == ("openvino", "bf16", bundle.graph_path("flow_estimator"))
    assert graph_runtime(bundle, "llm_step", ov).backend == "ort"
    # "auto" never takes OpenVINO, bf16 or not (our twins run the bf16 work; serving does not install openvino)
    monkeypatch.setattr(ov_session, "available", lambda: pytest.fail("openvino imported for acoustic_backend=auto"))
    assert all(graph_runtime(bundle, n, auto).backend == "ort" for n in bundle.manifest.graphs)


def test_service_setting_defaults_to_auto(tiny_bundle: Path) -> None:
    assert runtime_options(Settings(_env_file=None, model_dir=tiny_bundle)).acoustic_backend == "auto"  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="acoustic_backend"):
        RuntimeOptions(acoustic_backend="cuda")  # type: ignore[arg-type]


def test_openvino_f32_matches_ort_and_bf16_stays_close(tiny_bundle: Path) -> None:
    path = ModelBundle.load(tiny_bundle).graph_path("flow_estimator")
    feeds = estimator_feeds()
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["v"], feeds)
    (f32,) = ov_session.OpenVINOSession(path, 1, "f32").run(["v"], feeds)
    assert f32.shape == want.shape and rel_rms(f32, want) < 1e-5
    if ov_session.native_bf16():
        (bf16,) = ov_session.OpenVINOSession(path, 1, "bf16").run(None, feeds)
        # bf16 keeps 8 bits of mantissa: the tiny random model's output moves by ~12 % (the full-size model's by ~3 %,
        # reported by make bench's quality part); f32 is the check that OpenVINO computes the same graph
        assert 0 < rel_rms(bf16, want) < 0.25


def test_quantized_bundles_carry_a_float_twin_for_openvino(int8_bundle: ModelBundle, tiny_bundle: Path) -> None:
    for name in FLOAT_TWIN_GRAPHS:
        twin = int8_bundle.manifest.graphs[name + FLOAT_SUFFIX]
        core = int8_bundle.manifest.graphs[name]
        assert (twin.group, twin.precision, core.precision) == (GROUP_FLOAT, FLOAT_TWIN_PRECISION, "int8")
        assert (twin.inputs, twin.outputs) == (core.inputs, core.outputs)
        assert int8_bundle.float_graph_path(name) == int8_bundle.root / twin.file
    assert int8_bundle.float_graph_path("hift_decode") == int8_bundle.graph_path("hift_decode")  # fp32 already
    chosen = graph_runtime(int8_bundle, "flow_estimator", RuntimeOptions(acoustic_backend="openvino"))
    assert chosen.backend == "openvino" and chosen.path.name == "flow_estimator_float.onnx"
    # the twin computes what the fp32 graph computes, up to its int8 (per column) and float16 weights
    feeds = estimator_feeds(seed=3)
    fp32 = ModelBundle.load(tiny_bundle).graph_path("flow_estimator")
    (want,) = ort.InferenceSession(str(fp32), providers=["CPUExecutionProvider"]).run(["v"], feeds)
    (got,) = ort.InferenceSession(str(int8_bundle.root / "flow_estimator_float.onnx"), providers=["CPUExecutionProvider"]).run(
        ["v"], feeds
    )
    assert rel_rms(got, want) < 0.05


def test_an_int8_graph_without_a_twin_stays_on_ort(int8_bundle: ModelBundle, tmp_path: Path) -> None:
    copy = tmp_path / "bundle"
    shutil.copytree(int8_bundle.root, copy)
    manifest = (copy / "manifest.json").read_text()
    (copy / "flow_estimator_float.onnx").unlink()
    data = json.loads(manifest)
    del data["graphs"]["flow_estimator" + FLOAT_SUFFIX]
    (copy / "manifest.json").write_text(json.dumps(data))
    bundle = ModelBundle.load(copy)
    assert graph_runtime(bundle, "flow_estimator", RuntimeOptions(acoustic_backend="openvino")).backend == "ort"
    assert graph_runtime(bundle, "hift_decode", RuntimeOptions(acoustic_backend="openvino")).backend == "openvino"


def test_the_float_twin_compresses_the_weights(tiny_bundle: Path, tmp_path: Path) -> None:
    src = ModelBundle.load(tiny_bundle).graph_path("flow_estimator")
    n = float_twin(src, tmp_path / "twin.onnx")
    assert n > 0 and (tmp_path / "twin.onnx").stat().st_size < 0.6 * src.stat().st_size  # tiny: many small weights


def test_a_synthesizer_on_openvino_streams_audio(tiny_bundle: Path) -> None:
    synth = Synthesizer.load(tiny_bundle, RuntimeOptions(intra_op_threads=1, acoustic_backend="openvino"))
    try:
        sessions = {type(s).__name__ for s in (synth.token2wav.flow._estimator, synth.token2wav.hift._decode)}
        assert sessions == {"OpenVINOSession"}
        chunks = list(synth.synthesize([[15947, 1002, 13]], synth.speakers[0], SynthesisOptions(seed=1, stream=True)))
        audio = np.concatenate([c.audio for c in chunks])
        assert audio.size > 0 and np.isfinite(audio).all() and np.abs(audio).max() <= 0.99
    finally:
        synth.close()


def test_sessions_open_on_openvino_only_where_chosen(tiny_bundle: Path) -> None:
    bundle = ModelBundle.load(tiny_bundle)
    sessions = open_sessions(bundle, RuntimeOptions(intra_op_threads=1, acoustic_backend="openvino"))
    kinds = {name: type(s).__name__ for name, s in sessions.items()}
    assert {n for n, k in kinds.items() if k == "OpenVINOSession"} == OPENVINO_GRAPHS


def test_bf16_comes_from_the_librarys_cpu_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """One CPU probe (our library's) decides; an AVX2-only host, or one where the probe cannot answer, never gets bf16
    from "auto" (and never imports openvino for it)."""
    monkeypatch.setattr(ov_session, "available", lambda: pytest.fail("openvino imported without native bf16"))
    for flags in (frozenset({"avx2", "fma", "f16c"}), None):
        monkeypatch.setattr(native, "cpu_features", lambda flags=flags: flags)
        ov_session.native_bf16.cache_clear()
        assert ov_session.native_bf16() is False
    ov_session.native_bf16.cache_clear()
    assert not {"avx2", "fma"} & ov_session.BF16_CPU_FLAGS


def test_openvino_sends_no_usage_event() -> None:
    import sys

    ov_session._core()
    assert sys.modules.get("openvino_telemetry", "absent") is None  # its converter falls back to its no-op stub


def test_compiled_graphs_are_cached_by_a_child_process(tiny_bundle: Path, tmp_path: Path) -> None:
    path = ModelBundle.load(tiny_bundle).graph_path("hift_f0")
    cache = tmp_path / "cache"
    assert ov_session.warm_cache(path, "ab" * 32, 1, "f32", cache) == cache
    markers = list(cache.glob("abababababababab-f32-1-*.ready"))
    assert len(markers) == 1 and any(p.suffix != ".ready" for p in cache.iterdir())  # the compiled blob beside it
    assert ov_session.warm_cache(path, "ab" * 32, 1, "f32", cache) == cache  # warm: no second compile
    session = ov_session.OpenVINOSession(path, 1, "f32", cache)
    (f0,) = session.run(["f0"], {"mel": np.zeros((1, 80, 12), np.float32) - 5})
    assert f0.shape == (1, 12)
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert ov_session.warm_cache(path, "cd" * 32, 1, "f32", blocked / "cache") is None  # unusable: no cache, no error


def test_the_service_caches_compiled_graphs_where_settings_say(tiny_bundle: Path, tmp_path: Path) -> None:
    opts = runtime_options(Settings(_env_file=None, model_dir=tiny_bundle, cache_dir=tmp_path / "c"))  # type: ignore[call-arg]
    assert opts.compiled_cache_dir == tmp_path / "c"
    assert runtime_options(Settings(_env_file=None, model_dir=tiny_bundle, cache_dir="")).compiled_cache_dir is None  # type: ignore[call-arg, arg-type]
    default = Settings.model_fields["cache_dir"].default  # the suite itself runs with TTS_CACHE_DIR set (conftest.py)
    assert default is not None and default.expanduser() == Path.home() / ".cache" / "cosyvoice-lite"
