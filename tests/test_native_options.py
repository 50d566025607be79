"""How the engine configures our native library: the kernels' ISA ceiling arrives per session (a session config entry
read when each kernel is created, from the engine lever native_kernels), never from the environment or a setting of the process;
an ONNX Runtime the library refuses leaves the engine on ONNX Runtime's graphs with the reason; and the portable C,
when asked for, serves requests on any CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from portable import native_session
from test_native_attention import attention_feeds, attention_graph, feeds_reference

from service.bundle import ModelBundle
from service.engine import native
from service.engine.options import RuntimeOptions
from service.engine.runtimes import graph_runtime, native_kernels_note
from service.engine.sessions import open_sessions
from service.engine.types import SynthesisOptions
from service.families.cosyvoice2.engine import CosyVoice2Engine
from service.families.cosyvoice2.voice import Voice2


def test_an_unknown_ceiling_is_a_clear_error_when_the_session_opens(native_library: Path) -> None:
    so = ort.SessionOptions()
    so.add_session_config_entry(native.CEILING_CONFIG_KEY, "avx9000")
    so.register_custom_ops_library(str(native_library))
    with pytest.raises(Exception, match=r"cosyvoice_lite\.kernels is an unknown value: expected auto, no-amx or portable"):
        ort.InferenceSession(attention_graph(2, 16), so, providers=["CPUExecutionProvider"])


def test_sessions_with_different_ceilings_live_side_by_side(native_library: Path) -> None:
    """A portable session computes the float32 attention wherever it is opened, before and after a session that may
    take the bf16 kernel: nothing of one reaches the other."""
    feeds = attention_feeds(1, 20, 30, 2, 64, 4)
    want = feeds_reference(feeds)
    first = native_session(native_library, attention_graph(2, 64), "portable").run(["out"], feeds)[0]
    fast = native_session(native_library, attention_graph(2, 64), "auto").run(["out"], feeds)[0]
    second = native_session(native_library, attention_graph(2, 64), "portable").run(["out"], feeds)[0]
    np.testing.assert_array_equal(first, second)
    assert float(np.abs(first - want).max()) < 1e-5 * float(np.abs(want).max())
    bf16 = native.probe(native_library, 64, "CachedAttention").variant.endswith("bf16")  # avx2: float32
    assert float(np.abs(fast - want).max()) < (3e-2 if bf16 else 1e-5) * float(np.abs(want).max())


def test_a_runtime_the_library_refuses_leaves_the_engine_on_onnx_runtimes_graphs(
    tiny_v2_bundle: Path, native_library: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert native.runtime_refusal(native_library) == ""  # the pinned runtime is new enough
    native.probe.cache_clear()
    monkeypatch.setattr(native, "runtime_refusal", lambda path=native_library: "ONNX Runtime 1.20.0 is too old")
    try:
        probe = native.probe(native_library, kernel="Int8MatMul", kernels="portable")
        assert not probe.usable and "too old" in probe.reason
        bundle = ModelBundle.load(tiny_v2_bundle)
        portable = RuntimeOptions(native_kernels="portable")
        assert graph_runtime(bundle, "llm_step", portable).path == tiny_v2_bundle / "llm_step.onnx"
        assert "llm_step on ONNX Runtime's graph (ONNX Runtime refuses" in str(native_kernels_note(bundle, portable))
    finally:
        native.probe.cache_clear()


def test_the_portable_kernels_serve_a_request_on_any_cpu(tiny_v2_bundle: Path, native_library: Path) -> None:
    """TTS_ENGINE_PROFILE=native_kernels=portable: both twins open with the portable C (on this CPU too), and a streamed request
    through the scheduler, with decode steps fed their spread, gives audio."""
    bundle = ModelBundle.load(tiny_v2_bundle)
    runtime = RuntimeOptions(intra_op_threads=2, native_kernels="portable", stream_schedule="official")
    for name in ("flow_estimator", "llm_step"):
        assert graph_runtime(bundle, name, runtime).custom_ops == native_library
    step = open_sessions(bundle, runtime, names=("llm_step",))["llm_step"]
    assert native.takes_spread(step)
    engine = CosyVoice2Engine.load(tiny_v2_bundle, runtime)
    assert engine.scheduler is not None and engine.scheduler.before_step is not None  # steps are fed their spread
    _streams_audio(engine)


def _streams_audio(engine: CosyVoice2Engine) -> None:
    """A streamed request with a cloned voice gives finite audio, its last chunk final; the engine is closed after."""
    try:
        rng = np.random.default_rng(5)
        tokens = tuple(int(t) for t in rng.integers(0, 6561, 30))
        mel = rng.standard_normal((60, 80)).astype(np.float32) - 5
        voice = Voice2.cloned("v", rng.standard_normal(192).astype(np.float32), tokens, mel, (5, 6, 7))
        chunks = list(engine.synthesize([[100, 200, 300]], voice, SynthesisOptions(stream=True, seed=3)))
    finally:
        engine.close()
    audio = np.concatenate([c.audio for c in chunks])
    assert chunks[-1].is_final and audio.size > 0 and np.isfinite(audio).all()


def test_float_caches_run_the_estimator_core_graph_when_its_twin_reads_int8(tiny_v2_bundle: Path, native_library: Path) -> None:
    """The estimator twin reads the streamed flow's caches in int8 as they are kept; asking for them in the graph's
    float type (flow_cache_precision=graph, the switch back from int8 frames, or float16) runs the core graph, which
    reads float16, and the start-up note says why. A stream gives audio either way."""
    bundle = ModelBundle.load(tiny_v2_bundle)
    twin = bundle.manifest.graphs["flow_estimator_native"]
    caches = [c for c in twin.inputs if c.startswith(("past_k_", "past_v_")) and not c.endswith("_scale")]
    assert caches and {f"{c}_scale" for c in caches} <= set(twin.inputs)
    for precision, runs_twin in (("auto", True), ("int8", True), ("graph", False), ("float16", False)):
        runtime = RuntimeOptions(intra_op_threads=1, native_kernels="portable", flow_cache_precision=precision)
        path = graph_runtime(bundle, "flow_estimator", runtime).path
        assert path == (bundle.native_graph_path("flow_estimator") if runs_twin else bundle.graph_path("flow_estimator"))
        note = str(native_kernels_note(bundle, runtime))
        assert ("its twin reads the caches in int8" in note) == (not runs_twin), note
    for precision in ("auto", "graph"):
        runtime = RuntimeOptions(intra_op_threads=1, native_kernels="portable", flow_cache_precision=precision)
        _streams_audio(CosyVoice2Engine.load(tiny_v2_bundle, runtime))
