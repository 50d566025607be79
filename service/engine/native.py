"""Our native kernels: the shared library built from service/engine/native, service/layers/native and the families'
native/ folders (`make native`), what it says of this CPU, and which of its code paths run here.

The library holds ONNX Runtime custom operators (native/README.md): cosyvoice_lite.Int8MatMul and CachedAttention
(the kit's) and EstimatorBlock (DiTBlock: the same with a DiT's modulation), Qwen2Layer and RelPosLayer (fused
layers), used by the native twins of quantized bundles (service.bundle GROUP_NATIVE). Its one CPU probe (native/cpu.c)
answers for C and for this module; each operator has a table of variants (portable, AVX2, AVX-512 ..., AMX) and says
which one it takes under a ceiling (`KernelsCeiling`, from the engine lever native_kernels), which reaches the kernels
as a session config entry (`session_config`). A twin runs where its deciding kernels have a fast variant here
(`KERNELS_OF_GRAPH`: any but the portable C; the AVX2 ones unless the engine lever native_on_avx2 is off), or
everywhere with the portable C when asked; elsewhere, and where the library is not built or the installed ONNX
Runtime is too old for it, the core graph runs.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

LIBRARY_PATH = Path(__file__).resolve().parent / "native" / "libcosyvoice_lite_native.so"
BUILD_HINT = "make native (needs a C compiler, e.g. apt-get install gcc)"
# The ceiling on the kernels' code: every variant the CPU has, all but AMX tiles, or the portable C only.
KernelsCeiling = Literal["auto", "no-amx", "portable"]
CEILING_CONFIG_KEY = "cosyvoice_lite.kernels"  # the session config entry the kernels read (native/ort_kernel.h)
# The graph input of a step twin that splits a decode step's int8 products into tasks (export/fuse_ops.py add_spread_input): an
# initializer of value 1 the caller may override per run (DecodeSpread).
SPREAD_INPUT = "decode_spread"
# The variant name of the kernels' AVX2 code (AVX2, FMA, F16C: the fast variant of CPUs without AVX-512).
AVX2_VARIANT = "avx2"
# The operators whose fast variant decides whether a graph's twin pays here (service.bundle NATIVE_GRAPHS): the
# estimator's attention (bf16, or float32 on AVX2) and its int8 products; the decode step's int8 products and its
# relative-position decoder layers (a step twin of Qwen2Layer nodes has none; RelPosLayer has the same fast variants);
# the vocoder's bf16 convolutions (AVX-512, with BF16 or without; never their AVX2 code, runtimes._takes_avx2: on an
# AVX2 CPU ONNX Runtime's float32 graph runs). An estimator twin's convolutions run on whichever variant is there
# (their AVX2 and AVX-512 code about as fast as ONNX Runtime's Conv): its attention and products decide.
KERNELS_OF_GRAPH: dict[str, tuple[str, ...]] = {
    "flow_estimator": ("CachedAttention", "Int8MatMul"),
    "llm_step": ("Int8MatMul", "RelPosLayer"),
    "hift_decode": ("BF16Conv1d",),
}


@dataclass(frozen=True)
class NativeKernels:
    """Whether the library can serve, the variant it takes, and why not when it cannot."""

    path: Path | None
    reason: str  # "" when usable
    variant: str = ""

    @property
    def usable(self) -> bool:
        return self.path is not None


@functools.lru_cache(maxsize=4)
def _library(path: Path) -> Any:
    """The library loaded with its exported functions typed (OSError or AttributeError when it cannot be)."""
    lib = ctypes.CDLL(str(path))
    lib.cvl_cpu_features.restype = ctypes.c_uint32
    lib.cvl_cpu_features.argtypes = []
    lib.cvl_feature_name.restype = ctypes.c_char_p
    lib.cvl_feature_name.argtypes = [ctypes.c_int]
    lib.cvl_isa_features.restype = ctypes.c_uint32
    lib.cvl_isa_features.argtypes = [ctypes.c_int]
    lib.cvl_isa_parse.restype = ctypes.c_int
    lib.cvl_isa_parse.argtypes = [ctypes.c_char_p]
    lib.cvl_op_variant.restype = ctypes.c_char_p
    lib.cvl_op_variant.argtypes = [ctypes.c_char_p, ctypes.c_uint32, ctypes.c_int64]
    lib.cvl_op_variant_at.restype = ctypes.c_char_p
    lib.cvl_op_variant_at.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_uint32)]
    return lib


def _names(lib: Any, features: int) -> list[str]:
    return [lib.cvl_feature_name(bit).decode() for bit in range(32) if features >> bit & 1 and lib.cvl_feature_name(bit)]


@functools.lru_cache(maxsize=4)
def cpu_features(path: Path = LIBRARY_PATH) -> frozenset[str] | None:
    """The CPU features the library's probe found (Linux flag names: "avx512_bf16", "amx_tile" ...; the AMX ones only
    where Linux lets this process use the tiles), or None where the library is not built or does not load."""
    try:
        lib = _library(path)
        return frozenset(_names(lib, lib.cvl_cpu_features()))
    except (OSError, AttributeError):
        return None


@functools.lru_cache(maxsize=4)
def runtime_refusal(path: Path = LIBRARY_PATH) -> str:
    """Why the installed ONNX Runtime cannot register the library's operators ("" when it can): it checks the
    runtime's version and C API against the entries the operators call (native/ort_api.c)."""
    import onnxruntime as ort

    try:
        ort.SessionOptions().register_custom_ops_library(str(path))
    except Exception as e:  # onnxruntime raises its own exception types for a refused library
        return str(e).strip() or type(e).__name__
    return ""


def _missing(lib: Any, op: str, have: int, first: int = 1) -> str:
    """The features variant `first` of `op` (1: its first fast one) needs and `have` lacks ("avx2, ..."; its name
    after)."""
    needs = ctypes.c_uint32()
    name = lib.cvl_op_variant_at(op.encode(), first, ctypes.byref(needs))
    if name is None:
        return "a fast variant"
    return f"{', '.join(_names(lib, needs.value & ~have))} ({op}'s {name.decode()})"


@functools.lru_cache(maxsize=32)
def probe(
    path: Path = LIBRARY_PATH,
    head_dim: int = 64,
    kernel: str = "CachedAttention",
    kernels: KernelsCeiling = "auto",
    avx2: bool = True,
) -> NativeKernels:
    """Load the library once and ask which variant operator `kernel` takes here under the ceiling `kernels` (for a
    head size `head_dim` where that matters): usable where it is a fast one (its AVX2 code only with `avx2`: the engine
    lever native_on_avx2), or the portable C when that was asked."""
    if not path.is_file():
        return NativeKernels(None, f"{path.name} is not built ({BUILD_HINT})")
    try:
        lib = _library(path)
        ceiling = lib.cvl_isa_parse(kernels.encode())
        have = lib.cvl_isa_features(ceiling) if ceiling >= 0 else 0
        variant = lib.cvl_op_variant(kernel.encode(), have, head_dim)
    except (OSError, AttributeError) as e:
        return NativeKernels(None, f"{path.name} does not load: {e}")
    refused = runtime_refusal(path)
    if refused:
        return NativeKernels(None, f"ONNX Runtime refuses {path.name}: {refused}")
    if variant is None:
        return NativeKernels(None, f"{path.name} has no operator {kernel}")
    if variant == b"portable" and kernels != "portable":
        why = "this CPU lacks" if kernels == "auto" else f"TTS_ENGINE_PROFILE=native_kernels={kernels} leaves out"
        return NativeKernels(None, f"{why} {_missing(lib, kernel, have)}")
    if variant.decode() == AVX2_VARIANT and not avx2:
        lever = "TTS_ENGINE_PROFILE=native_on_avx2=false"
        return NativeKernels(None, f"{lever} leaves out {kernel}'s avx2 and this CPU lacks {_missing(lib, kernel, have, 2)}")
    return NativeKernels(path, "", variant.decode())


def amx_tiles(path: Path = LIBRARY_PATH, kernels: KernelsCeiling = "auto") -> bool:
    """True when the kernels take AMX tiles here under `kernels`: int8 products of 8 rows or more (the same integer
    sums as the VNNI code) and the attention for head sizes 32 and 64 (bf16 products, float32 sums)."""
    ops = (("Int8MatMul", 64), ("CachedAttention", 64))
    return all(probe(path, dim, op, kernels).variant.startswith("amx") for op, dim in ops)


def session_config(kernels: KernelsCeiling) -> dict[str, str]:
    """The session config entries that give the kernels their ceiling (read when a kernel is created)."""
    return {CEILING_CONFIG_KEY: kernels}


class DecodeSpread:
    """A step session whose twin's int8 products of a decode step split into `tasks` tasks over the session's
    threads (SPREAD_INPUT, fed with every run): 1 keeps them on the calling thread. The caller sets `tasks` before
    each step, on the thread that runs the steps."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.tasks = 1

    def run(self, output_names: Any, feeds: dict[str, np.ndarray], *args: Any, **kwargs: Any) -> Any:
        spread = {SPREAD_INPUT: np.array([self.tasks], np.int64)}
        return self.session.run(output_names, {**feeds, **spread}, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)


def takes_spread(session: Any) -> bool:
    """Whether an opened step session has the SPREAD_INPUT (a step twin written since it was added)."""
    overridable = getattr(session, "get_overridable_initializers", None)
    return overridable is not None and any(i.name == SPREAD_INPUT for i in overridable())


_CODEC_TYPES = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}


class FrameCodec:
    """The library's int8 flow-cache frames (native/frame_codec.h): rows of `dim` values as int8 times one float32
    scale, narrowed from and widened to the graph's float16 or float32; the same bits as numpy's arithmetic
    (service/layers/frame_cache.py), tens of times faster (numpy converts float16 one value at a time)."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        for kind in _CODEC_TYPES.values():
            narrow, widen = getattr(lib, f"cvl_frames_narrow_{kind}"), getattr(lib, f"cvl_frames_widen_{kind}")
            narrow.restype = widen.restype = None
            narrow.argtypes = [pointer, size, size, pointer, pointer]  # x, rows, dim, q, scale
            widen.argtypes = [pointer, pointer, size, size, pointer]  # q, scale, rows, dim, out
            blocks = getattr(lib, f"cvl_frames_narrow_blocks_{kind}")
            blocks.restype = None
            blocks.argtypes = [pointer, size, size, size, size, pointer, size, pointer, size]
            wide = getattr(lib, f"cvl_frames_widen_blocks_{kind}")
            wide.restype = None
            wide.argtypes = [pointer, size, size, pointer, size, size, size, pointer, size]

    @staticmethod
    def takes(dtype: np.dtype[Any] | type[Any]) -> bool:
        return np.dtype(dtype) in _CODEC_TYPES

    def narrow(self, x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> None:
        """x (..., dim) float16/float32 -> q (..., dim) int8 and scale (...) float32; all contiguous."""
        _check_rows(x, q, scale)
        dim = x.shape[-1]
        narrow = getattr(self._lib, f"cvl_frames_narrow_{_CODEC_TYPES[x.dtype]}")
        narrow(x.ctypes.data, x.size // dim, dim, q.ctypes.data, scale.ctypes.data)

    def narrow_blocks(self, x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> None:
        """x (blocks, ..., dim) -> q (blocks, ..., dim) and scale (blocks, ...): each block contiguous, the blocks of q
        and scale at any stride (a cache's new frames, one call for every block)."""
        _check_blocks(x, q, scale)
        dim, rows = x.shape[-1], x[0].size // x.shape[-1]
        narrow = getattr(self._lib, f"cvl_frames_narrow_blocks_{_CODEC_TYPES[x.dtype]}")
        narrow(x.ctypes.data, len(x), x.strides[0] // x.itemsize, rows, dim, q.ctypes.data, q.strides[0], scale.ctypes.data,
               scale.strides[0] // 4)  # fmt: skip

    def widen(self, q: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
        """q (..., dim) int8 times scale (...) -> out (..., dim) float16/float32; all contiguous."""
        _check_rows(out, q, scale)
        dim = q.shape[-1]
        widen = getattr(self._lib, f"cvl_frames_widen_{_CODEC_TYPES[out.dtype]}")
        widen(q.ctypes.data, scale.ctypes.data, q.size // dim, dim, out.ctypes.data)

    def widen_blocks(self, q: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
        """q (blocks, ..., dim) int8 times scale (blocks, ...) -> out (blocks, ..., dim) float16/float32: each block
        contiguous, the blocks of all three at any stride (every block's frames of a graph call, in one call)."""
        if out.size == 0:
            return
        _check_blocks(out, q, scale)
        dim, rows = q.shape[-1], q[0].size // q.shape[-1]
        widen = getattr(self._lib, f"cvl_frames_widen_blocks_{_CODEC_TYPES[out.dtype]}")
        widen(q.ctypes.data, len(q), q.strides[0], scale.ctypes.data, scale.strides[0] // 4, rows, dim, out.ctypes.data,
              out.strides[0] // out.itemsize)  # fmt: skip


def _check_blocks(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> None:
    """x and q (blocks, ..., dim), scale (blocks, ...): each block contiguous, x's blocks a whole number of items apart."""
    if x.shape != q.shape or scale.shape != q.shape[:-1] or q.dtype != np.int8 or scale.dtype != np.float32:
        raise ValueError(f"frame codec: x {x.shape} {x.dtype}, q {q.shape} {q.dtype}, scale {scale.shape} {scale.dtype}")
    if not all(a[0].flags.c_contiguous for a in (x, q, scale)) or x.strides[0] % x.itemsize:
        raise ValueError("frame codec: each block must be contiguous")


def _check_rows(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> None:
    if not (x.shape == q.shape and scale.shape == q.shape[:-1] and q.dtype == np.int8 and scale.dtype == np.float32):
        raise ValueError(f"frame codec: x {x.shape} {x.dtype}, q {q.shape} {q.dtype}, scale {scale.shape} {scale.dtype}")
    if not all(a.flags.c_contiguous for a in (x, q, scale)):
        raise ValueError("frame codec: arrays must be contiguous")


@functools.lru_cache(maxsize=1)
def frame_codec(path: Path = LIBRARY_PATH) -> FrameCodec | None:
    """The library's frame codec, or None where the library is not built or lacks it (numpy does the same then)."""
    if not path.is_file():
        return None
    try:
        return FrameCodec(_library(path))
    except (OSError, AttributeError):
        return None
