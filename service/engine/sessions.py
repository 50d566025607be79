"""The one place that configures ONNX Runtime: RuntimeOptions -> SessionOptions -> CPU sessions, per stage."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from service.bundle import GROUP_CORE, GROUP_PROMPT, GraphEntry, ModelBundle
from service.bundle.external import external_tensors
from service.engine import native
from service.engine.host import lower_thread_priority, release_free_memory
from service.engine.options import PREPACKED_GRAPHS, SHARED_WEIGHTS_GRAPHS, RuntimeOptions, graph_stage
from service.engine.runtimes import GraphRuntime, graph_runtime, open_openvino
from service.errors import BundleError

log = logging.getLogger(__name__)

_ORT_EXECUTION_MODES: dict[str, ort.ExecutionMode] = {
    "sequential": ort.ExecutionMode.ORT_SEQUENTIAL,
    "parallel": ort.ExecutionMode.ORT_PARALLEL,
}
_ORT_GRAPH_OPTIMIZATION: dict[str, ort.GraphOptimizationLevel] = {
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}
PROVIDERS: tuple[str, ...] = ("CPUExecutionProvider",)
PREFILL_GRAPH = "llm_step"  # the LLM graph that also runs each request's prefill (its arena shrinks after one)


def make_session_options(opts: RuntimeOptions, graph: str | None = None) -> ort.SessionOptions:
    """Translate RuntimeOptions into an ort.SessionOptions (the only place ORT knobs are set).

    With a `graph` name the options are specialised for it: its stage's thread count; memory patterns
    only for the LLM (flow/HiFT see a new length every chunk, so a cached pattern is never reused but
    its buffer stays allocated); pre-packed weights only for PREPACKED_GRAPHS; no arena for the acoustic graphs
    with `acoustic_arena="off"` (each call's tensors from the heap, given back when it ends).
    """
    so = ort.SessionOptions()
    so.intra_op_num_threads = opts.threads_for(graph_stage(graph)) if graph else opts.intra_op_threads
    so.inter_op_num_threads = opts.inter_op_threads
    so.execution_mode = _ORT_EXECUTION_MODES[opts.execution_mode]
    so.graph_optimization_level = _ORT_GRAPH_OPTIMIZATION[opts.graph_optimization]
    arena_off = graph is not None and graph_stage(graph) == "acoustic" and opts.acoustic_arena == "off"
    so.enable_cpu_mem_arena = opts.enable_cpu_mem_arena and not arena_off
    so.enable_mem_pattern = opts.enable_mem_pattern and (graph is None or graph_stage(graph) == "llm")
    so.log_severity_level = opts.log_severity
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if opts.allow_spinning else "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "1" if opts.allow_spinning else "0")
    if graph is not None:
        so.add_session_config_entry("session.disable_prepacking", "0" if graph in PREPACKED_GRAPHS else "1")
    return so


def _open(path: Path, so: ort.SessionOptions) -> ort.InferenceSession:
    try:
        return ort.InferenceSession(str(path), sess_options=so, providers=list(PROVIDERS))
    except Exception as e:  # ORT raises several unrelated exception types for unreadable graphs
        raise BundleError(f"{path}: ONNX Runtime cannot load this graph: {e}") from e


class SharedWeights:
    """A graph's external initializers as OrtValues over one private mapping of each weights file, handed to every
    session of the graph (`add_to`: ONNX Runtime reads such initializers in place; it never writes them), so the file's
    pages are mapped once however many sessions read them. An initializer whose bytes cannot be viewed in place (not
    aligned to its type) is left to ONNX Runtime."""

    def __init__(self, graph: Path) -> None:
        tensors = external_tensors(graph)
        files = {t.location: np.memmap(graph.parent / t.location, dtype=np.uint8, mode="c") for t in tensors}
        self.values: dict[str, ort.OrtValue] = {}
        for t in tensors:
            if t.offset % np.dtype(t.dtype).itemsize or t.length != t.nbytes():
                continue
            data = files[t.location][t.offset : t.offset + t.length].view(t.dtype).reshape(t.dims)
            self.values[t.name] = ort.OrtValue.ortvalue_from_numpy(data)

    def add_to(self, so: ort.SessionOptions) -> None:
        for name, value in self.values.items():
            so.add_initializer(name, value)


_shared_lock = threading.Lock()
_shared: weakref.WeakValueDictionary[tuple[object, ...], SharedWeights] = weakref.WeakValueDictionary()


def shared_weights(graph: Path) -> SharedWeights | None:
    """The one SharedWeights of the graph file `graph` while any session holds it (a rewritten file is a new one);
    None for a file that cannot be read so (ONNX Runtime then opens it alone, and says what is wrong with it)."""
    files = [graph, graph.with_suffix(".weights")]
    try:
        key = tuple((str(f.resolve()), st.st_ino, st.st_mtime_ns, st.st_size) for f in files if f.is_file() for st in [f.stat()])
        with _shared_lock:
            found = _shared.get(key)
            if found is None:
                found = SharedWeights(graph)
                _shared[key] = found
            return found
    except (OSError, ValueError):
        return None


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
    """An InferenceSession whose CPU arena gives back its free chunks after a `run`: after every one, or only after those
    `when(feeds)` picks (an LLM step's prefill, whose many positions at once take a size the decode steps never reuse)."""

    def __init__(self, session: ort.InferenceSession, when: Callable[[Mapping[str, np.ndarray]], bool] | None = None) -> None:
        self.session = session
        self._when = when
        self._options = ort.RunOptions()
        self._options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")

    def run(self, output_names: list[str] | None, feeds: Mapping[str, np.ndarray]) -> list[Any]:
        options = self._options if self._when is None or self._when(feeds) else None
        return list(self.session.run(output_names, dict(feeds), options))

    def __getattr__(self, name: str) -> Any:  # get_inputs(), get_outputs(), ... of the session
        return getattr(self.session, name)


def prefill(feeds: Mapping[str, np.ndarray]) -> bool:
    """Whether an `llm_step` call is a prefill: its input x (B, T, D) holds more than one position."""
    x = feeds.get("x")
    return x is not None and x.ndim == 3 and x.shape[1] > 1


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


def open_sessions(
    bundle: ModelBundle,
    opts: RuntimeOptions | None = None,
    names: Iterable[str] | None = None,
    *,
    transient: Iterable[str] = (),
) -> dict[str, Any]:
    """Open the graphs in `names` (default: every core graph the manifest lists) on the CPU provider; raises BundleError
    on failure.

    The returned dict is keyed by graph name ("llm_step", ...). The prompt models are opened only when named
    (`names=("campplus", "speech_tokenizer")`, bundles with `has_prompt_analysis`); their input/output names
    are checked against the manifest when they open. Each stage gets its own thread count;
    graphs named in `transient` become TransientSession objects (opened per call). Components take any
    mapping of objects with ORT's `run(output_names, feeds)` method, so tests may inject their own.
    """
    opts = opts or RuntimeOptions()
    wanted = tuple(names) if names is not None else tuple(bundle.manifest.graphs_in(GROUP_CORE))
    lazy = set(transient)
    sessions: dict[str, Any] = {}
    opening = [name for name in wanted if name not in lazy]  # a transient graph opens per call, not now
    for name in wanted:
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
    """Graph `name` as `runtime` runs it: an OpenVINO model, a TransientSession (`lazy`), or an ORT session (our
    kernels' library registered with its ceiling for a native twin; input/output names checked for a prompt model;
    arenas shrunk after each call for the acoustic graphs; the weights of SHARED_WEIGHTS_GRAPHS mapped once)."""
    if runtime.backend == "openvino":
        return open_openvino(runtime, opts, name)
    so = make_session_options(opts, name)
    if runtime.custom_ops is not None and opts.native_kernels != "off":
        for key, value in native.session_config(opts.native_kernels).items():
            so.add_session_config_entry(key, value)
        so.register_custom_ops_library(str(runtime.custom_ops))
    path = runtime.path
    if lazy:
        return TransientSession(path, so)
    shared = shared_weights(path) if name in SHARED_WEIGHTS_GRAPHS else None
    if shared is not None:
        shared.add_to(so)
    acoustic = graph_stage(name) == "acoustic"
    session = _open_in_thread(path, so, opts.acoustic_nice) if acoustic and opts.acoustic_nice > 0 else _open(path, so)
    if shared is not None:
        session.shared_weights = shared  # its OrtValues' mappings live with the session
    entry = bundle.manifest.graphs[name]
    if entry.group == GROUP_PROMPT:
        _check_io(path, session, entry)
    shrink = acoustic and opts.acoustic_arena == "shrink" and opts.shrink_acoustic_arenas and opts.enable_cpu_mem_arena
    if name == PREFILL_GRAPH and opts.enable_cpu_mem_arena:
        return ShrinkingSession(session, when=prefill)
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
