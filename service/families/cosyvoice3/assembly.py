"""How a CosyVoice3 engine is put together from a bundle and runtime options: its constants and sessions, its chunk
schedule, the DiT caches' window, and the silent-token filter between the LLM and the flow."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.engine.scheduler import EndAware
from service.engine.sessions import open_sessions
from service.errors import BundleError
from service.families.cosyvoice3.contract import GRAPH_IO, CosyVoice3Constants, constants_of
from service.layers import acoustic_plan, frame_window
from service.layers.chunk_schedule import HopSchedule, runtime_schedule


def extra_constants(bundle: ModelBundle) -> CosyVoice3Constants:
    try:
        return constants_of(bundle.manifest)
    except BundleError as e:
        raise BundleError(f"{bundle.root}: {e}") from e


# The causal f0 predictor computes in float64 (as the official code does: "precision is crucial for causal
# inference"); OpenVINO would run it in bf16 where the CPU computes bf16, so it always runs on ONNX Runtime.
FLOAT64_GRAPHS = ("hift_f0",)


def open_engine_sessions(bundle: ModelBundle, runtime: RuntimeOptions, *, wide: bool) -> dict[str, Any]:
    """The bundle's CosyVoice3 graphs as `runtime` asks (layers.acoustic_plan.open_engine_sessions), the float64 ones
    on ONNX Runtime whatever the acoustic backend."""
    names = tuple(n for n in GRAPH_IO if n not in FLOAT64_GRAPHS)
    sessions = acoustic_plan.open_engine_sessions(bundle, runtime, names, wide=wide)
    return sessions | open_sessions(bundle, replace(runtime, acoustic_backend="ort"), names=FLOAT64_GRAPHS)


def stream_schedule(bundle: ModelBundle, runtime: RuntimeOptions) -> HopSchedule:
    """The schedule `runtime` asks for over the DiT's attention chunks: the early first audio (default) or the official
    25 + pad, 50, 100 (`official`, which also switches the engine to the official recompute stream)."""
    extra = extra_constants(bundle)
    return runtime_schedule(runtime, extra.chunk_tokens, extra.pre_lookahead, bundle.constants)


def window_frames(seconds: float | None, extra: CosyVoice3Constants, frame_rate_hz: float) -> int | None:
    """Generated mel frames a streamed flow keeps attending to for `seconds` (None: all), in whole attention chunks and
    at least two of them (the window drops half of itself at a time)."""
    return frame_window.window_frames(seconds, extra.chunk_tokens * extra.token_mel_ratio, frame_rate_hz)


class SilenceFilter:
    """The official llm_job's filter on the LLM's tokens (cli/model.py:101-129): a silent token after `max_run` silent
    tokens in a row is dropped; the flow sees the rest. Keeps telling whether the stream has ended (EndAware). `taken`:
    the tokens read from the LLM so far, dropped ones included (what the request's speech budget counts)."""

    def __init__(self, tokens: Iterator[int], silent: frozenset[int], max_run: int) -> None:
        self._tokens, self._silent, self._max_run = tokens, silent, max_run
        self._run = 0
        self.taken = 0

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        while True:
            token = next(self._tokens)
            self.taken += 1
            if token not in self._silent:
                self._run = 0
                return token
            self._run += 1
            if self._run <= self._max_run:
                return token

    def ended(self, wait_s: float) -> bool:
        return isinstance(self._tokens, EndAware) and self._tokens.ended(wait_s)
