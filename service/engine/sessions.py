"""The one place that configures ONNX Runtime: RuntimeOptions -> SessionOptions -> CPU sessions, per stage."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnxruntime as ort

from service.bundle import GRAPH_NAMES, GROUP_PROMPT, NATIVE_GRAPHS, NATIVE_SUFFIX, PROMPT_GRAPHS, GraphEntry, ModelBundle
from service.engine import native
from service.errors import BundleError

log = logging.getLogger(__name__)

ExecutionMode = Literal["sequential", "parallel"]
GraphOptimization = Literal["all", "extended", "basic", "disabled"]
Stage = Literal["llm", "acoustic"]
StreamSchedule = Literal["adaptive", "official"]
AcousticBackend = Literal["auto", "ort", "openvino"]
NativeKernelsMode = Literal["auto", "off"]

_EXECUTION_MODES: dict[str, ort.ExecutionMode] = {
    "sequential": ort.ExecutionMode.ORT_SEQUENTIAL,
    "parallel": ort.ExecutionMode.ORT_PARALLEL,
}
_GRAPH_OPTIMIZATION: dict[str, ort.GraphOptimizationLevel] = {
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}
PROVIDERS: tuple[str, ...] = ("CPUExecutionProvider",)
# Graphs only needed to (re)build a table: opened for that call and released, so their weights do not
# stay resident (llm_pos holds NL x D x D fp32 weights, 58 MB full-size, used once per table size).
TRANSIENT_GRAPHS: frozenset[str] = frozenset({"llm_pos"})
# Graphs run per token or per Euler step keep ORT's pre-packed weight copies (2x faster int8 GEMMs);
# the others run once per request or chunk, where the second copy of their weights (40-100 MB) is not
# worth the few milliseconds it saves.
PREPACKED_GRAPHS: frozenset[str] = frozenset({"llm_step", "flow_estimator", "hift_decode", "hift_f0"})
# Graphs OpenVINO may run (acoustic_backend): measured faster in bf16 than ORT runs them (estimator int8: 1.5x,
# HiFT decode fp32: 1.6x, on AVX-512 BF16). The LLM step stays on ORT (OpenVINO was 2x slower there).
OPENVINO_GRAPHS: frozenset[str] = frozenset({"flow_estimator", "hift_decode", "hift_f0"})


def graph_stage(name: str) -> Stage:
    """The stage a graph belongs to: the LLM graphs, or the acoustic ones (flow, HiFT, and the prompt models,
    which like them run once per request on variable-length audio)."""
    return "llm" if name.startswith("llm_") else "acoustic"


@dataclass(frozen=True)
class RuntimeOptions:
    """Runtime settings of one engine: ONNX Runtime session options and how its two stages share the cores.

    Thread budget rule: the threads that run graphs at the same time must not exceed the cores. With the
    batching scheduler (`max_batch > 0`) one LLM thread decodes every request while at most
    `acoustic_slots` flow/HiFT calls run beside it, so `llm_threads + acoustic_slots * acoustic_threads`
    is what competes for the cores. Without it every concurrent request runs its own sessions:
    `concurrent requests * intra_op_threads <= cores`.
    ORT pins one pool per session call; two spinning pools on one core fight for it, so spinning is only
    worth it when a single graph runs at a time (`allow_spinning`, default off).
    `acoustic_nice` > 0 lowers the OS priority of the threads that run flow/HiFT (their ORT pools and the
    calling threads), so a decode step never waits for a vocoder call: the LLM takes the cores when it
    needs them and the acoustic work fills the rest. Linux only; ignored elsewhere.
    """

    intra_op_threads: int = 2
    inter_op_threads: int = 1
    llm_threads: int | None = None  # None: intra_op_threads
    acoustic_threads: int | None = None  # None: intra_op_threads
    execution_mode: ExecutionMode = "sequential"
    graph_optimization: GraphOptimization = "all"
    enable_cpu_mem_arena: bool = True
    enable_mem_pattern: bool = True
    # Spinning keeps idle pool threads busy-waiting for the next op: lower latency when one graph owns
    # the machine, wasted CPU (and a slower neighbour) when stages or other processes share the cores.
    allow_spinning: bool = False
    log_severity: int = 3  # 0 verbose .. 4 fatal
    max_batch: int = 16  # LLM rows per batched decode step; 0 = no scheduler thread
    acoustic_slots: int = 1  # flow/HiFT calls running at once; 0 = unlimited
    acoustic_nice: int = 0  # OS niceness added to acoustic threads (0 = same priority as the LLM)
    # While a request's first chunk is vocoded, the scheduler pauses decoding unless a consumer waits for
    # tokens: the first audio then gets both cores instead of sharing them with tokens nobody needs yet.
    first_audio_priority: bool = True
    # CosyVoice2: while acoustic calls run, the scheduler pauses decoding once every stream has this many tokens decoded
    # ahead of its flow; None: the chunk schedule's largest hop (the next chunk's tokens), 0: never.
    decode_lead_tokens: int | None = None
    # Return a flow/HiFT session's unused arena memory after each call: their activation peaks (HiFT ~120 MB
    # for 5 s of audio) then do not stay resident side by side; measured at no cost in speed.
    shrink_acoustic_arenas: bool = True
    # glibc malloc arenas for the whole process (see limit_malloc_arenas); 0 keeps glibc's default.
    malloc_arenas: int = 2
    # How streamed sentences are cut into chunks: "adaptive" (service.engine.chunking) or "official" (the official
    # v1 boundaries: every hop token_hop_len).
    stream_schedule: StreamSchedule = "adaptive"
    first_hop_tokens: int | None = None  # the first streamed chunk's hop; None: the schedule's own
    # Seconds of a cloned voice's prompt the flow sees with each streamed chunk; None: all of it (official).
    prompt_window_s: float | None = None
    # Megabytes streamed sentences' growing state may hold at once (service.engine.memory); None: auto, 0: no bound.
    flow_cache_mb: int | None = None
    # Runtime of the OPENVINO_GRAPHS: "auto" = OpenVINO in bf16 where the CPU computes bf16 natively (AVX-512 BF16,
    # AMX) and the openvino package is installed, else ORT; "ort"; "openvino" (bf16 where native, else f32).
    # The engine's own default is ORT (parity checks, tools); the service's setting defaults to "auto".
    acoustic_backend: AcousticBackend = "ort"
    # Where OpenVINO keeps compiled graphs (imported at every start after the first: faster, and 0.19 GB less resident
    # for the full-size estimator); None: compile in this process at every start.
    compiled_cache_dir: Path | None = None
    # Native twins of the NATIVE_GRAPHS (a quantized bundle's graphs with kernels of ours: the CosyVoice2 estimator's
    # attention, the LLM step's int8 products): "auto" runs a twin where the bundle has one and our library's kernel
    # for it runs here (service.engine.native), "off" the core graphs.
    native_kernels: NativeKernelsMode = "auto"

    def __post_init__(self) -> None:
        stage_threads = [t for t in (self.llm_threads, self.acoustic_threads) if t is not None]
        if min(self.intra_op_threads, self.inter_op_threads, *stage_threads) < 1:
            raise ValueError("intra_op_threads, inter_op_threads, llm_threads and acoustic_threads must be >= 1")
        if self.execution_mode not in _EXECUTION_MODES:
            raise ValueError(f"execution_mode must be one of {sorted(_EXECUTION_MODES)}")
        if self.graph_optimization not in _GRAPH_OPTIMIZATION:
            raise ValueError(f"graph_optimization must be one of {sorted(_GRAPH_OPTIMIZATION)}")
        if not 0 <= self.log_severity <= 4:
            raise ValueError("log_severity must be in 0..4")
        if self.malloc_arenas < 0:
            raise ValueError("malloc_arenas must be >= 0")
        if self.decode_lead_tokens is not None and self.decode_lead_tokens < 0:
            raise ValueError("decode_lead_tokens must be >= 0")
        if self.max_batch < 0 or self.acoustic_slots < 0 or not 0 <= self.acoustic_nice <= 19:
            raise ValueError("max_batch and acoustic_slots must be >= 0, acoustic_nice in 0..19")
        if self.stream_schedule not in ("adaptive", "official"):
            raise ValueError("stream_schedule must be 'adaptive' or 'official'")
        if self.prompt_window_s is not None and self.prompt_window_s < 0:
            raise ValueError("prompt_window_s must be >= 0")
        if self.flow_cache_mb is not None and self.flow_cache_mb < 0:
            raise ValueError("flow_cache_mb must be >= 0")
        if self.acoustic_backend not in ("auto", "ort", "openvino"):
            raise ValueError("acoustic_backend must be 'auto', 'ort' or 'openvino'")
        if self.native_kernels not in ("auto", "off"):
            raise ValueError("native_kernels must be 'auto' or 'off'")

    def threads_for(self, stage: Stage) -> int:
        """Intra-op threads of the sessions of one stage."""
        chosen = self.llm_threads if stage == "llm" else self.acoustic_threads
        return chosen or self.intra_op_threads

    def max_workers(self, cores: int) -> int:
        """Largest worker count that keeps `workers * intra_op_threads <= cores` (at least 1)."""
        return max(1, cores // self.intra_op_threads)


def make_session_options(opts: RuntimeOptions, graph: str | None = None) -> ort.SessionOptions:
    """Translate RuntimeOptions into an ort.SessionOptions (the only place ORT knobs are set).

    With a `graph` name the options are specialised for it: its stage's thread count; memory patterns
    only for the LLM (flow/HiFT see a new length every chunk, so a cached pattern is never reused but
    its buffer stays allocated); pre-packed weights only for PREPACKED_GRAPHS.
    """
    so = ort.SessionOptions()
    so.intra_op_num_threads = opts.threads_for(graph_stage(graph)) if graph else opts.intra_op_threads
    so.inter_op_num_threads = opts.inter_op_threads
    so.execution_mode = _EXECUTION_MODES[opts.execution_mode]
    so.graph_optimization_level = _GRAPH_OPTIMIZATION[opts.graph_optimization]
    so.enable_cpu_mem_arena = opts.enable_cpu_mem_arena
    so.enable_mem_pattern = opts.enable_mem_pattern and (graph is None or graph_stage(graph) == "llm")
    so.log_severity_level = opts.log_severity
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if opts.allow_spinning else "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "1" if opts.allow_spinning else "0")
    if graph is not None:
        so.add_session_config_entry("session.disable_prepacking", "0" if graph in PREPACKED_GRAPHS else "1")
    return so


def lower_thread_priority(nice: int) -> None:
    """Raise the calling OS thread's niceness to at least `nice` (never lowers it; no-op off Linux)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:  # not permitted in this sandbox: run at normal priority
        return


_M_ARENA_MAX = -8  # glibc mallopt parameter number (malloc.h)


@functools.cache
def _glibc_function(name: str) -> Callable[..., int] | None:
    """A glibc malloc function, looked up once (find_library runs `ldconfig` in a subprocess); None elsewhere."""
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    try:
        function: Callable[..., int] = getattr(ctypes.CDLL(path), name)
    except (OSError, AttributeError):
        return None
    return function


def limit_malloc_arenas(arenas: int) -> None:
    """Cap glibc's per-thread malloc arenas for this process (0: leave the default, 8 x cores; no-op elsewhere).

    Every thread that allocates (service workers, ORT pools) otherwise gets its own arena, and each keeps
    its freed pages: under 8 concurrent streams the default arenas cost ~150 MB of resident memory.
    """
    mallopt = _glibc_function("mallopt") if arenas > 0 else None
    if mallopt is not None:
        mallopt(_M_ARENA_MAX, arenas)


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise); no-op elsewhere."""
    trim = _glibc_function("malloc_trim")
    if trim is not None:
        trim(0)


def _open(path: Path, so: ort.SessionOptions) -> ort.InferenceSession:
    try:
        return ort.InferenceSession(str(path), sess_options=so, providers=list(PROVIDERS))
    except Exception as e:  # ORT raises several unrelated exception types for unreadable graphs
        raise BundleError(f"{path}: ONNX Runtime cannot load this graph: {e}") from e


class TransientSession:
    """A graph opened for each `run` and released right after (for rarely used, large graphs)."""

    def __init__(self, path: Path, so: ort.SessionOptions) -> None:
        self.path = path
        self._so = so
        self._lock = threading.Lock()

    def run(self, output_names: list[str] | None, feeds: Mapping[str, np.ndarray]) -> list[Any]:
        with self._lock:
            session = _open(self.path, self._so)
            try:
                return list(session.run(output_names, dict(feeds)))
            finally:
                del session
                release_free_memory()


class ShrinkingSession:
    """An InferenceSession whose CPU arena gives back its free chunks after every `run`."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self.session = session
        self._options = ort.RunOptions()
        self._options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")

    def run(self, output_names: list[str] | None, feeds: Mapping[str, np.ndarray]) -> list[Any]:
        return list(self.session.run(output_names, dict(feeds), self._options))


def _open_in_thread(path: Path, so: ort.SessionOptions, nice: int) -> ort.InferenceSession:
    """Open a session from a helper thread at niceness `nice`: ORT's pool threads inherit it."""
    result: dict[str, Any] = {}

    def target() -> None:
        lower_thread_priority(nice)
        try:
            result["session"] = _open(path, so)
        except BundleError as e:
            result["error"] = e

    worker = threading.Thread(target=target, name="ort-open")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    session: ort.InferenceSession = result["session"]
    return session


def _check_io(path: Path, session: ort.InferenceSession, entry: GraphEntry) -> None:
    """The opened file has the input/output names its manifest entry lists (the prompt models come from outside)."""
    inputs = {i.name for i in session.get_inputs()}
    outputs = {o.name for o in session.get_outputs()}
    if (inputs, outputs) != (set(entry.inputs), set(entry.outputs)):
        raise BundleError(
            f"{path}: inputs {sorted(inputs)} / outputs {sorted(outputs)} differ from the manifest's "
            f"{sorted(entry.inputs)} / {sorted(entry.outputs)}"
        )


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

    A NATIVE_GRAPHS graph runs as its native twin on ORT with our kernels when the bundle has the twin, native_kernels
    is "auto" and the library runs every kernel of that twin here (native.KERNELS_OF_GRAPH). Else OpenVINO runs
    OPENVINO_GRAPHS when asked (or on "auto" where bf16 is native), from floating-point weights: the graph itself, or
    the float twin of a quantized graph; a quantized graph without a twin stays on ORT.
    """
    ort_runtime = GraphRuntime("ort", bundle.graph_path(name), bundle.manifest.graphs[name].precision)
    twin = native_twin(bundle, name, opts)
    if twin is not None:
        return twin
    if name not in OPENVINO_GRAPHS or opts.acoustic_backend == "ort":
        return ort_runtime
    from service.engine import ov_session

    bf16 = ov_session.native_bf16()
    if opts.acoustic_backend == "auto" and not bf16:
        return ort_runtime
    if not ov_session.available():
        raise BundleError("TTS_ACOUSTIC_BACKEND=openvino needs the openvino package (pip install openvino)")
    path = bundle.float_graph_path(name)
    if path is None:
        return ort_runtime
    entry = next(g for g in bundle.manifest.graphs.values() if bundle.root / g.file == path)
    return GraphRuntime("openvino", path, "bf16" if bf16 else "f32", entry.sha256)


def native_twin(bundle: ModelBundle, name: str, opts: RuntimeOptions) -> GraphRuntime | None:
    """The native twin of graph `name` as it would run here, or None (no twin, off, or the library cannot run)."""
    path = bundle.native_graph_path(name) if name in NATIVE_GRAPHS and opts.native_kernels == "auto" else None
    if path is None:
        return None
    kernels = _native_kernels(bundle, name)
    if not kernels.usable:
        return None
    entry = bundle.manifest.graphs[name + NATIVE_SUFFIX]
    return GraphRuntime("ort", path, entry.precision, entry.sha256, kernels.path)


def native_kernels_note(bundle: ModelBundle, opts: RuntimeOptions) -> str | None:
    """One line for the start-up log when the bundle has native twins: which run our kernels, and why the others not."""
    twins = [n for n in NATIVE_GRAPHS if bundle.native_graph_path(n) is not None]
    if not twins:
        return None
    if opts.native_kernels == "off":
        return f"native kernels off (TTS_NATIVE_KERNELS=off): ONNX Runtime's graphs run {', '.join(twins)}"
    parts = []
    for name in twins:
        kernels = _native_kernels(bundle, name)
        what = " and ".join(_kernel_note(k) for k in native.KERNELS_OF_GRAPH[name])
        parts.append(f"{name} runs {what}" if kernels.usable else f"{name} on ONNX Runtime's graph ({kernels.reason})")
    return f"native kernels ({native.LIBRARY_PATH.name}): {'; '.join(parts)}"


_KERNEL_NOTE = {"attention": "its attention as our bf16 kernel", "int8_matmul": "its int8 products as our VNNI kernel"}


def _kernel_note(kernel: native.Kernel) -> str:
    """What the start-up note says of one kernel: with AMX tiles in use, which of its calls take them."""
    if not native.amx_tiles():
        return _KERNEL_NOTE[kernel]
    return {
        "attention": "its attention as our bf16 kernel on AMX tiles",
        "int8_matmul": "its int8 products as our VNNI kernel (AMX tiles from 16 rows)",
    }[kernel]


def _native_kernels(bundle: ModelBundle, name: str) -> native.NativeKernels:
    """Whether our library runs every kernel of graph `name`'s twin here (the attention for the bundle's head size):
    the first one that cannot, or the library."""
    extra = bundle.manifest.cosyvoice2
    head_dim = extra.estimator_head_dim if extra else 64
    probes = [native.probe(head_dim=head_dim, kernel=k) for k in native.KERNELS_OF_GRAPH[name]]
    return next((p for p in probes if not p.usable), probes[0])


def _open_openvino(runtime: GraphRuntime, opts: RuntimeOptions, name: str) -> Any:
    from service.engine.ov_session import OpenVINOSession, warm_cache

    threads = opts.threads_for(graph_stage(name))
    precision: Literal["bf16", "f32"] = "bf16" if runtime.precision == "bf16" else "f32"
    cache = opts.compiled_cache_dir
    if cache is not None:
        cache = warm_cache(runtime.path, runtime.fingerprint, threads, precision, cache)
    if opts.acoustic_nice <= 0:
        return OpenVINOSession(runtime.path, threads, precision, cache)
    result: dict[str, Any] = {}

    def target() -> None:  # compiled at lower priority: OpenVINO's worker threads inherit it
        lower_thread_priority(opts.acoustic_nice)
        try:
            result["session"] = OpenVINOSession(runtime.path, threads, precision, cache)
        except BundleError as e:
            result["error"] = e

    worker = threading.Thread(target=target, name="ov-compile")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["session"]


def open_sessions(
    bundle: ModelBundle,
    opts: RuntimeOptions | None = None,
    names: Iterable[str] | None = None,
    *,
    transient: Iterable[str] = (),
) -> dict[str, Any]:
    """Open the bundle's core graphs (or the graphs in `names`) on the CPU provider; raises BundleError on failure.

    The returned dict is keyed by graph name ("llm_step", ...). The prompt models are opened only when named
    (`names=("campplus", "speech_tokenizer")`, bundles with `has_prompt_analysis`); their input/output names
    are checked against the manifest when they open. Each stage gets its own thread count;
    graphs named in `transient` become TransientSession objects (opened per call). Components take any
    mapping of objects with ORT's `run(output_names, feeds)` method, so tests may inject their own.
    """
    opts = opts or RuntimeOptions()
    wanted = tuple(names) if names is not None else GRAPH_NAMES
    lazy = set(transient)
    sessions: dict[str, Any] = {}
    opening = [name for name in wanted if name not in lazy]  # a transient graph opens per call, not now
    for name in wanted:
        if name in PROMPT_GRAPHS and not bundle.has_prompt_analysis:
            raise BundleError(f"{bundle.root}: the bundle has no prompt models (no '{name}' graph)")
        if name not in bundle.manifest.graphs:
            raise BundleError(f"{bundle.root}: manifest has no graph '{name}'")
        started = time.perf_counter()
        runtime = graph_runtime(bundle, name, opts)
        sessions[name] = _open_runtime(bundle, name, runtime, opts, lazy=name in lazy)
        if name in opening:
            _log_opened(name, runtime, started, f" ({opening.index(name) + 1} of {len(opening)})")
    release_free_memory()
    return sessions


def _open_runtime(bundle: ModelBundle, name: str, runtime: GraphRuntime, opts: RuntimeOptions, *, lazy: bool) -> Any:
    """Graph `name` as `runtime` runs it: an OpenVINO model, a TransientSession (`lazy`), or an ORT session (its
    input/output names checked for a prompt model; arenas shrunk after each call for the acoustic graphs)."""
    if runtime.backend == "openvino":
        return _open_openvino(runtime, opts, name)
    so = make_session_options(opts, name)
    if runtime.custom_ops is not None:
        so.register_custom_ops_library(str(runtime.custom_ops))
    path = runtime.path
    if lazy:
        return TransientSession(path, so)
    acoustic = graph_stage(name) == "acoustic"
    session = _open_in_thread(path, so, opts.acoustic_nice) if acoustic and opts.acoustic_nice > 0 else _open(path, so)
    entry = bundle.manifest.graphs[name]
    if entry.group == GROUP_PROMPT:
        _check_io(path, session, entry)
    shrink = acoustic and opts.shrink_acoustic_arenas and opts.enable_cpu_mem_arena
    return ShrinkingSession(session) if shrink else session


def _log_opened(name: str, runtime: GraphRuntime, started: float, count: str = "") -> None:
    """One start-up progress line per graph: its name, where it runs and how long opening it took (a full-size
    bundle's graphs take seconds each, so a start is never silent for long)."""
    where = f"{runtime.backend} {runtime.precision}" + (", native kernels" if runtime.custom_ops is not None else "")
    log.info("opened graph %s%s in %.2f s (%s, %s)", name, count, time.perf_counter() - started, where, runtime.path.name)


def open_graph(path: Path, opts: RuntimeOptions | None = None, name: str | None = None) -> ort.InferenceSession:
    """Open one ONNX file that is not a bundle graph (e.g. the prompt models) with the options above.

    `name` picks the per-graph specialisation of `make_session_options`; raises BundleError on failure.
    """
    started = time.perf_counter()
    session = _open(Path(path), make_session_options(opts or RuntimeOptions(), name))
    _log_opened(name or Path(path).stem, GraphRuntime("ort", Path(path)), started)
    return session
