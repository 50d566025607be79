"""The chunk schedule interface every family's streaming implements, and the rates it plans with.

A streamed sentence is vocoded in chunks as its speech tokens arrive. A family's schedule is a pure function of plain
state (`Progress`: where the sentence stands) and measured rates (`Rates`) to the next hop; `first_audio` alone decides
whether a chunk carries the request's first audio (it is then urgent: pooled, served first, its tokens decoded
first). No threads, clock or sessions here: tests drive a schedule step by step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Rates:
    """What this engine costs where it runs, as measured while serving (see RateMeter): seconds per unit of work.

    token_s: interval between two tokens of one stream (decode step under the current load, pauses included).
    solver_frame_s: flow seconds per solver frame of a chunk (all Euler steps; prompt frames count).
    vocoder_frame_s: HiFT seconds per mel frame vocoded.
    call_s: fixed seconds per acoustic chunk (encoder, graph launches, cross-fades).
    """

    token_s: float
    solver_frame_s: float
    vocoder_frame_s: float
    call_s: float = 0.0


@dataclass(frozen=True)
class Progress:
    """Where one streamed sentence stands when its next chunk is planned."""

    chunks: int  # chunks of this sentence emitted so far
    last_hop: int  # hop of the previous chunk (0 before the first)
    buffered: int  # tokens generated and not yet consumed (the previous chunk's look-ahead included)
    llm_done: bool  # the LLM has ended this sentence
    audio_s: float  # seconds of audio the request has delivered so far (all sentences)
    prompt_frames: int = 0  # prompt mel frames each flow call of this sentence solves with the chunk
    speed: float = 1.0  # tempo: a chunk's audio lasts 1/speed of its mel
    consumed: int = 0  # speech tokens of this sentence whose audio is out (the hops so far)
    prompt_tokens: int = 0  # prompt speech tokens each flow call of this sentence sees before its own
    carry: int = 0  # the schedule's own number from its previous answer (Hop.carry); 0 at a sentence's start


@dataclass(frozen=True)
class Hop:
    """The schedule's answer: the next chunk consumes `tokens` and waits for `look_ahead` more (or the LLM's end)."""

    tokens: int
    look_ahead: int
    carry: int = 0  # handed back in the next Progress (a schedule that grows its hops keeps its base there)


class ChunkSchedule(Protocol):
    """What every family's chunk schedule answers, from plain state (no threads, clock or sessions)."""

    def next_hop(self, progress: Progress, rates: Rates | None) -> Hop:
        """The next chunk of a streamed sentence; `rates` are what the engine measured (None before any)."""
        ...

    def first_audio_tokens(self, prompt_tokens: int) -> int:
        """Speech tokens the LLM must deliver before a sentence's first chunk can be made (its urgent tokens)."""
        ...

    def takes_tail(self, left: int) -> bool:
        """Whether a chunk about to be cut with `left` tokens after its hop takes them along as the sentence's last
        chunk once the token stream has ended (instead of a last call of their own)."""
        ...

    def takes_cores(self, tokens: int, *, first: bool, final: bool) -> bool:
        """Whether a chunk of `tokens` speech tokens (a sentence's `first`, its `final`) may run its flow on both cores
        while the decode steps step aside; the engine still gives them only when nothing else runs."""
        ...

    def vocoder_takes_cores(self, tokens: int, *, before: int, final: bool) -> bool:
        """Whether the vocoder call of a chunk of `tokens` speech tokens after `before` of its sentence may run on both
        cores (a wider session), on the same terms."""
        ...


def first_audio(progress: Progress) -> bool:
    """True when the next chunk carries the request's first audio: it is urgent (pooled, served first, the LLM
    keeps decoding for it, the acoustic calls let it go first). The one place any family decides this."""
    return progress.audio_s == 0.0 and progress.chunks == 0


class RateMeter:
    """Learns `Rates` from what the engine does (warm-up first, then every request): moving averages per bundle and host.

    The acoustic rates are kept twice, for calls made while their sentence's tokens were still being decoded beside
    them (`beside_decode`: the decode step holds a core, so a flow call gets about one) and for calls made after
    (both cores free, e.g. a sentence's last chunk): a mix of the two made a chunk planned beside the decode look
    about twice as cheap as it is (docs/perf-log.md). Thread-safe; observations are cheap (a lock and a few floats).
    `rates()` is None until a token, a flow call and a vocoder call were seen once.
    """

    def __init__(self, smoothing: float = 0.2) -> None:
        self._alpha = smoothing
        self._lock = threading.Lock()
        self._token_s: float | None = None
        self._solver_frame_s: dict[bool, float] = {}  # beside_decode -> seconds per solver frame
        self._vocoder_frame_s: dict[bool, float] = {}

    def token_interval(self, seconds: float) -> None:
        """One stream got its next token `seconds` after the previous one (a decode step, pauses included)."""
        if seconds > 0:
            with self._lock:
                self._token_s = self._mix(self._token_s, seconds)

    def flow_call(self, solver_frames: int, seconds: float, *, beside_decode: bool = True) -> None:
        """One flow solve of `solver_frames` frames (one request's) took `seconds`."""
        if solver_frames > 0 and seconds > 0:
            with self._lock:
                found = self._solver_frame_s.get(beside_decode)
                self._solver_frame_s[beside_decode] = self._mix(found, seconds / solver_frames)

    def vocoder_call(self, frames: int, seconds: float, *, beside_decode: bool = True) -> None:
        """One HiFT call over `frames` mel frames took `seconds`."""
        if frames > 0 and seconds > 0:
            with self._lock:
                found = self._vocoder_frame_s.get(beside_decode)
                self._vocoder_frame_s[beside_decode] = self._mix(found, seconds / frames)

    def rates(self, *, beside_decode: bool = True) -> Rates | None:
        """The rates of a chunk made beside the decode (or, with False, after it); until calls of that kind were seen,
        those of the other kind."""
        with self._lock:
            token = self._token_s
            solver = self._solver_frame_s.get(beside_decode, self._solver_frame_s.get(not beside_decode))
            vocoder = self._vocoder_frame_s.get(beside_decode, self._vocoder_frame_s.get(not beside_decode))
        if token is None or solver is None or vocoder is None:
            return None
        return Rates(token_s=token, solver_frame_s=solver, vocoder_frame_s=vocoder)

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self._alpha) * old + self._alpha * new
