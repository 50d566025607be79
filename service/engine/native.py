"""Our native kernels: the shared library built from service/engine/native/*.c (`make native`) and whether it runs here.

The library holds three ONNX Runtime custom operators (native/ort_custom_op.c), used by the native twins of quantized
bundles (service.bundle GROUP_NATIVE): cosyvoice_lite.EstimatorBlock (a transformer block of a chunk-causal flow
estimator, with its attention) and cosyvoice_lite.Int8MatMul in the estimator and the LLM step, plus
cosyvoice_lite.CachedAttention, which older estimator twins hold. Each is used only where it pays: the attention's
kernel needs AVX-512 BF16 (avx512f/bw/vl/bf16: Zen 4, Cooper Lake, Sapphire Rapids and later), the int8 products' AVX-512 VNNI
(avx512f/bw/vl/vnni: also Ice Lake and Cascade Lake); elsewhere the core graph runs instead, as it does when the
library was not built (no C compiler) or TTS_NATIVE_KERNELS=off. Where the CPU has AMX (Sapphire Rapids and later) the
same kernels take AMX tiles for their larger products and the estimator's attention (`amx_tiles`).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

LIBRARY_PATH = Path(__file__).resolve().parent / "native" / "libcosyvoice_lite_native.so"
BUILD_HINT = "make native (needs a C compiler, e.g. apt-get install gcc)"
Kernel = Literal["attention", "int8_matmul"]
# What each kernel's fast path needs, for the reason given when it is not there.
NEEDS: dict[str, str] = {
    "attention": "AVX-512 BF16 (avx512f, avx512bw, avx512vl, avx512_bf16)",
    "int8_matmul": "AVX-512 VNNI (avx512f, avx512bw, avx512vl, avx512_vnni)",
}
# The kernels a graph's native twin runs (service.bundle NATIVE_GRAPHS; export/native_twin.py).
KERNELS_OF_GRAPH: dict[str, tuple[Kernel, ...]] = {
    "flow_estimator": ("attention", "int8_matmul"),
    "llm_step": ("int8_matmul",),
}


@dataclass(frozen=True)
class NativeKernels:
    """Whether the library can serve, and why not when it cannot."""

    path: Path | None
    reason: str  # "" when usable

    @property
    def usable(self) -> bool:
        return self.path is not None


@functools.lru_cache(maxsize=8)
def probe(path: Path = LIBRARY_PATH, head_dim: int = 64, kernel: Kernel = "attention") -> NativeKernels:
    """Load the library once and ask it whether the fast path of `kernel` runs on this CPU (the attention's for
    `head_dim`)."""
    if not path.is_file():
        return NativeKernels(None, f"{path.name} is not built ({BUILD_HINT})")
    try:
        lib = ctypes.CDLL(str(path))
        if kernel == "attention":
            fast = lib.cvl_fast_kernel  # cached_attention.h
            fast.argtypes = [ctypes.c_int]
            fast.restype = ctypes.c_int
            ok = bool(fast(head_dim))
        else:
            fast = lib.cvl_int8_fast_kernel  # int8_matmul.h
            fast.argtypes = []
            fast.restype = ctypes.c_int
            ok = bool(fast())
    except (OSError, AttributeError) as e:
        return NativeKernels(None, f"{path.name} does not load: {e}")
    if not ok:
        return NativeKernels(None, f"this CPU lacks {NEEDS[kernel]}")
    return NativeKernels(path, "")


@functools.lru_cache(maxsize=8)
def amx_tiles(path: Path = LIBRARY_PATH) -> bool:
    """True when the library's kernels take AMX tiles in this process (AMX-INT8 and AMX-BF16: Sapphire Rapids and
    later, tile data granted by Linux, COSYVOICE_LITE_AMX not 0): the int8 products of 16 rows or more (the flow
    estimator's, the LLM's prefill; the same integer sums as the VNNI code) and the estimator's attention for head
    sizes 32 and 64 (bf16 products, float32 sums, as the AVX-512 BF16 code)."""
    try:
        lib = ctypes.CDLL(str(path))
        checks = (lib.cvl_amx_int8, lib.cvl_amx_bf16)  # amx.h
        for check in checks:
            check.argtypes = []
            check.restype = ctypes.c_int
        return all(bool(check()) for check in checks)
    except (OSError, AttributeError):
        return False


@functools.lru_cache(maxsize=8)
def _spread_function(path: Path) -> Any:
    """The library's cvl_int8_set_spread (int8_matmul.h), or None where the library is not built or does not load
    (looked up once: the scheduler calls it before every decode step)."""
    try:
        function = ctypes.CDLL(str(path)).cvl_int8_set_spread
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = None
    return function


def spread_decode_products(tasks: int, path: Path = LIBRARY_PATH) -> None:
    """How many tasks our int8 kernel splits a decode step's products into from now on, in this process: 1 keeps them
    on the calling thread (the other core runs the flow), more share them over the step session's threads when the
    caller knows those cores are idle. The results do not change. Nothing happens where the library is not built."""
    function = _spread_function(path)
    if function is not None:
        function(tasks)
