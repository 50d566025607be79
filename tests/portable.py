"""Run a one-graph model through our native library with the portable kernels forced (COSYVOICE_LITE_PORTABLE_KERNELS=1),
in a process of its own: each kernel picks its code path once per process."""

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
assert not native.probe(kernel='int8_matmul').usable and not native.probe(kernel='attention').usable  # portable code runs
so = ort.SessionOptions(); so.register_custom_ops_library(sys.argv[1])
s = ort.InferenceSession(sys.argv[2] + '/model.onnx', so, providers=['CPUExecutionProvider'])
out = s.run(None, dict(np.load(sys.argv[2] + '/feeds.npz')))
np.savez(sys.argv[2] + '/outputs.npz', *out)
"""


def run_portable(native_library: Path, model: bytes, feeds: dict[str, np.ndarray], work: Path) -> list[np.ndarray]:
    """The model's outputs, in order, computed by the portable kernels (files in `work`)."""
    (work / "model.onnx").write_bytes(model)
    np.savez(work / "feeds.npz", **feeds)
    env = {**os.environ, "COSYVOICE_LITE_PORTABLE_KERNELS": "1"}
    subprocess.run([sys.executable, "-c", _SCRIPT, str(native_library), str(work)], cwd=REPO, env=env, check=True)
    with np.load(work / "outputs.npz") as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]
