"""Our kernels' AVX2 code (the `avx2` variant of every op: AVX2, FMA, F16C) through ONNX Runtime: each op's table has
it right after the portable C; on a CPU without AVX-512 (this host: AMD Zen 3) `auto` takes it for every op, so the
committed int8 bundles' native twins open there and stay within the stated tolerances of ONNX Runtime's graphs and of
the portable C; the engine lever native_on_avx2=false keeps such hosts on ONNX Runtime's graphs and changes nothing
where the kernels take their AVX-512 code. The C tests (tests/native, under the sanitizers) hold each AVX2 kernel
against the portable C on odd shapes; this file checks what the engine does with them."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from portable import native_session
from test_native_twin import as_kept, estimator_feeds, relative_rms, step_feeds

from service.bundle import ModelBundle
from service.engine import native
from service.engine.options import RuntimeOptions
from service.engine.runtimes import graph_runtime, native_kernels_note
from service.levers import EngineProfile, parse_profile

AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})
# Each op with the head size its probe is asked for (the attention's variant depends on it).
OPS = (("Int8MatMul", 64), ("CachedAttention", 64), ("CachedAttention", 32), ("CachedAttention", 16),
       ("EstimatorBlock", 64), ("Qwen2Layer", 64))  # fmt: skip


@pytest.fixture(scope="module")
def avx2_only(native_library: Path) -> None:
    """Skips unless this CPU has the AVX2 code's features and no AVX-512 (where the AVX2 code is what `auto` runs)."""
    flags = native.cpu_features(native_library) or frozenset()
    if not AVX2_FLAGS.issubset(flags) or "avx512f" in flags:
        pytest.skip(f"the AVX2 code is auto's choice only on a CPU with {sorted(AVX2_FLAGS)} and no AVX-512")


def test_every_op_lists_its_avx2_code_right_after_the_portable_c(native_library: Path) -> None:
    """Variant 1 of every op is `avx2`, needing exactly AVX2, FMA and F16C: the first fast variant, so the start-up
    log names those flags on a CPU that lacks them."""
    lib = ctypes.CDLL(str(native_library))
    lib.cvl_op_variant_at.restype = ctypes.c_char_p
    lib.cvl_op_variant_at.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_uint32)]
    lib.cvl_feature_name.restype = ctypes.c_char_p
    for op in sorted({op for op, _ in OPS}):
        needs = ctypes.c_uint32()
        assert lib.cvl_op_variant_at(op.encode(), 1, ctypes.byref(needs)) == b"avx2", op
        named = {lib.cvl_feature_name(bit).decode() for bit in range(32) if needs.value >> bit & 1}
        assert named == AVX2_FLAGS, op


@pytest.mark.parametrize(("op", "head_dim"), OPS)
def test_auto_takes_the_avx2_code_on_a_cpu_without_avx512(native_library: Path, avx2_only: None, op: str, head_dim: int) -> None:
    for kernels in ("auto", "no-amx"):
        probe = native.probe(native_library, head_dim, op, kernels)
        assert (probe.usable, probe.variant) == (True, "avx2"), probe.reason
    assert native.probe(native_library, head_dim, op, "portable").variant == "portable"
    off = native.probe(native_library, head_dim, op, avx2=False)
    assert not off.usable and f"native_on_avx2=false leaves out {op}'s avx2" in off.reason


def test_native_on_avx2_off_keeps_onnx_runtimes_graphs_only_where_a_kernel_takes_its_avx2_code(
    tiny_v2_bundle: Path, native_library: Path
) -> None:
    """native_on_avx2=false (TTS_ENGINE_PROFILE) leaves a twin to ONNX Runtime's graph exactly where one of its deciding
    kernels would run its AVX2 code, says so in the start-up log, and changes nothing elsewhere (AVX-512 hosts)."""
    assert EngineProfile.model_validate(parse_profile("native_on_avx2=false")).native_on_avx2 is False
    assert EngineProfile().native_on_avx2 is True and RuntimeOptions(native_estimator=True).native_on_avx2 is True
    bundle = ModelBundle.load(tiny_v2_bundle)
    on, off = RuntimeOptions(native_estimator=True), RuntimeOptions(native_on_avx2=False, native_estimator=True)
    for name, ops in native.KERNELS_OF_GRAPH.items():
        variants = [native.probe(kernel=op).variant for op in ops]
        if native.AVX2_VARIANT in variants:
            assert graph_runtime(bundle, name, on).custom_ops == native_library, name
            assert graph_runtime(bundle, name, off) == graph_runtime(bundle, name, RuntimeOptions(native_kernels="off"))
            assert f"{name} on ONNX Runtime's graph (TTS_ENGINE_PROFILE=native_on_avx2=false" in str(
                native_kernels_note(bundle, off)
            )
        else:
            assert graph_runtime(bundle, name, off) == graph_runtime(bundle, name, on), name
    portable = RuntimeOptions(
        native_kernels="portable", native_on_avx2=False, native_estimator=True
    )  # the portable C is no AVX2 code
    assert graph_runtime(bundle, "llm_step", portable).custom_ops == native_library


def test_the_committed_step_twin_on_the_avx2_code_stays_near_the_int8_step_and_the_portable_c(
    tiny_v2_bundle: Path, native_library: Path, avx2_only: None
) -> None:
    """The CosyVoice2 step twin as `auto` opens it here (Qwen2Layer and Int8MatMul on AVX2): within the twin's stated
    distance of ONNX Runtime's int8 step (2 % one row, 5 % several rows of several tokens), and much nearer the portable
    C than the stated 3 % (the same integer sums; only float32 passes summed in another order)."""
    bundle = ModelBundle.load(tiny_v2_bundle)
    runtime = graph_runtime(bundle, "llm_step", RuntimeOptions())
    assert runtime.path == tiny_v2_bundle / "llm_step_native.onnx"
    core = ort.InferenceSession(str(tiny_v2_bundle / "llm_step.onnx"), providers=["CPUExecutionProvider"])
    model = runtime.path.read_bytes()
    avx2, portable = (native_session(native_library, model, kernels) for kernels in ("auto", "portable"))
    for rows, positions, cached, bound in ((1, 1, 7, 0.02), (3, 5, 4, 0.05), (2, 1, 30, 0.02)):
        feeds = step_feeds(core, rows, positions, cached)
        want, got, reference = core.run(None, feeds), avx2.run(None, feeds), portable.run(None, feeds)
        for output, a, b, c in zip(core.get_outputs(), want, got, reference, strict=True):
            assert relative_rms(a, b) < bound, (output.name, rows, positions)
            assert relative_rms(c, b) < 5e-3, (output.name, rows, positions)


def test_the_committed_estimator_twin_on_the_avx2_code_stays_near_the_int8_estimator_and_the_portable_c(
    tiny_v2_bundle: Path, native_library: Path, avx2_only: None
) -> None:
    """The CosyVoice2 estimator twin as `auto` opens it here (EstimatorBlock with the float32 AVX2 attention, Int8MatMul
    on AVX2, windows read in place): within the twin's stated 15 % of ONNX Runtime's int8 graph, and much nearer the
    portable C than the stated 3 % (both attentions float32; only a requantization flipped by another summation order
    would show)."""
    bundle = ModelBundle.load(tiny_v2_bundle)
    runtime = graph_runtime(bundle, "flow_estimator", RuntimeOptions(native_estimator=True))
    assert runtime.path == tiny_v2_bundle / "flow_estimator_native.onnx"
    core = ort.InferenceSession(str(tiny_v2_bundle / "flow_estimator.onnx"), providers=["CPUExecutionProvider"])
    model = runtime.path.read_bytes()
    avx2, portable = (native_session(native_library, model, kernels) for kernels in ("auto", "portable"))
    for cached, new, rows in ((13, 8, 2), (0, 9, 1), (40, 3, 2)):
        feeds, kept = as_kept(estimator_feeds(core, cached, new, rows))
        want, got, reference = core.run(None, feeds), avx2.run(None, kept), portable.run(None, kept)
        for output, a, b, c in zip(core.get_outputs(), want, got, reference, strict=True):
            assert relative_rms(a, b) < 0.15, (output.name, cached, new)
            assert relative_rms(c, b) < 5e-3, (output.name, cached, new)
            assert np.isfinite(b).all()
