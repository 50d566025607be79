"""Run a one-graph model through our native library with a ceiling on its kernels' code: the portable C forced
("portable") or AMX tiles refused ("no-amx"). The ceiling is a session config entry (native.CEILING_CONFIG_KEY) read
when each kernel is created, so sessions with different ceilings live side by side in one process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.engine import native


def native_session(native_library: Path, model: bytes, kernels: native.KernelsCeiling, threads: int = 1) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    for key, value in native.session_config(kernels).items():
        so.add_session_config_entry(key, value)
    so.register_custom_ops_library(str(native_library))
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def run_isolated(
    native_library: Path, model: bytes, feeds: dict[str, np.ndarray], kernels: native.KernelsCeiling = "portable"
) -> list[np.ndarray]:
    """The model's outputs, in order, computed by the `kernels` code paths ("portable", or "no-amx": AVX-512 without
    AMX tiles)."""
    return list(native_session(native_library, model, kernels).run(None, feeds))


def run_portable(native_library: Path, model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The model's outputs, in order, computed by the portable kernels."""
    return run_isolated(native_library, model, feeds, "portable")
