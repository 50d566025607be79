"""This host's ONNX Runtime GEMM rates at the shapes of `../shared/reference/cpu-limits.md` §2 (2 threads).

fp32 MatMul and dynamic int8 (DynamicQuantizeMatMul, u8 activations x s8 weights) with full-range and with 7-bit
weights (`reduce_range`, what our bundles use). Effective GOP/s = 2*M*K*N / time, activation quantization included.
It tells how this host's int8 rate compares with the machine the targets were planned against (VNNI: 395-660).

    python loadtest/gemm_rate.py            # one JSON line per shape
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

SHAPES = ((800, 256, 512), (800, 256, 1024), (800, 1024, 256), (2048, 2048, 2048))


def matmul_model(k: int, n: int, path: Path) -> None:
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, n), dtype=np.float32) * 0.05, "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "w"], ["y"])],
        "gemm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 7  # what opset 13 needs; the onnx package writes a newer one than ORT reads
    onnx.save(model, path)


def rate(path: Path, m: int, k: int, n: int, reps: int = 7) -> float:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    a = np.random.default_rng(1).standard_normal((m, k), dtype=np.float32)
    calls = max(1, int(2e10 // (2 * m * k * n)))
    session.run(None, {"a": a})
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            session.run(None, {"a": a})
        times.append((time.perf_counter() - t0) / calls)
    return 2 * m * k * n / float(np.median(times)) / 1e9


def main() -> int:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        for m, k, n in SHAPES:
            fp32 = Path(tmp) / f"fp32_{k}_{n}.onnx"
            matmul_model(k, n, fp32)
            row: dict[str, object] = {"shape": f"{m}x{k}x{n}", "fp32_gflops": round(rate(fp32, m, k, n), 1)}
            for name, reduce_range in (("int8_gops", False), ("int8_7bit_gops", True)):
                q = Path(tmp) / f"{name}_{k}_{n}.onnx"
                quantize_dynamic(fp32, q, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"], reduce_range=reduce_range)
                row[name] = round(rate(q, m, k, n), 1)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
