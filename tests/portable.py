"""Run a one-graph model through our native library in a process of its own, with the portable kernels forced
(COSYVOICE_LITE_PORTABLE_KERNELS=1) or AMX refused (COSYVOICE_LITE_AMX=0): each kernel picks its code path once per
process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = """
import sys, numpy as np, onnxruntime as ort
from service.engine import native
if sys.argv[3] == 'portable':  # the portable code runs
    assert not native.probe(kernel='int8_matmul').usable and not native.probe(kernel='attention').usable
else:  # the AVX-512 code runs, without AMX tiles
    assert native.probe(kernel='int8_matmul').usable and not native.amx_tiles()
so = ort.SessionOptions(); so.register_custom_ops_library(sys.argv[1])
s = ort.InferenceSession(sys.argv[2] + '/model.onnx', so, providers=['CPUExecutionProvider'])
out = s.run(None, dict(np.load(sys.argv[2] + '/feeds.npz')))
np.savez(sys.argv[2] + '/outputs.npz', *out)
"""

_ENV = {"portable": {"COSYVOICE_LITE_PORTABLE_KERNELS": "1"}, "no-amx": {"COSYVOICE_LITE_AMX": "0"}}


def run_isolated(
    native_library: Path, model: bytes, feeds: dict[str, np.ndarray], work: Path, kernels: str = "portable"
) -> list[np.ndarray]:
    """The model's outputs, in order, computed by the `kernels` code paths ("portable", or "no-amx": AVX-512 without
    AMX tiles), in a process of their own (files in `work`)."""
    (work / "model.onnx").write_bytes(model)
    np.savez(work / "feeds.npz", **feeds)
    env = {**os.environ, **_ENV[kernels]}
    subprocess.run([sys.executable, "-c", _SCRIPT, str(native_library), str(work), kernels], cwd=REPO, env=env, check=True)
    with np.load(work / "outputs.npz") as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def run_portable(native_library: Path, model: bytes, feeds: dict[str, np.ndarray], work: Path) -> list[np.ndarray]:
    """The model's outputs, in order, computed by the portable kernels."""
    return run_isolated(native_library, model, feeds, work, "portable")
