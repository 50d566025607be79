"""Sentences to audio for the WebSocket transports: complete sentences wait in a queue bounded by characters, each
becomes its own job one ahead of the audio being sent, the audio goes out in order on a timeline of decoded samples,
`cancel()` stops the sentence being spoken and drops the rest while the connection goes on, and `stop_after_current()`
(a drain) lets the sentence being spoken end and drops the rest. A place of capacity is held only while a job exists."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import NoReturn, Protocol

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from starlette.websockets import WebSocketDisconnect

from service.api.deps import AppState
from service.api.streaming import JobPieces
from service.audio.timeline import SampleCounter
from service.errors import EmptyTextError, OverloadedError, TTSError
from service.runtime import Slot
from service.speech.job import SentenceMark, SpeechJob
from service.speech.request import SpeechRequest
from service.speech.service import TTSService

OVERLOADED_WAIT_S = 30.0  # a sentence the service cannot take yet is retried this long before the session fails
Handoff = tuple[int, str, SpeechJob | None]


@dataclass(frozen=True)
class Caption:
    """One synthesized piece of a sentence as its listener got it: the written text it was read from and where its
    audio lies on the timeline. A sentence is one piece unless the frontend split it (a long sentence)."""

    text: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SpokenSentence:
    """One sentence as its listener got it: its frames, where its audio lies on the connection's timeline, and its
    captions (one per synthesized piece, back to back from `start_s` to `end_s`; none when nothing was said)."""

    index: int
    text: str
    first_seq: int
    frames: int
    audio_bytes: int
    start_s: float
    end_s: float
    spoken: bool  # False: nothing to say (e.g. only an emoji); no frames
    captions: tuple[Caption, ...] = ()

    @property
    def last_seq(self) -> int:
        return self.first_seq + self.frames - 1


@dataclass
class SentAudio:
    """What one sentence has sent so far: its bytes and the captions of its pieces."""

    start_s: float
    texts: tuple[str, ...]
    bytes: int = 0
    captions: list[Caption] = field(default_factory=list)


class AudioSink(Protocol):
    """How a transport frames what the pipeline produces (sent in this order for each sentence)."""

    async def begin(self, index: int, text: str, start_s: float, pieces: tuple[str, ...]) -> None:
        """Before the sentence's first audio, which will start at `start_s` on the timeline; `pieces` are the written
        texts of its synthesized pieces, in order (`text` alone when nothing is said)."""

    async def audio(self, index: int, seq: int, piece: bytes) -> None:
        """One piece of the sentence's audio; `seq` numbers the pieces of the whole pipeline from 0."""

    async def caption(self, index: int, number: int, caption: Caption) -> None:
        """After the audio of the sentence's synthesized piece `number` (the last one's comes after all its audio)."""

    async def end(self, sentence: SpokenSentence) -> None:
        """After the sentence's last audio (never for a sentence cut off by `cancel()`)."""


class SentenceQueue:
    """Complete sentences waiting for synthesis; `put` waits while they hold `max_chars` characters or more."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self._items: deque[tuple[int, str]] = deque()
        self._chars = 0
        self._finished = False
        self._changed = anyio.Event()

    async def put(self, index: int, text: str) -> None:
        while self._chars >= self.max_chars:
            await self._changed.wait()
        self._items.append((index, text))
        self._chars += len(text)
        self._notify()

    async def get(self) -> tuple[int, str] | None:
        """The next sentence; None once `finish()` was called and none is left."""
        while not self._items:
            if self._finished:
                return None
            await self._changed.wait()
        index, text = self._items.popleft()
        self._chars -= len(text)
        self._notify()
        return index, text

    def finish(self) -> None:
        self._finished = True
        self._notify()

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()
        self._chars = 0
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


class SpeechPipeline:
    """One connection's (or one task's) speech. `run()` speaks what `put()` queues until `finish()`; each sentence is a
    job of its own, started while the previous one is sent, so at most two jobs exist. The timeline counts what a
    decoder yields for the bytes sent: a fresh `counter()` per sentence, at `rate_hz`.

    The pipeline holds one in-flight place of the runtime (`Runtime.claim`) from its first job to the moment no job of
    it is left: a session that is idle between sentences holds none, however long it stays connected."""

    def __init__(
        self,
        state: AppState,
        service: TTSService,
        template: SpeechRequest,
        sink: AudioSink,
        counter: Callable[[], SampleCounter],
        rate_hz: int,
    ) -> None:
        self.state = state
        self.service = service
        self.template = template
        self.sink = sink
        self.counter = counter
        self.rate_hz = rate_hz
        self.queue = SentenceQueue(template.max_chars)
        self.seq = 0  # pieces sent
        self.samples = 0  # the timeline: decoded samples of everything sent, a cut-off sentence's part included
        self.sentences_done = 0
        self.speaking: int | None = None  # index of the sentence whose audio is being sent
        self._next_index = 0
        self._jobs: set[SpeechJob] = set()
        self._current: SpeechJob | None = None  # the job whose audio is being sent
        self._starting = False  # a sentence taken from the queue is being submitted
        self._slot: Slot | None = None  # this pipeline's place while it has jobs
        self._stopping = False  # stop_after_current(): no sentence after the one being spoken
        self._turn: anyio.CancelScope | None = None
        self._stopped = anyio.Event()

    @property
    def idle(self) -> bool:
        """True while nothing is being spoken or waits to be (text without a sentence end is not counted)."""
        return not self._jobs and not self.queue and not self._starting and self.speaking is None

    @property
    def time_s(self) -> float:
        """Seconds of audio sent so far (the end of the timeline)."""
        return self.samples / self.rate_hz

    async def put(self, text: str) -> None:
        """Queue one complete sentence (waits while the queue is full)."""
        await self.queue.put(self._next_index, text)
        self._next_index += 1

    def finish(self) -> None:
        """No more sentences: `run()` returns once the queued ones are spoken."""
        self.queue.finish()

    def stop_after_current(self) -> None:
        """No more sentences after the one being spoken (a drain): it is finished, every sentence waiting is dropped and
        the one synthesized ahead cancelled, then `run()` returns."""
        self._stopping = True
        self.queue.clear()
        self.queue.finish()
        for job in self._jobs:
            if job is not self._current:
                job.cancel()

    async def run(self) -> None:
        """Speak until `finish()`; a `cancel()` ends the current turn and the next one starts. However it ends (a
        failure, the connection going away), no job of this pipeline outlives it."""
        try:
            while True:
                self._stopped = anyio.Event()
                with anyio.CancelScope() as self._turn:
                    try:
                        await self._speak()
                        return
                    finally:
                        self._drop()
                        self._stopped.set()
        finally:
            self._turn = None
            self._drop()

    async def cancel(self) -> None:
        """Stop the sentence being spoken (its synthesis is cancelled, as on a disconnect) and drop every sentence
        waiting; returns once nothing of them will be sent any more. Sentences put afterwards are spoken as usual."""
        if self._turn is None:
            self._drop()
            return
        stopped = self._stopped
        self._turn.cancel()
        await stopped.wait()

    def _drop(self) -> None:
        self.queue.clear()
        for job in self._jobs:
            job.cancel()
        self._jobs.clear()
        self._give_place_back()
        self.speaking = None

    def _give_place_back(self) -> None:
        """Release the place once no job of this pipeline is left (between sentences a session holds none)."""
        if not self._jobs and self._slot is not None:
            self._slot.release()
            self._slot = None

    async def _speak(self) -> None:
        jobs_in, jobs_out = anyio.create_memory_object_stream[Handoff](0)
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._submit, jobs_in)
                await self._send(jobs_out)
                group.cancel_scope.cancel()  # the sender may stop early (a drain): the submitter has nothing left to do
        except BaseExceptionGroup as group_error:
            reraise_first(group_error)

    async def _submit(self, jobs: ObjectSendStream[Handoff]) -> None:
        """Sentences -> running jobs, one ahead of the sender: sentence 2 synthesizes while sentence 1 is sent."""
        async with jobs:
            while (item := await self.queue.get()) is not None:
                index, text = item
                self._starting = True
                try:
                    job = await self._start(replace(self.template, text=text))
                finally:
                    self._starting = False
                try:
                    await jobs.send((index, text, job))
                except anyio.BrokenResourceError:
                    return  # the sender stopped early (a drain): this job is dropped with the turn

    async def _start(self, request: SpeechRequest) -> SpeechJob | None:
        """Submit one sentence, with the pipeline's place taken first if it holds none; None when it has nothing to
        speak (e.g. only an emoji). While the service is full, retry for up to OVERLOADED_WAIT_S: the connection must
        not lose a sentence."""
        deadline = time.monotonic() + OVERLOADED_WAIT_S
        while True:
            try:
                with anyio.CancelScope(shield=True):  # a job that exists is registered, so that a cancel reaches it
                    self._slot = self._slot or self.state.runtime.claim()
                    job = await anyio.to_thread.run_sync(self.service.submit, request)
                    self._jobs.add(job)
                return job
            except EmptyTextError:
                self._give_place_back()
                return None
            except OverloadedError:
                if time.monotonic() > deadline:
                    raise
                await anyio.sleep(0.05)

    async def _send(self, jobs: ObjectReceiveStream[Handoff]) -> None:
        async with jobs:
            async for index, text, job in jobs:
                if self._stopping:
                    return
                await self._speak_one(index, text, job)

    async def _speak_one(self, index: int, text: str, job: SpeechJob | None) -> None:
        first_seq, start, counter = self.seq, self.samples, self.counter()
        texts = tuple(s.source or s.text for s in job.prepared.spoken) if job is not None else (text,)
        self.speaking, self._current = index, job
        await self.sink.begin(index, text, start / self.rate_hz, texts)
        sent = SentAudio(start / self.rate_hz, texts)
        try:
            if job is not None:
                await self._send_audio(index, job, counter, sent)
        finally:
            self.samples = start + counter.samples  # what was sent of a cut-off sentence stays on the timeline
            if job is not None:
                self._jobs.discard(job)
                self._give_place_back()
            self._current = None
        self.speaking = None
        if job is not None:  # the last piece ends where the sentence's audio ends, its tail frames included
            await self._caption(index, sent, self.time_s)
        frames, start_s = self.seq - first_seq, start / self.rate_hz
        spoken = SpokenSentence(index, text, first_seq, frames, sent.bytes, start_s, self.time_s, job is not None)
        await self.sink.end(replace(spoken, captions=tuple(sent.captions)))
        self.sentences_done += 1

    async def _send_audio(self, index: int, job: SpeechJob, counter: SampleCounter, sent: SentAudio) -> None:
        """The job's audio through the sink, and a caption after each of its pieces but the last (whose audio is not
        all sent yet); leaving early (cancel, disconnect, failure) cancels its synthesis."""
        pieces = JobPieces(job, self.state)
        await pieces.start()
        async with aclosing(pieces.events()) as items:
            async for item in items:
                if isinstance(item, SentenceMark):
                    if item.index + 1 < len(sent.texts):  # marks count in seconds of this sentence's decoded audio
                        await self._caption(index, sent, sent.start_s + item.end_s)
                elif item:
                    await self.sink.audio(index, self.seq, item)  # a cancel lands before a frame is written, never inside
                    counter.feed(item)
                    self.seq += 1
                    sent.bytes += len(item)

    async def _caption(self, index: int, sent: SentAudio, end_s: float) -> None:
        """The next piece's caption: from where the one before ended to `end_s` on the timeline."""
        number = len(sent.captions)
        start_s = sent.captions[-1].end_s if sent.captions else sent.start_s
        caption = Caption(sent.texts[min(number, len(sent.texts) - 1)], start_s, max(start_s, end_s))
        sent.captions.append(caption)
        await self.sink.caption(index, number, caption)


def reraise_first(group_error: BaseExceptionGroup[BaseException]) -> NoReturn:
    """The error that ended a task group: ours (TTSError) or the client leaving, before anything else."""
    for kind in (TTSError, WebSocketDisconnect):
        match = group_error.subgroup(lambda e, kind=kind: isinstance(e, kind))  # type: ignore[misc]
        if match is not None:
            first: BaseException = match.exceptions[0]
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first
    raise group_error
