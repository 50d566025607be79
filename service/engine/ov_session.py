"""OpenVINO as a second runtime for the acoustic graphs: a compiled ONNX graph behind ONNX Runtime's `run()` API.

Only service.engine.sessions uses this module (it picks the runtime of each graph); runners never see which runtime
they call. OpenVINO is optional: without the package, or on a CPU without native bf16, the engine stays on ORT.
"""

from __future__ import annotations

import functools
import logging
import queue
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from service.engine import native
from service.errors import BundleError

OVPrecision = Literal["bf16", "f32"]
COMPILE_TIMEOUT_S = 600
# Entries of OpenVINO's CPU runtime cache per compiled graph: the executors it built for each input shape, least
# recently used dropped first. The acoustic graphs see a new length at almost every chunk, and OpenVINO's own default
# (5000 entries, ~200 lengths of a HiFT graph) let one tiny-bundle HiFT graph grow the process by 1.3 GB over 200
# lengths; with 256, by 0.22 GB, most of it oneDNN's primitive cache (1,024 kernels per process, bounded by oneDNN),
# which keeps rebuilding an executor for a length seen before cheap.
SHAPE_CACHE_ENTRIES = 256
log = logging.getLogger(__name__)


BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def _core() -> Any:
    # `import openvino` imports its model converter, which sends a usage event through openvino_telemetry when that
    # package imports; a None entry makes the import fail and the converter use its own no-op stub instead
    sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]  # None: "this import fails"
    import openvino

    return openvino.Core()


def available() -> bool:
    """True when the openvino package imports."""
    try:
        _core()
    except ImportError:
        return False
    return True


@functools.cache
def native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX-512 BF16 or AMX, as our library's CPU probe reports it) and
    OpenVINO's CPU plugin says it will use it; False where bf16 would be emulated (AVX2-only hosts: then openvino is
    not even imported), where the probe cannot answer (the library is not built) or OpenVINO is missing."""
    if not (native.cpu_features() or frozenset()) & BF16_CPU_FLAGS or not available():
        return False
    try:
        capabilities = _core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    except RuntimeError:
        return False
    return "BF16" in {str(c).upper() for c in capabilities}


def compile_config(
    threads: int, precision: OVPrecision, cache_dir: Path | None = None, shape_cache_entries: int = SHAPE_CACHE_ENTRIES
) -> dict[str, Any]:
    """The CPU plugin's options for one acoustic graph (the model cache's key does not depend on `shape_cache_entries`)."""
    config: dict[str, Any] = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": precision}
    config["CPU_RUNTIME_CACHE_CAPACITY"] = shape_cache_entries
    config["PERFORMANCE_HINT"] = "LATENCY"
    # unpinned, its threads move to whichever core the LLM's ONNX Runtime threads leave free (pinned, a thread waits
    # for its own core while another is idle, which is slower with the decode step running beside it)
    config["ENABLE_CPU_PINNING"] = False
    if cache_dir is not None:
        config["CACHE_DIR"] = str(cache_dir)
    return config


def warm_cache(path: Path, fingerprint: str, threads: int, precision: OVPrecision, cache_dir: Path) -> Path | None:
    """Make sure `cache_dir` holds the compiled form of `path`; returns it, or None when it cannot be used.

    A graph compiled in this process keeps its source weights resident beside the compiled ones (the full-size
    estimator: 0.33 GB instead of 0.14 GB); one imported from OpenVINO's model cache does not. So the first start
    compiles it in a child process, which writes the cache, and every start imports it. `fingerprint` (the graph's
    sha256) names the marker that says the cache is warm for this graph, precision, thread count and OpenVINO.
    """
    build = _core().get_versions("CPU")["CPU"].build_number if available() else "none"
    version = "".join(ch if ch.isalnum() or ch in ".-" else "_" for ch in build)  # e.g. 2026.4.1-22982-..._2026_4
    marker = cache_dir / f"{fingerprint[:16]}-{precision}-{threads}-{version}.ready"
    if marker.is_file():
        return cache_dir
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "service.engine.ov_session", str(path), precision, str(threads), str(cache_dir)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False)
        if done.returncode != 0:
            log.warning("OpenVINO model cache not used for %s: %s", path.name, done.stderr.strip()[-300:])
            return None
        marker.touch()
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("OpenVINO model cache %s not used: %s", cache_dir, e)
        return None
    return cache_dir


class OpenVINOSession:
    """A graph compiled by OpenVINO's CPU plugin, called like an onnxruntime InferenceSession (`run`).

    Thread-safe: each concurrent call takes its own infer request from a pool (one is created per extra caller).
    With a `cache_dir` (see warm_cache) the compiled graph is imported from OpenVINO's model cache. What it keeps for
    input shapes seen before is bounded by `shape_cache_entries` (see SHAPE_CACHE_ENTRIES).
    """

    def __init__(
        self,
        path: Path,
        threads: int,
        precision: OVPrecision,
        cache_dir: Path | None = None,
        shape_cache_entries: int = SHAPE_CACHE_ENTRIES,
    ) -> None:
        config = compile_config(threads, precision, cache_dir, shape_cache_entries)
        try:
            self._compiled = _core().compile_model(str(path), "CPU", config)
        except RuntimeError as e:
            raise BundleError(f"{path}: OpenVINO cannot compile this graph: {e}") from e
        self.path = path
        self.precision = precision
        self._outputs = {name: o for o in self._compiled.outputs for name in o.get_names()}  # a port has every alias
        self._idle: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def run(self, output_names: list[str] | None, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        names = [o.get_any_name() for o in self._compiled.outputs] if output_names is None else output_names
        try:
            request = self._idle.get_nowait()
        except queue.Empty:
            request = self._compiled.create_infer_request()
        try:
            results = request.infer(dict(feeds))
            return [np.array(results[self._outputs[name]]) for name in names]  # a copy: the request reuses its buffers
        finally:
            self._idle.put(request)


def main(argv: list[str]) -> int:
    """`python -m service.engine.ov_session GRAPH PRECISION THREADS CACHE_DIR`: compile once, writing the model cache."""
    path, precision, threads, cache_dir = argv
    if precision not in ("bf16", "f32"):
        print(f"error: precision must be bf16 or f32, got {precision!r}", file=sys.stderr)
        return 2
    _core().compile_model(path, "CPU", compile_config(int(threads), precision, Path(cache_dir)))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
