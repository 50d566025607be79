"""Which admitted synthesis jobs of one model run now: a job starts when the admission decision
(service.engine.admission.admits: count, or real-time capacity) says so and its footprint fits the process's memory
budget; until then it waits in a bounded queue (first in, first out), and one more than the queue holds is refused
(503 + Retry-After). Thin wiring: the decision is the kit's pure function."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from service.engine.admission import AdmissionMode, CapacityMeter, State, Stream, admits
from service.engine.footprint import Footprint, output_bytes
from service.engine.memory import StreamBudget
from service.engine.types import SynthesisOptions
from service.errors import TextTooLongError
from service.speech.job import SpeechJob, SynthesisObserver
from service.speech.request import PreparedSpeech


@dataclass
class _Running:
    audio_s: float = 0.0
    first_at: float | None = None  # when its first audio was made (the listener starts then)
    on_worker: bool = False


class StreamGate:
    """The jobs of one synthesis service: running (at most `concurrency`), queued (at most `queue_max`), and the
    running ones' audio for the real-time decision. A job is offered with what hands it to a worker; on the worker it
    calls `on_worker`, then `produced` with each chunk's audio and `finished` when it ends. Thread-safe."""

    def __init__(
        self,
        *,
        concurrency: int,
        queue_max: int,
        mode: AdmissionMode,
        budget: StreamBudget,
        meter: CapacityMeter,
        observer: SynthesisObserver,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.concurrency, self.queue_max, self.mode = concurrency, queue_max, mode
        self.budget, self.meter = budget, meter
        self._observer, self._clock = observer, clock
        self._lock = threading.Lock()
        self._queue: deque[tuple[SpeechJob, int, Callable[[], None]]] = deque()
        self._running: dict[SpeechJob, _Running] = {}
        self._working = 0  # jobs on a worker now (started and not finished)
        budget.listen(self.dispatch)

    def offer(self, job: SpeechJob, nbytes: int, start: Callable[[], None]) -> bool:
        """Start `job` (`start` hands it to a worker; `nbytes` of the memory budget reserved for it) or queue it; False
        when the queue is full."""
        with self._lock:
            if len(self._queue) >= self.queue_max and not (not self._queue and self._startable(nbytes)):
                return False
            self._queue.append((job, nbytes, start))
        self._changed()
        self.dispatch()
        return True

    def full(self) -> bool:
        """Whether one more job would be refused now (cheap; any thread)."""
        with self._lock:
            return len(self._queue) >= self.queue_max and not (not self._queue and self._startable(0))

    def counts(self) -> tuple[int, int]:
        """(waiting, running) jobs: queued or not yet on a worker, and on a worker."""
        with self._lock:
            return len(self._queue) + len(self._running) - self._working, self._working

    def on_worker(self, job: SpeechJob) -> None:
        """`job` is on a worker now."""
        with self._lock:
            running = self._running.get(job)
            if running is not None and not running.on_worker:
                running.on_worker = True
                self._working += 1
        self._changed()

    def produced(self, job: SpeechJob, audio_s: float) -> None:
        """`job` made `audio_s` more seconds of audio (its listener starts at the first)."""
        with self._lock:
            running = self._running.get(job)
            if running is not None:
                running.audio_s += audio_s
                if running.first_at is None and audio_s > 0:
                    running.first_at = self._clock()
            waiting = bool(self._queue)
        self.meter.produced(audio_s)
        if waiting:
            self.dispatch()

    def finished(self, job: SpeechJob) -> None:
        """`job` ended (done, failed or cancelled): its place and memory go back, queued jobs may start."""
        with self._lock:
            ended = self._running.pop(job, None)
            if ended is not None and ended.on_worker:
                self._working -= 1
            running = len(self._running)
        self.meter.streams(running)
        self._changed()
        self.budget.release(job)  # calls every gate's dispatch, this one's too

    def dispatch(self) -> None:
        """Start the queued jobs the decision and the budget let start now, in order (a cancelled one at once)."""
        started: list[Callable[[], None]] = []
        with self._lock:
            while self._queue:
                job, nbytes, start = self._queue[0]
                cancelled = job.cancel_event.is_set()
                if not cancelled and not (self._startable(nbytes) and self.budget.try_take(job, nbytes)):
                    break
                self._queue.popleft()
                self._running[job] = _Running()
                started.append(start)
            running = len(self._running)
        if started:
            self.meter.streams(running)
        for start in started:
            start()

    def _startable(self, nbytes: int) -> bool:
        """Whether one more job may start now (the lock held): the decision, then the memory budget."""
        now = self._clock()
        streams = tuple(Stream(r.audio_s, None if r.first_at is None else now - r.first_at) for r in self._running.values())
        state = State(self.mode, streams, self.concurrency, self.meter.capacity())
        return admits(state) and self.budget.fits(nbytes)

    def _changed(self) -> None:
        waiting, running = self.counts()
        self._observer.queue_changed(waiting, running)


def request_bytes(
    engine: object, prepared: PreparedSpeech, options: SynthesisOptions, sample_rate: int, limit: int | None
) -> int:
    """What a request may hold at once: its model's footprint (`engine.footprint`, the Model protocol's) and a
    whole-file answer's samples; 0 for a model that states none. TextTooLongError when that is more than the memory
    budget `limit` has in all (it could never start)."""
    spoken = [list(s.ids) for s in prepared.spoken]
    bound = getattr(engine, "footprint", None)
    found: Footprint | None = bound(spoken, prepared.voice, options) if bound is not None and spoken else None
    if found is None:
        return 0
    whole_file = not prepared.request.chunked
    nbytes = found.total + output_bytes(found, sample_rate, prepared.speed, whole_file=whole_file)
    if limit is not None and nbytes > limit:
        raise TextTooLongError(
            f"this request may hold {nbytes >> 20} MB ({found.describe()}), more than the server's memory budget for "
            f"requests ({limit >> 20} MB, TTS_MEMORY_LIMIT): stream it, shorten its sentences or use a shorter recording",
            param="text",
        )
    return nbytes
