"""Which runtime runs each graph of a bundle: ONNX Runtime's graph, its native twin with our kernels, or OpenVINO."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from service.bundle import CACHE_SCALE_SUFFIX, GROUP_NATIVE, NATIVE_SUFFIX, ModelBundle
from service.engine import native
from service.engine.host import lower_thread_priority
from service.engine.options import OPENVINO_GRAPHS, RuntimeOptions, graph_stage
from service.errors import BundleError


@dataclass(frozen=True)
class GraphRuntime:
    """Where one graph runs: "ort", or "openvino" at `precision` from the file `path` (the float twin of an int8 graph)."""

    backend: Literal["ort", "openvino"]
    path: Path
    precision: str = "fp32"
    fingerprint: str = ""  # sha256 of the file at `path`, from the manifest
    custom_ops: Path | None = None  # a library of custom operators the graph needs (our native kernels)


def graph_runtime(bundle: ModelBundle, name: str, opts: RuntimeOptions) -> GraphRuntime:
    """The one place that picks the runtime of a graph, from the settings, the CPU's features and the bundle's files.

    A graph runs as its native twin on ORT with our kernels when the bundle has the twin, native_kernels is not "off"
    (nor native_estimator False, for the estimator) and the library has a fast variant of the twin's deciding kernels
    here under that ceiling (native.KERNELS_OF_GRAPH; their AVX2 code counts unless native_on_avx2 is off, or for the
    estimator under native_estimator "auto"), or the ceiling is "portable". Else OpenVINO runs OPENVINO_GRAPHS only
    when asked by name (acoustic_backend "openvino": bf16 where native, else f32), from floating-point weights: the
    graph itself, or the float twin of a quantized graph; a quantized graph without a twin stays on ORT. "auto" is ORT:
    on bf16 CPUs our twins (the estimator's blocks, the vocoder's bf16 convolutions) ran as fast as OpenVINO without a
    second runtime (docs/perf-log.md, 2026-11-30), so serving no longer installs it.
    """
    ort_runtime = GraphRuntime("ort", bundle.graph_path(name), bundle.manifest.graphs[name].precision)
    twin = native_twin(bundle, name, opts)
    if twin is not None:
        return twin
    if name not in OPENVINO_GRAPHS or opts.acoustic_backend != "openvino":
        return ort_runtime
    from service.engine import ov_session

    bf16 = ov_session.native_bf16()
    if not ov_session.available():
        raise BundleError("TTS_ENGINE_PROFILE=acoustic_backend=openvino needs the openvino package (pip install openvino)")
    path = bundle.float_graph_path(name)
    if path is None:
        return ort_runtime
    entry = next(g for g in bundle.manifest.graphs.values() if bundle.root / g.file == path)
    return GraphRuntime("openvino", path, "bf16" if bf16 else "f32", entry.sha256)


def native_twin(bundle: ModelBundle, name: str, opts: RuntimeOptions) -> GraphRuntime | None:
    """The native twin of graph `name` as it would run here, or None (no twin, off, or the library cannot run)."""
    ceiling = opts.native_kernels
    path = bundle.native_graph_path(name)
    if path is None or ceiling == "off" or (name == "flow_estimator" and opts.native_estimator is False):
        return None
    if float_caches_asked(bundle, name, opts):
        return None
    kernels = _native_kernels(name, ceiling, _takes_avx2(name, opts))
    if not kernels.usable:
        return None
    entry = bundle.manifest.graphs[name + NATIVE_SUFFIX]
    return GraphRuntime("ort", path, entry.precision, entry.sha256, kernels.path)


def reads_int8_caches(bundle: ModelBundle, name: str) -> bool:
    """Whether graph `name`'s native twin reads its caches in int8 (an input per cache for its scales)."""
    entry = bundle.manifest.graphs.get(name + NATIVE_SUFFIX)
    return entry is not None and any(i.endswith(CACHE_SCALE_SUFFIX) for i in entry.inputs)


def float_caches_asked(bundle: ModelBundle, name: str, opts: RuntimeOptions) -> bool:
    """Whether the settings keep a streamed flow's caches in the graph's float type (flow_cache_precision "graph" or
    "float16") while graph `name`'s twin reads them in int8: its core graph runs instead, which reads float16."""
    return opts.flow_cache_precision in ("graph", "float16") and reads_int8_caches(bundle, name)


def native_kernels_note(bundle: ModelBundle, opts: RuntimeOptions) -> str | None:
    """One line for the start-up log when the bundle has native twins: which run our kernels, and why the others not."""
    twins = [n.removesuffix(NATIVE_SUFFIX) for n in bundle.manifest.graphs_in(GROUP_NATIVE)]
    if not twins:
        return None
    ceiling = opts.native_kernels
    if ceiling == "off":
        return f"native kernels off (TTS_ENGINE_PROFILE=native_kernels=off): ONNX Runtime's graphs run {', '.join(twins)}"
    parts = []
    for name in twins:
        if name == "flow_estimator" and opts.native_estimator is False:
            parts.append(f"{name} on its core graph (TTS_ENGINE_PROFILE=native_estimator=false)")
            continue
        if float_caches_asked(bundle, name, opts):
            parts.append(f"{name} on its core graph (flow_cache_precision={opts.flow_cache_precision}: its twin reads "
                         "the caches in int8)")  # fmt: skip
            continue
        kernels = _native_kernels(name, ceiling, _takes_avx2(name, opts))
        if not kernels.usable and _native_kernels(name, ceiling, opts.native_on_avx2).usable:
            parts.append(f"{name} on its core graph (its kernels' AVX2 code was slower than ONNX Runtime's graph; "
                         "TTS_ENGINE_PROFILE=native_estimator=true runs the twin)")  # fmt: skip
            continue
        what = ", ".join(_kernel_note(op, ceiling) for op in native.KERNELS_OF_GRAPH[name])
        parts.append(f"{name} runs {what}" if kernels.usable else f"{name} on ONNX Runtime's graph ({kernels.reason})")
    return f"native kernels ({native.LIBRARY_PATH.name}, {ceiling}): {'; '.join(parts)}"


_OP_NOTE = {
    "CachedAttention": "its attention",
    "Int8MatMul": "its int8 products",
    "RelPosLayer": "its relative-position layers (where it has them)",
    "BF16Conv1d": "its bf16 convolutions",
}


def _kernel_note(op: str, ceiling: native.KernelsCeiling) -> str:
    """What the start-up note says of one kernel: the variant it takes ("its int8 products: avx512_vnni")."""
    return f"{_OP_NOTE.get(op, op)}: {native.probe(kernel=op, kernels=ceiling).variant}"


def _takes_avx2(name: str, opts: RuntimeOptions) -> bool:
    """Whether graph `name`'s twin counts its kernels' AVX2 code as fast: not the estimator's under native_estimator
    "auto" (its AVX2 twin was slower than ONNX Runtime's int8 graph on an AVX2-only host), nor ever the vocoder's (its
    convolutions' AVX2 code, bf16 widened to float32, took 1.07 s for 100 frames where ONNX Runtime's float32 graph
    took 0.65 s; docs/perf-log.md)."""
    if name == "hift_decode":
        return False
    return opts.native_on_avx2 and not (name == "flow_estimator" and opts.native_estimator == "auto")


def _native_kernels(name: str, ceiling: native.KernelsCeiling, avx2: bool = True) -> native.NativeKernels:
    """Whether our library has a fast variant of every deciding kernel of graph `name`'s twin here under `ceiling` (any
    variant under "portable"; the AVX2 ones only with `avx2`): the first one that has not, or the library. (The
    attention's fast variants take the head sizes our families use; another size runs its portable code, with the same
    results.)"""
    probes = [native.probe(kernel=k, kernels=ceiling, avx2=avx2) for k in native.KERNELS_OF_GRAPH[name]]
    return next((p for p in probes if not p.usable), probes[0])


def open_openvino(runtime: GraphRuntime, opts: RuntimeOptions, name: str) -> Any:
    from service.engine.ov_session import OpenVINOSession, warm_cache

    threads = opts.threads_for(graph_stage(name))
    precision: Literal["bf16", "f32"] = "bf16" if runtime.precision == "bf16" else "f32"
    cache = opts.compiled_cache_dir
    if cache is not None:
        cache = warm_cache(runtime.path, runtime.fingerprint, threads, precision, cache)
    entries = opts.openvino_shape_cache_entries
    if opts.acoustic_nice <= 0:
        return OpenVINOSession(runtime.path, threads, precision, cache, entries)
    result: dict[str, Any] = {}

    def target() -> None:  # compiled at lower priority: OpenVINO's worker threads inherit it
        lower_thread_priority(opts.acoustic_nice)
        try:
            result["session"] = OpenVINOSession(runtime.path, threads, precision, cache, entries)
        except BundleError as e:
            result["error"] = e

    worker = threading.Thread(target=target, name="ov-compile")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["session"]
