"""Continuous batching: every request's LLM decode steps run as one batched step on one scheduler thread, which does
what the pure planner (service/engine/planner.py) decides."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from service.engine import planner
from service.engine.chunking import RateMeter
from service.engine.llm import DecodeBatch, LLMRequest, LLMRunner
from service.engine.types import LLMPrompt, as_llm_prompt
from service.errors import EngineError, ShuttingDownError, TTSError

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a waiting consumer looks at its cancel event
_YIELD_POLL_S = 0.005  # how often a paused scheduler re-checks yield_to (it is also woken by waiting consumers)
_END = None


@dataclass(eq=False)
class _Job:
    """One request handed to the scheduler thread; `out` carries token lists, then None or an exception."""

    text_ids: list[int]
    prompt: LLMPrompt
    rng: np.random.Generator
    min_tokens: int | None
    max_tokens: int | None
    urgent_tokens: int = 0  # its first `urgent_tokens` tokens feed the request's first audio
    cancel: threading.Event | None = None  # the request's: once set, it leaves the batch before the next step
    out: queue.SimpleQueue[list[int] | BaseException | None] = field(default_factory=queue.SimpleQueue)
    abandoned: threading.Event = field(default_factory=threading.Event)
    sent: int = 0
    taken: int = 0  # tokens its consumer has taken (sent - taken: decoded and not yet needed)
    waiting: bool = False  # its consumer is blocked until the next tokens arrive

    def deliver(self, request: LLMRequest) -> None:
        """Pass on the tokens chosen since the last delivery; end the stream once the request finished."""
        if len(request.tokens) > self.sent:
            self.out.put(request.tokens[self.sent :])
            self.sent = len(request.tokens)
        if request.finished:
            self.out.put(_END)

    def fail(self, error: BaseException) -> None:
        self.out.put(error)

    def gone(self) -> bool:
        """Its consumer dropped the stream, or the request was cancelled (its consumer may be busy elsewhere, in a
        flow or vocoder call, and not see it before that call ends: no step is decoded for it meanwhile)."""
        return self.abandoned.is_set() or (self.cancel is not None and self.cancel.is_set())


@dataclass
class SchedulerStats:
    """Counters of one scheduler (read without a lock: approximate while it runs)."""

    steps: int = 0
    rows: int = 0  # sum of batch sizes over all steps
    prefills: int = 0
    max_rows: int = 0
    pauses: int = 0  # polls spent yielding the cores (see BatchScheduler.yield_to)

    @property
    def mean_batch(self) -> float:
        return self.rows / self.steps if self.steps else 0.0


@runtime_checkable
class EndAware(Protocol):
    """A token iterator that can tell, without taking a token, that none will come any more."""

    def ended(self, wait_s: float = 0.0) -> bool: ...


class TokenStream(Iterator[int]):
    """The consumer side of one scheduled request: iterate for tokens; `close()` (or dropping it) leaves the batch."""

    def __init__(self, job: _Job, scheduler: BatchScheduler, cancel: threading.Event | None) -> None:
        self._job = job
        self._scheduler = scheduler
        self._cancel = cancel
        self._buffer: deque[int] = deque()
        self._done = False
        self._tail: BaseException | None = None  # an error seen by ready(), raised once the buffer is consumed

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> int:
        while not self._buffer:
            if self._tail is not None:
                error, self._tail = self._tail, None
                self.close()
                raise error
            if self._done:
                raise StopIteration
            self._take(self._wait())
        self._job.taken += 1
        return self._buffer.popleft()

    def ready(self) -> int:
        """Tokens already decoded and not yet taken: what the next calls return without waiting."""
        while not self._done and self._tail is None:
            try:
                self._take(self._job.out.get_nowait())
            except queue.Empty:
                break
        return len(self._buffer)

    def ended(self, wait_s: float = 0.0) -> bool:
        """True when no token will come any more (the request finished, or was cancelled, with nothing left to take).
        With nothing buffered and the end not seen yet, waits up to `wait_s` for the next delivery (a decode step in
        flight); False when a token or an error is there, or nothing came in time. Takes no token."""
        self.ready()
        if not self._done and not self._buffer and self._tail is None and wait_s > 0:
            try:
                self._take(self._job.out.get(timeout=wait_s))
            except queue.Empty:
                return False
            self.ready()
        return self._done and not self._buffer and self._tail is None

    def _take(self, item: list[int] | BaseException | None) -> None:
        if item is _END:
            self._done = True
        elif isinstance(item, BaseException):
            self._tail = item
        else:
            self._buffer.extend(item)

    def _wait(self) -> list[int] | BaseException | None:
        job = self._job
        if self._cancel is not None and self._cancel.is_set():
            self.close()
            return _END
        try:
            return job.out.get_nowait()
        except queue.Empty:
            pass
        job.waiting = True
        self._scheduler.wake()  # a paused scheduler must serve a consumer that waits for tokens
        try:
            while True:
                if self._cancel is not None and self._cancel.is_set():
                    self.close()
                    return _END
                try:
                    return job.out.get(timeout=_POLL_S if self._cancel is not None else None)
                except queue.Empty:
                    continue
        finally:
            job.waiting = False

    def close(self) -> None:
        """Stop: the scheduler drops the request before its next step (no-op once it has finished)."""
        if not self._job.abandoned.is_set():
            self._job.abandoned.set()
            self._scheduler.wake()
        self._done = True
        self._buffer.clear()

    def __del__(self) -> None:
        self.close()


class BatchScheduler:
    """Continuous batching: one thread runs the decode steps of all active requests as one `llm_step` call.

    A request joins after its prefill (run on the same thread, between steps) and leaves on EOS, its max
    length, when it is cancelled (its cancel event is read before every step) or when its consumer drops its
    TokenStream; the others keep their KV rows. It is a TokenGenerator (what the Synthesizer needs from the LLM),
    safe to call from any number of threads.

    `yield_to` (e.g. AcousticGate.first_audio_running) lets more urgent work have the cores: while it
    returns True the thread pauses between decode steps, unless a prefill is queued or a consumer is
    blocked waiting for one of its first `urgent_tokens` tokens (those it needs for its own first audio).
    A consumer waiting for later tokens already has audio and waits: a listener who has heard nothing
    yet is worse off. How many tokens are urgent is per request (`generate(urgent_tokens=...)`): the chunk
    schedule's first-audio tokens. With a `meter`, the interval between two decode steps (other requests' prefills
    included, first-audio pauses not) is recorded as each stream's token interval.

    `lead_tokens` > 0 with `acoustic_busy` (e.g. AcousticGate.busy): while acoustic calls run, the thread also pauses
    once every request has at least `lead_tokens` tokens decoded that its consumer has not taken yet (its next chunk
    can start as soon as the current one is done), unless a prefill is queued or a consumer waits. The decode steps run
    about twice as fast as speech; ahead of need they would only take a core from the chunk a listener waits for.

    `before_step` is called on the scheduler thread before every decode step (e.g. to let the step's kernels spread
    over the cores that acoustic work leaves idle at that moment).
    """

    def __init__(
        self,
        runner: LLMRunner,
        *,
        max_batch: int = 16,
        name: str = "llm-scheduler",
        yield_to: Callable[[], bool] | None = None,
        meter: RateMeter | None = None,
        lead_tokens: int = 0,
        acoustic_busy: Callable[[], bool] | None = None,
        before_step: Callable[[], None] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if lead_tokens < 0:
            raise ValueError("lead_tokens must be >= 0")
        self.runner = runner
        self.max_batch = max_batch
        self.yield_to = yield_to
        self.lead_tokens = lead_tokens
        self.acoustic_busy = acoustic_busy
        self.before_step = before_step
        self.meter = meter
        self._last_step: float | None = None
        self.stats = SchedulerStats()
        self._cond = threading.Condition()
        self._pending: deque[_Job] = deque()
        self._closed = False
        self._jobs: dict[LLMRequest, _Job] = {}
        self._batch = runner.new_batch()
        self._idle_cache_bytes = self._batch.cache.nbytes()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- consumer side -------------------------------------------------------------------------
    def generate(
        self,
        text_ids: Sequence[int],
        prompt: LLMPrompt | np.ndarray,
        rng: np.random.Generator,
        *,
        min_tokens: int | None = None,
        max_tokens: int | None = None,
        cancel: threading.Event | None = None,
        urgent_tokens: int = 0,
    ) -> TokenStream:
        """Queue a request (its prefill starts at once) and return its token stream.

        The scheduler thread owns `rng` until the stream ends. Raises ShuttingDownError after `close()`.
        `urgent_tokens`: how many first tokens feed the request's first audio (see `yield_to`).
        """
        job = _Job(list(map(int, text_ids)), as_llm_prompt(prompt), rng, min_tokens, max_tokens, urgent_tokens, cancel)
        with self._cond:
            if self._closed:
                raise ShuttingDownError("the LLM scheduler is stopped")
            self._pending.append(job)
            self._cond.notify()
        return TokenStream(job, self, cancel)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread; streams still waiting end with ShuttingDownError."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes held by the decode batch's K/V buffers (back to the initial size whenever the batch empties)."""
        return self._batch.cache.nbytes()

    @property
    def active(self) -> int:
        """Requests in the batch or waiting for their prefill."""
        return len(self._jobs) + len(self._pending)

    # ---- scheduler thread ----------------------------------------------------------------------
    def _run(self) -> None:
        batch = self._batch
        while True:
            admitted = self._next_admissions(len(batch))
            if admitted is None:
                break
            for job in admitted:
                self._admit(job, batch)
            self._drop_abandoned(batch)
            if len(batch) and self._yielding():
                self.stats.pauses += 1
                self._last_step = None  # a pause is not the decode rate the schedule plans with
                with self._cond:
                    self._cond.wait(_YIELD_POLL_S)
            elif len(batch):
                self._step(batch)
            if not len(batch):
                self._last_step = None  # idle time is no token interval
            if not len(batch) and batch.cache.nbytes() > self._idle_cache_bytes:
                # Empty: give the grown KV buffers back now, before waiting for work. The next requests
                # start from the small cache and grow it to their own length, not to the last burst's.
                batch = self._batch = self.runner.new_batch()
        self._shutdown(batch)

    def _yielding(self) -> bool:
        """Whether the planner gives the cores to acoustic work instead of the next decode step (planner.pauses)."""
        jobs = list(self._jobs.values())
        rows = tuple(planner.Row(job.waiting, job.sent, job.taken, job.urgent_tokens) for job in jobs)
        first_audio = self.yield_to is not None and self.yield_to()
        busy = self.lead_tokens > 0 and self.acoustic_busy is not None and bool(jobs) and self.acoustic_busy()
        return planner.pauses(planner.State(len(self._pending), rows, first_audio, busy, self.lead_tokens))

    def _next_admissions(self, in_batch: int) -> list[_Job] | None:
        """Wait for work; returns the jobs to prefill now ([] when only decoding), None when closed."""
        with self._cond:
            while not self._closed and not self._pending and not self._jobs:
                self._cond.wait()
            if self._closed:
                return None
            count = planner.admissions(len(self._pending), in_batch, self.max_batch)
            return [self._pending.popleft() for _ in range(count)]

    def _admit(self, job: _Job, batch: DecodeBatch) -> None:
        if job.gone():
            job.out.put(_END)
            return
        try:
            request = self.runner.start(job.text_ids, job.prompt, job.rng, min_tokens=job.min_tokens, max_tokens=job.max_tokens)
        except TTSError as e:
            job.fail(e)
            return
        except Exception as e:  # an ORT failure concerns this request only
            log.exception("LLM prefill failed")
            job.fail(EngineError(f"LLM prefill failed: {type(e).__name__}"))
            return
        self.stats.prefills += 1
        job.deliver(request)
        if not request.finished:
            batch.add(request)
            with self._cond:
                self._jobs[request] = job

    def _drop_abandoned(self, batch: DecodeBatch) -> None:
        for request in [r for r in batch.requests if self._jobs[r].gone()]:
            request.finish("cancelled")
            batch.remove(request)
            with self._cond:
                job = self._jobs.pop(request)
            job.out.put(_END)  # a consumer still reading ends with what it has

    def _step(self, batch: DecodeBatch) -> None:
        rows = list(batch.requests)
        now = time.perf_counter()
        if self.meter is not None and self._last_step is not None:
            self.meter.token_interval(now - self._last_step)
        self._last_step = now
        try:
            if self.before_step is not None:
                self.before_step()
            done = self.runner.step(batch)
        except Exception as e:  # the batch is in an unknown state: fail its requests, keep serving others
            log.exception("batched LLM decode step failed (%d rows)", len(rows))
            self._fail_all(batch, rows, f"LLM decode failed: {type(e).__name__}")
            return
        self.stats.steps += 1
        self.stats.rows += len(rows)
        self.stats.max_rows = max(self.stats.max_rows, len(rows))
        for request in rows:
            self._jobs[request].deliver(request)
        with self._cond:
            for request in done:
                del self._jobs[request]

    def _fail_all(self, batch: DecodeBatch, rows: list[LLMRequest], message: str) -> None:
        for request in rows:
            batch.remove(request)
            with self._cond:
                job = self._jobs.pop(request)
            job.fail(EngineError(message))

    def _shutdown(self, batch: DecodeBatch) -> None:
        with self._cond:
            jobs = list(self._jobs.values()) + list(self._pending)
            self._jobs.clear()
            self._pending.clear()
        for request in list(batch.requests):
            batch.remove(request)
        for job in jobs:
            job.fail(ShuttingDownError("the LLM scheduler stopped"))
