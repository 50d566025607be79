"""The one place that configures ONNX Runtime: RuntimeOptions -> SessionOptions -> CPU sessions."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import onnxruntime as ort

from service.bundle import GRAPH_NAMES, ModelBundle
from service.errors import BundleError

ExecutionMode = Literal["sequential", "parallel"]
GraphOptimization = Literal["all", "extended", "basic", "disabled"]

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


@dataclass(frozen=True)
class RuntimeOptions:
    """ONNX Runtime settings shared by every session of one engine.

    Thread budget rule: `workers * intra_op_threads <= cores` (workers = engines or synthesis threads
    that run graphs at the same time). ORT pins one pool of `intra_op_threads` per session call; two
    pools on one core fight for it and both slow down, so oversubscribing costs more than it gains.
    `inter_op_threads` only matters with `execution_mode="parallel"`, which these small sequential
    graphs do not benefit from.
    """

    intra_op_threads: int = 2
    inter_op_threads: int = 1
    execution_mode: ExecutionMode = "sequential"
    graph_optimization: GraphOptimization = "all"
    enable_cpu_mem_arena: bool = True
    enable_mem_pattern: bool = True
    # Spinning keeps idle pool threads busy-waiting for the next op: lower latency on a dedicated
    # machine, wasted CPU when other processes share the cores.
    allow_spinning: bool = True
    log_severity: int = 3  # 0 verbose .. 4 fatal

    def __post_init__(self) -> None:
        if self.intra_op_threads < 1 or self.inter_op_threads < 1:
            raise ValueError("intra_op_threads and inter_op_threads must be >= 1")
        if self.execution_mode not in _EXECUTION_MODES:
            raise ValueError(f"execution_mode must be one of {sorted(_EXECUTION_MODES)}")
        if self.graph_optimization not in _GRAPH_OPTIMIZATION:
            raise ValueError(f"graph_optimization must be one of {sorted(_GRAPH_OPTIMIZATION)}")
        if not 0 <= self.log_severity <= 4:
            raise ValueError("log_severity must be in 0..4")

    def max_workers(self, cores: int) -> int:
        """Largest worker count that keeps `workers * intra_op_threads <= cores` (at least 1)."""
        return max(1, cores // self.intra_op_threads)


def make_session_options(opts: RuntimeOptions) -> ort.SessionOptions:
    """Translate RuntimeOptions into an ort.SessionOptions (the only place ORT knobs are set)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = opts.intra_op_threads
    so.inter_op_num_threads = opts.inter_op_threads
    so.execution_mode = _EXECUTION_MODES[opts.execution_mode]
    so.graph_optimization_level = _GRAPH_OPTIMIZATION[opts.graph_optimization]
    so.enable_cpu_mem_arena = opts.enable_cpu_mem_arena
    so.enable_mem_pattern = opts.enable_mem_pattern
    so.log_severity_level = opts.log_severity
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if opts.allow_spinning else "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "1" if opts.allow_spinning else "0")
    return so


def open_sessions(
    bundle: ModelBundle, opts: RuntimeOptions | None = None, names: Iterable[str] | None = None
) -> dict[str, ort.InferenceSession]:
    """Open the bundle's graphs (all, or `names`) on the CPU provider; raises BundleError on failure.

    The returned dict is keyed by graph name ("llm_decode", ...). Components take any mapping of
    objects with ORT's `run(output_names, feeds)` method, so tests may inject their own.
    """
    opts = opts or RuntimeOptions()
    so = make_session_options(opts)
    wanted = tuple(names) if names is not None else GRAPH_NAMES
    sessions: dict[str, ort.InferenceSession] = {}
    for name in wanted:
        if name not in bundle.manifest.graphs:
            raise BundleError(f"{bundle.root}: manifest has no graph '{name}'")
        path = bundle.graph_path(name)
        try:
            sessions[name] = ort.InferenceSession(str(path), sess_options=so, providers=list(PROVIDERS))
        except Exception as e:  # ORT raises several unrelated exception types for unreadable graphs
            raise BundleError(f"{path}: ONNX Runtime cannot load this graph: {e}") from e
    return sessions
