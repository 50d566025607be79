"""Whether one more synthesis stream may start now: a pure function of plain state (the streams running, what the
engine was measured to make), and the meter that measures it.

A stream's listener takes one second of audio per second. The engine makes `rate` audio seconds per wall second with
n streams running (measured per n: batching makes more in all as streams are added, up to what the cores allow), and
shares it among them. A new stream is admitted (`admits`, mode "realtime") only while the rate expected with it
covers every running stream and it with a margin, and every stream already playing is a little ahead of its listener:
so the streams that play never stall because one more arrived; the newcomer waits in the queue instead (its first
audio comes later). Before anything is measured, and in mode "count", streams start while fewer than `concurrency`
run (the service as it was).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

AdmissionMode = Literal["realtime", "count"]
MARGIN = 0.05  # the expected rate must exceed the streams' demand by this share
MIN_LEAD_S = 1.0  # a playing stream must be this far ahead of its listener before another starts beside it


@dataclass(frozen=True)
class Stream:
    """One running stream: the seconds of audio it has made, and how long its listener has been playing (None: no
    audio yet)."""

    audio_s: float
    playing_s: float | None = None

    @property
    def lead_s(self) -> float | None:
        """Seconds of audio made beyond what a listener who started at its first audio has heard (None: none yet)."""
        return None if self.playing_s is None else self.audio_s - self.playing_s


@dataclass(frozen=True)
class Capacity:
    """What the engine was measured to make: audio seconds per wall second with n streams running (by n), and what
    it would make with every core busy (audio seconds per CPU second of the process times its cores; None: unknown)."""

    by_streams: Mapping[int, float] = field(default_factory=dict)
    cores_rate: float | None = None


@dataclass(frozen=True)
class State:
    """What the decision reads."""

    mode: AdmissionMode
    streams: tuple[Stream, ...]  # running now
    concurrency: int  # the most that may run at once in any mode
    capacity: Capacity = Capacity()
    margin: float = MARGIN
    min_lead_s: float = MIN_LEAD_S


def expected_rate(capacity: Capacity, streams: int) -> float | None:
    """Audio seconds per wall second the engine is expected to make with `streams` running: measured with that many;
    else the measure with the most streams below, grown in proportion to the streams, but never beyond what the
    cores allow nor what was measured with more streams; None before anything is measured."""
    measured = capacity.by_streams
    if streams in measured:
        return measured[streams]
    below = [n for n in measured if n < streams]
    if not below:
        return capacity.cores_rate
    n = max(below)
    rate = measured[n] * streams / n
    ceilings = [measured[m] for m in measured if m > streams]
    if capacity.cores_rate is not None:
        ceilings.append(max(capacity.cores_rate, measured[n]))
    return min([rate, *ceilings])


def admits(state: State) -> bool:
    """Whether one more stream may start now."""
    n = len(state.streams)
    if n >= state.concurrency:
        return False
    if state.mode == "count" or n == 0:
        return True
    rate = expected_rate(state.capacity, n + 1)
    if rate is None:
        return True  # nothing measured yet: as many as `concurrency`
    if rate < (n + 1) * (1.0 + state.margin):
        return False
    return all(s.lead_s is None or s.lead_s >= state.min_lead_s for s in state.streams)


class CapacityMeter:
    """Measures `Capacity` from what an engine makes (thread-safe; its clocks are injectable).

    The caller says how many streams run (`streams`) and how much audio they make (`produced`). A window closes once
    `window_s` of wall time has passed with the same number running throughout and some audio made; its rate (audio
    per wall second) is averaged into that number's measure, its audio per CPU second of the process times `cores`
    into the cores' rate (moving averages). A change of the number running starts a new window.
    """

    def __init__(
        self,
        cores: int,
        *,
        window_s: float = 2.0,
        smoothing: float = 0.3,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.process_time,
    ) -> None:
        self.cores = max(1, cores)
        self.window_s = window_s
        self._alpha = smoothing
        self._clock, self._cpu = clock, cpu_clock
        self._lock = threading.Lock()
        self._by_streams: dict[int, float] = {}
        self._cores_rate: float | None = None
        self._running = 0
        self._start, self._cpu_start, self._audio = clock(), cpu_clock(), 0.0

    def streams(self, running: int) -> None:
        """`running` streams run from now on (a new window starts when that changes)."""
        with self._lock:
            if running != self._running:
                self._running = running
                self._restart()

    def produced(self, audio_s: float) -> None:
        """The running streams made `audio_s` more seconds of audio."""
        with self._lock:
            self._audio += audio_s
            wall = self._clock() - self._start
            if self._running == 0 or wall < self.window_s or self._audio <= 0:
                return
            cpu = self._cpu() - self._cpu_start
            self._by_streams[self._running] = self._mix(self._by_streams.get(self._running), self._audio / wall)
            if cpu > 0:
                self._cores_rate = self._mix(self._cores_rate, self._audio / cpu * self.cores)
            self._restart()

    def capacity(self) -> Capacity:
        with self._lock:
            return Capacity(dict(self._by_streams), self._cores_rate)

    def _restart(self) -> None:
        self._start, self._cpu_start, self._audio = self._clock(), self._cpu(), 0.0

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self._alpha) * old + self._alpha * new
