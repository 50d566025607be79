"""How the engines share two cores between decode steps and acoustic calls: their sessions with a wide HiFT decode
session and the acoustic budget as one-thread calls (for every engine that plans with them), the
chunk-causal families' decode-step spread while the acoustic gate is idle, and the bound on their streamed sentences'
flow caches."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from service.bundle import ModelBundle
from service.engine import native
from service.engine.acoustic_gate import AcousticGate
from service.engine.memory import StateBudget, auto_budget
from service.engine.options import RuntimeOptions
from service.engine.runtimes import graph_runtime
from service.engine.sessions import open_sessions

log = logging.getLogger(__name__)

# The sessions key of the HiFT decode graph on WIDE_THREADS threads: what a vocoder call that takes the cores runs
# (HopSchedule.vocoder_takes_cores); the wide width is the estimator's, its two guidance rows side by side.
WIDE_HIFT_DECODE = "hift_decode/wide"
WIDE_THREADS = 2
# Tasks a decode step's int8 products are split into while the acoustic gate is idle (native.DecodeSpread): more
# tasks than threads even out the two threads' share: 4 gave the shortest steps (docs/perf-log.md).
DECODE_SPREAD = 4


def open_engine_sessions(bundle: ModelBundle, runtime: RuntimeOptions, names: tuple[str, ...], *, wide: bool) -> dict[str, Any]:
    """The bundle's graphs `names` as `runtime` asks; `wide` adds the HiFT decode graph on WIDE_THREADS intra-op threads
    (WIDE_HIFT_DECODE) for the vocoder calls that take both cores."""
    sessions = open_sessions(bundle, runtime, names=names)
    if wide:
        sessions[WIDE_HIFT_DECODE] = wide_hift_decode(bundle, runtime)
    return sessions


def wide_hift_decode(bundle: ModelBundle, runtime: RuntimeOptions) -> Any:
    """The bundle's HiFT decode graph on WIDE_THREADS intra-op threads (the session WIDE_HIFT_DECODE names)."""
    return open_sessions(bundle, replace(runtime, acoustic_threads=WIDE_THREADS), names=("hift_decode",))["hift_decode"]


def decode_spread(
    bundle: ModelBundle, runtime: RuntimeOptions, gate: AcousticGate | None, step: native.DecodeSpread | None
) -> Callable[[], None] | None:
    """What the scheduler calls before each decode step when the step runs our int8 kernel on more than one thread:
    while no acoustic call runs or waits (`gate.idle`), the step's products are shared over its threads
    (DECODE_SPREAD tasks, the step twin's spread input through `step`), else they stay on the scheduler's thread
    beside the flow. None where that cannot apply (nor is `step` then used)."""
    if gate is None or step is None or runtime.threads_for("llm") < 2:
        return None
    if graph_runtime(bundle, "llm_step", runtime).custom_ops is None or not native.takes_spread(step.session):
        return None

    def spread() -> None:
        step.tasks = DECODE_SPREAD if gate.idle() else 1

    return spread


def one_thread_calls(runtime: RuntimeOptions) -> RuntimeOptions:
    """The acoustic thread budget spent as one-thread calls: unless `acoustic_threads` is set, every flow/HiFT call runs
    one intra-op thread and the gate admits as many calls at once as the budget had threads (slots x threads).

    The full-size CosyVoice2 estimator runs ~3,300 small kernels per call and ONNX Runtime's second intra-op thread barely
    shortens a call, while two one-thread calls on two cores run at full speed each (docs/perf-log.md); a request
    alone gets both cores through the CFG lanes (GuidedEuler)."""
    if runtime.acoustic_threads is not None or runtime.acoustic_slots == 0:
        return runtime
    return replace(runtime, acoustic_threads=1, acoustic_slots=runtime.acoustic_slots * runtime.intra_op_threads)


def flow_budget(runtime: RuntimeOptions) -> StateBudget:
    """The bound on streamed sentences' estimator caches that `runtime.flow_cache_mb` asks for: None sizes it from the
    memory limit and what is resident now (call it with the sessions open), 0 leaves it unbounded."""
    mb = runtime.flow_cache_mb
    limit = auto_budget(runtime.memory_limit_bytes) if mb is None else (mb << 20 if mb > 0 else None)
    if limit is None:
        log.info("flow caches of streamed sentences: no bound")
    else:
        log.info("flow caches of streamed sentences: at most %d MB at once%s", limit >> 20, " (auto)" if mb is None else "")
    return StateBudget(limit)
