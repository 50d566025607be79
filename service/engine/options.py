"""The engine's runtime options, in two parts: how ONNX Runtime runs the graphs (SessionOptions: threads, arenas,
optimization) and the engine's levers (EngineLevers: batching, the acoustic gate, the chunk schedule, runtimes and
kernels); RuntimeOptions is both. And which stage a graph belongs to."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ExecutionMode = Literal["sequential", "parallel"]
GraphOptimization = Literal["all", "extended", "basic", "disabled"]
Stage = Literal["llm", "acoustic"]
StreamSchedule = Literal["adaptive", "official"]
AcousticBackend = Literal["auto", "ort", "openvino"]
NativeKernelsMode = Literal["auto", "no-amx", "portable", "off"]
CachePrecision = Literal["graph", "float16", "int8"]
MEMORY_LIMIT_MMAP_THRESHOLD = 4 << 20  # RuntimeOptions.mmap_threshold under a memory limit (docs/memory.md)
PrecisionLever = Literal["auto", "graph", "float16", "int8"]  # a CachePrecision, or "auto" (the family picks)
AcousticArena = Literal["shrink", "keep", "off"]

EXECUTION_MODES: tuple[str, ...] = ("sequential", "parallel")
GRAPH_OPTIMIZATION: tuple[str, ...] = ("all", "extended", "basic", "disabled")
# Graphs run per token or per Euler step keep ORT's pre-packed weight copies (2x faster int8 GEMMs);
# the others run once per request or chunk, where the second copy of their weights (40-100 MB) is not
# worth the few milliseconds it saves.
PREPACKED_GRAPHS: frozenset[str] = frozenset({"llm_step", "flow_estimator", "hift_decode", "hift_f0"})
# Graphs an engine opens twice (the vocoder's one- and two-thread sessions, layers/acoustic_plan.py): every session of
# one reads its weights file through one mapping (sessions.SharedWeights), not one each (a page two mappings show counts
# twice in the resident size).
SHARED_WEIGHTS_GRAPHS: frozenset[str] = frozenset({"hift_decode"})
# Graphs OpenVINO runs when asked (acoustic_backend=openvino): faster in bf16 than ORT's float32 graphs where the CPU
# computes bf16 natively, as fast as our twins; the LLM step stays on ORT, which runs it faster (docs/perf-log.md).
OPENVINO_GRAPHS: frozenset[str] = frozenset({"flow_estimator", "hift_decode", "hift_f0"})


def graph_stage(name: str) -> Stage:
    """The stage a graph belongs to: the LLM graphs, or the acoustic ones (flow, HiFT, and the prompt models,
    which like them run once per request on variable-length audio)."""
    return "llm" if name.startswith("llm_") else "acoustic"


@dataclass(frozen=True)
class SessionOptions:
    """How ONNX Runtime runs a graph call: threads per stage, execution mode, optimization, arenas, spinning, logging.

    Thread budget rule: the threads that run graphs at the same time must not exceed the cores. With the batching
    scheduler (`max_batch > 0`) one LLM thread decodes every request while at most `acoustic_slots` flow/HiFT calls run
    beside it, so `llm_threads + acoustic_slots * acoustic_threads` is what competes for the cores. Without it every
    concurrent request runs its own sessions: `concurrent requests * intra_op_threads <= cores`. ORT pins one pool per
    session call; two spinning pools on one core fight for it, so spinning is only worth it when a single graph runs
    at a time (`allow_spinning`, default off).
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
    # Return a flow/HiFT session's unused arena memory after each call: their activation peaks (HiFT ~120 MB
    # for 5 s of audio) then do not stay resident side by side, at no cost in speed (docs/perf-log.md).
    shrink_acoustic_arenas: bool = True
    # glibc malloc arenas for the whole process (see tune_malloc); 0 keeps glibc's default.
    malloc_arenas: int = 2
    # Heap blocks of at least this many bytes are mapped on their own and unmapped when freed (see tune_malloc); 0
    # keeps glibc's sliding threshold; None: MEMORY_LIMIT_MMAP_THRESHOLD under a memory limit, else 0.
    malloc_mmap_threshold: int | None = None
    # Where OpenVINO keeps compiled graphs (imported at every start after the first: faster, and 0.19 GB less resident
    # for the full-size estimator); None: compile in this process at every start.
    compiled_cache_dir: Path | None = None
    # Executors OpenVINO keeps per acoustic graph for input shapes seen before (ov_session.SHAPE_CACHE_ENTRIES): its
    # own default, 5000, grows the process by gigabytes as chunk lengths vary; 0 rebuilds them at every new shape.
    openvino_shape_cache_entries: int = 256
    # The memory this process may use (TTS_MEMORY_LIMIT, or its cgroup's); None: not bounded. Automatic budgets read it.
    memory_limit_bytes: int | None = None

    def _check_sessions(self) -> None:
        stage_threads = [t for t in (self.llm_threads, self.acoustic_threads) if t is not None]
        if min(self.intra_op_threads, self.inter_op_threads, *stage_threads) < 1:
            raise ValueError("intra_op_threads, inter_op_threads, llm_threads and acoustic_threads must be >= 1")
        if self.execution_mode not in EXECUTION_MODES:
            raise ValueError(f"execution_mode must be one of {sorted(EXECUTION_MODES)}")
        if self.graph_optimization not in GRAPH_OPTIMIZATION:
            raise ValueError(f"graph_optimization must be one of {sorted(GRAPH_OPTIMIZATION)}")
        if not 0 <= self.log_severity <= 4:
            raise ValueError("log_severity must be in 0..4")
        if self.malloc_arenas < 0 or self.openvino_shape_cache_entries < 0 or (self.malloc_mmap_threshold or 0) < 0:
            raise ValueError("malloc_arenas, malloc_mmap_threshold and openvino_shape_cache_entries must be >= 0")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise ValueError("memory_limit_bytes must be > 0 (or None)")

    def mmap_threshold(self) -> int:
        """The malloc mmap threshold tune_malloc sets: `malloc_mmap_threshold`, or where it is None, a fixed 4 MiB
        under a memory limit (a server has one wherever the cgroup's or the machine's memory can be read: a full-size
        stream's peak 0.15 GB lower, ~2 % slower, as freed blocks are unmapped and faulted in again; 1 MiB saved no
        more and cost ~5 %, 16 MiB saved a third less) and glibc's own sliding threshold without one (docs/memory.md)."""
        if self.malloc_mmap_threshold is not None:
            return self.malloc_mmap_threshold
        return MEMORY_LIMIT_MMAP_THRESHOLD if self.memory_limit_bytes is not None else 0

    def threads_for(self, stage: Stage) -> int:
        """Intra-op threads of the sessions of one stage."""
        chosen = self.llm_threads if stage == "llm" else self.acoustic_threads
        return chosen or self.intra_op_threads

    def max_workers(self, cores: int) -> int:
        """Largest worker count that keeps `workers * intra_op_threads <= cores` (at least 1)."""
        return max(1, cores // self.intra_op_threads)


@dataclass(frozen=True)
class EngineLevers:
    """How an engine schedules its stages and streams: batching, the acoustic gate, the chunk schedule, the prompt
    window, the budget of growing state, and which runtime and kernels run the graphs (the service reads them from its
    engine profile, service.levers).

    `acoustic_nice` > 0 lowers the OS priority of the threads that run flow/HiFT (their ORT pools and the calling
    threads), so a decode step never waits for a vocoder call: the LLM takes the cores when it needs them and the
    acoustic work fills the rest. Linux only; ignored elsewhere.
    """

    max_batch: int = 16  # LLM rows per batched decode step; 0 = no scheduler thread
    acoustic_slots: int = 1  # flow/HiFT calls running at once; 0 = unlimited
    acoustic_nice: int = 0  # OS niceness added to acoustic threads (0 = same priority as the LLM)
    # While a request's first chunk is vocoded, the scheduler pauses decoding unless a consumer waits for
    # tokens: the first audio then gets both cores instead of sharing them with tokens nobody needs yet.
    first_audio_priority: bool = True
    # While acoustic calls run, the scheduler pauses decoding once every stream has this many tokens decoded ahead of
    # its flow (families whose engine asks for it); None: the chunk schedule's largest hop, 0: never.
    decode_lead_tokens: int | None = None
    # How streamed sentences are cut into chunks: the family's default schedule, or "official" (the official code's
    # chunk boundaries, for parity).
    stream_schedule: StreamSchedule = "adaptive"
    # A streamed chunk whose sentence ends within its schedule's tail takes the rest along as the sentence's last
    # (schedules with a tail); False: a last call of their own.
    look_ahead_tail: bool = True
    first_hop_tokens: int | None = None  # the first streamed chunk's hop; None: the schedule's own
    # Seconds of a cloned voice's prompt the flow sees with each streamed chunk; None: all of it (official).
    prompt_window_s: float | None = None
    # Seconds of generated speech a streamed flow keeps attending to besides its prompt (a family whose caches grow
    # per frame drops the oldest beyond it); None: every frame (official); "auto": the family's own default.
    flow_window_s: float | Literal["auto"] | None = None
    # How those caches keep their frames: as the estimator graph reads them, float16, or int8 with per-frame, per-head
    # scales (widened for each call); "graph" is the official computation; "auto": int8 in quantized bundles
    # (frame_cache.stored_precision).
    flow_cache_precision: PrecisionLever = "auto"
    # The flow/HiFT sessions' ONNX Runtime arena: "shrink" gives its free chunks back after every call, "keep" keeps
    # them (ONNX Runtime's default), "off" allocates each call's tensors from the heap.
    acoustic_arena: AcousticArena = "shrink"
    # Megabytes streamed sentences' growing state may hold at once (service.engine.memory); None: auto, 0: no bound.
    flow_cache_mb: int | None = None
    # Runtime of the OPENVINO_GRAPHS where no native twin of ours runs them: "auto" and "ort" = ONNX Runtime;
    # "openvino" (the openvino package installed apart: bf16 where the CPU computes it natively, else f32).
    acoustic_backend: AcousticBackend = "ort"
    # Native twins (a quantized bundle's graphs with kernels of ours: an estimator's attention, the LLM step's int8
    # products): "auto" runs a twin where the bundle has one and our library's kernel for it has a fast variant here
    # (service.engine.native), "no-amx" the same without AMX tiles, "portable" every twin with the kernels' portable C
    # (comparisons, tests), "off" the core graphs.
    native_kernels: NativeKernelsMode = "auto"
    # The flow estimator's native twin: "auto" where native_kernels runs twins and the estimator's kernels take more than
    # their AVX2 code (or the portable C when asked); True wherever native_kernels runs twins; False: its core graph.
    native_estimator: bool | Literal["auto"] = "auto"
    # Whether "auto" and "no-amx" count a kernel's AVX2 code (no AVX-512) as a fast variant; False: such hosts run the
    # core graphs, as before the AVX2 kernels existed.
    native_on_avx2: bool = True

    def _check_levers(self) -> None:
        if self.decode_lead_tokens is not None and self.decode_lead_tokens < 0:
            raise ValueError("decode_lead_tokens must be >= 0")
        if self.max_batch < 0 or self.acoustic_slots < 0 or not 0 <= self.acoustic_nice <= 19:
            raise ValueError("max_batch and acoustic_slots must be >= 0, acoustic_nice in 0..19")
        if self.stream_schedule not in ("adaptive", "official"):
            raise ValueError("stream_schedule must be 'adaptive' or 'official'")
        if self.prompt_window_s is not None and self.prompt_window_s < 0:
            raise ValueError("prompt_window_s must be >= 0")
        if self.flow_window_s not in (None, "auto") and not (
            isinstance(self.flow_window_s, float | int) and self.flow_window_s > 0
        ):
            raise ValueError("flow_window_s must be > 0, 'auto' or None")
        if self.flow_cache_precision not in ("auto", "graph", "float16", "int8"):
            raise ValueError("flow_cache_precision must be 'auto', 'graph', 'float16' or 'int8'")
        if self.acoustic_arena not in ("shrink", "keep", "off"):
            raise ValueError("acoustic_arena must be 'shrink', 'keep' or 'off'")
        if self.flow_cache_mb is not None and self.flow_cache_mb < 0:
            raise ValueError("flow_cache_mb must be >= 0")
        if self.acoustic_backend not in ("auto", "ort", "openvino"):
            raise ValueError("acoustic_backend must be 'auto', 'ort' or 'openvino'")
        if self.native_kernels not in ("auto", "no-amx", "portable", "off"):
            raise ValueError("native_kernels must be 'auto', 'no-amx', 'portable' or 'off'")


@dataclass(frozen=True)
class RuntimeOptions(SessionOptions, EngineLevers):
    """What one engine runs with: its ONNX Runtime sessions' options (SessionOptions) and its levers (EngineLevers)."""

    def __post_init__(self) -> None:
        self._check_sessions()
        self._check_levers()

    @classmethod
    def of(cls, sessions: SessionOptions, levers: EngineLevers) -> RuntimeOptions:
        """The two parts as one."""
        return cls(**{**dataclasses.asdict(sessions), **dataclasses.asdict(levers)})
