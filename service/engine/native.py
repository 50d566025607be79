"""Our native kernels: the shared library built from service/engine/native/*.c (`make native`) and whether it runs here.

The library holds ONNX Runtime's custom operator cosyvoice_lite.CachedAttention (native/ort_custom_op.c), which the
native twin of a quantized CosyVoice2 flow estimator uses (service.bundle GROUP_NATIVE). It is used only where it
pays: its AVX-512 BF16 kernel needs avx512f/bw/vl/bf16 (Zen 4, Cooper Lake, Sapphire Rapids and later); on other CPUs
the core graph runs instead, as it does when the library was not built (no C compiler) or TTS_NATIVE_KERNELS=off.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

LIBRARY_PATH = Path(__file__).resolve().parent / "native" / "libcosyvoice_lite_native.so"
BUILD_HINT = "make native (needs a C compiler, e.g. apt-get install gcc)"


@dataclass(frozen=True)
class NativeKernels:
    """Whether the library can serve, and why not when it cannot."""

    path: Path | None
    reason: str  # "" when usable

    @property
    def usable(self) -> bool:
        return self.path is not None


@functools.lru_cache(maxsize=4)
def probe(path: Path = LIBRARY_PATH, head_dim: int = 64) -> NativeKernels:
    """Load the library once and ask it whether its fast kernel runs on this CPU for `head_dim`."""
    if not path.is_file():
        return NativeKernels(None, f"{path.name} is not built ({BUILD_HINT})")
    try:
        lib = ctypes.CDLL(str(path))
        fast = lib.cvl_fast_kernel  # cached_attention.h
        fast.argtypes = [ctypes.c_int]
        fast.restype = ctypes.c_int
        ok = bool(fast(head_dim))
    except (OSError, AttributeError) as e:
        return NativeKernels(None, f"{path.name} does not load: {e}")
    if not ok:
        return NativeKernels(None, "this CPU lacks AVX-512 BF16 (avx512f, avx512bw, avx512vl, avx512_bf16)")
    return NativeKernels(path, "")
