"""OpenVINO as a second runtime for the acoustic graphs: a compiled ONNX graph behind ONNX Runtime's `run()` API.

Only service.engine.sessions uses this module (it picks the runtime of each graph); runners never see which runtime
they call. OpenVINO is optional: without the package, or on a CPU without native bf16, the engine stays on ORT.
"""

from __future__ import annotations

import functools
import queue
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from service.errors import BundleError

OVPrecision = Literal["bf16", "f32"]


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


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where there is no /proc/cpuinfo)."""
    try:
        text = cpuinfo.read_text(encoding="ascii", errors="replace")
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


@functools.cache
def native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX-512 BF16 or AMX) and OpenVINO's CPU plugin says it will use it;
    False where bf16 would be emulated (AVX2-only hosts: then openvino is not even imported) or OpenVINO is missing."""
    if not cpu_flags() & BF16_CPU_FLAGS or not available():
        return False
    try:
        capabilities = _core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    except RuntimeError:
        return False
    return "BF16" in {str(c).upper() for c in capabilities}


class OpenVINOSession:
    """A graph compiled by OpenVINO's CPU plugin, called like an onnxruntime InferenceSession (`run`).

    Thread-safe: each concurrent call takes its own infer request from a pool (one is created per extra caller).
    """

    def __init__(self, path: Path, threads: int, precision: OVPrecision) -> None:
        config = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY"}
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
