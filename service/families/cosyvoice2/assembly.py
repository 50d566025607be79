"""How a CosyVoice2 engine is put together from a bundle and runtime options: its sessions (with the wide vocoder),
its chunk schedule, the flow caches' memory budget, the acoustic thread plan and the decode steps' spread."""

from __future__ import annotations

from typing import Any

from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.errors import BundleError
from service.families.cosyvoice2.contract import GRAPH_IO, CosyVoice2Constants, constants_of
from service.layers import acoustic_plan
from service.layers.acoustic_plan import (
    DECODE_SPREAD,
    WIDE_HIFT_DECODE,
    WIDE_THREADS,
    decode_spread,
    flow_budget,
    one_thread_calls,
)
from service.layers.chunk_schedule import HopSchedule, runtime_schedule

__all__ = [
    "DECODE_SPREAD", "WIDE_HIFT_DECODE", "WIDE_THREADS", "decode_spread", "extra_constants", "flow_budget", "one_thread_calls",
    "open_engine_sessions", "stream_schedule",
]  # fmt: skip


def open_engine_sessions(bundle: ModelBundle, runtime: RuntimeOptions, *, wide: bool) -> dict[str, Any]:
    """The bundle's CosyVoice2 graphs as `runtime` asks; `wide` adds the HiFT decode graph on WIDE_THREADS intra-op
    threads (WIDE_HIFT_DECODE) for the vocoder calls that take both cores."""
    return acoustic_plan.open_engine_sessions(bundle, runtime, tuple(GRAPH_IO), wide=wide)


def stream_schedule(bundle: ModelBundle, runtime: RuntimeOptions) -> HopSchedule:
    """The schedule `runtime` asks for (layers.chunk_schedule.runtime_schedule) over CosyVoice2's attention chunks."""
    extra = extra_constants(bundle)
    return runtime_schedule(runtime, extra.chunk_tokens, extra.pre_lookahead, bundle.constants)


def extra_constants(bundle: ModelBundle) -> CosyVoice2Constants:
    try:
        return constants_of(bundle.manifest)
    except BundleError as e:
        raise BundleError(f"{bundle.root}: {e}") from e
