"""DashScope-compatible WebSocket (`/api-ws/v1/inference`): Alibaba Cloud's CosyVoice tts_v2 task protocol over our
voices, so an app built on the `dashscope` SDK moves here by changing its WebSocket base URL. docs/dashscope.md."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskGroup
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from service.access import Caller, presented_key
from service.api.admission import check_gate
from service.api.dashscope import (
    PATH,
    Message,
    MessageError,
    TaskOptions,
    parse_message,
    sentence_event,
    task_model,
    task_options,
)
from service.api.dashscope import event as server_event
from service.api.dashscope import task_failed as failed_event
from service.api.deps import AppState
from service.api.drain import receive_unless_draining
from service.api.pipeline import Caption, SpeechPipeline, SpokenSentence, reraise_first
from service.api.routes.openai import openai_voice
from service.api.routes.stream import GOING_AWAY_CLOSE, close_code, close_reason, going_away_reason
from service.audio.encode import AudioFormat, Pcm16Transcoder
from service.audio.timeline import PcmCounter, decoder_delay_s
from service.errors import (
    ErrorCode,
    InvalidInputError,
    RequestTimeoutError,
    ShuttingDownError,
    TextTooLongError,
    TTSError,
    UnsupportedCapabilityError,
)
from service.families.model import NamedVoice, VoiceReference
from service.frontend.incremental import IncrementalSegmenter
from service.served import ServedModel
from service.speech.request import SpeechRequest

log = logging.getLogger(__name__)
router = APIRouter(tags=["dashscope"])
TRANSPORT = "dashscope"
ENDED_TASKS_KEPT = 8  # late messages for these (just failed or cancelled) tasks are dropped: the client has been told
UNAUTHORIZED_CLOSE = 4401


class TaskSink:
    """One task's output: sentence-begin, the audio as one stream of the task's format (jobs speak PCM at the model's
    rate; this encodes it, in worker threads), sentence-end with times in milliseconds of the decoded stream."""

    def __init__(self, ws: WebSocket, task_id: str, transcoder: Pcm16Transcoder, delay_s: float, state: AppState) -> None:
        self.ws, self.task_id, self.transcoder, self.delay_s, self.state = ws, task_id, transcoder, delay_s, state
        self.characters = 0
        self.sentences = 0  # the protocol's sentence index: one per synthesized piece (a caption)
        self._pieces: tuple[str, ...] = ()
        self._text = ""
        self._characters_before = 0

    async def begin(self, index: int, text: str, start_s: float, pieces: tuple[str, ...]) -> None:
        self._pieces, self._text, self._characters_before = pieces, text, self.characters
        await self._begin(pieces[0], start_s)

    async def audio(self, index: int, seq: int, piece: bytes) -> None:
        data = await self._in_thread(self.transcoder.encode, piece)
        if data:
            await self.ws.send_bytes(data)

    async def caption(self, index: int, number: int, caption: Caption) -> None:
        """sentence-end for this piece, then sentence-begin for the next piece of the same written sentence; usage
        counts the characters of the text sent (markup and emoji included) once the sentence's last piece ends."""
        last = number + 1 >= len(self._pieces)
        self.characters = self._characters_before + len(self._text) if last else self.characters + len(caption.text)
        await self._end(caption.text, caption.start_s, caption.end_s)
        if not last:
            await self._begin(self._pieces[number + 1], caption.end_s)

    async def end(self, sentence: SpokenSentence) -> None:
        if not sentence.captions:  # nothing was said: its sentence-begin still gets its sentence-end
            self.characters += len(sentence.text)
            await self._end(sentence.text, sentence.start_s, sentence.end_s)

    async def _begin(self, text: str, start_s: float) -> None:
        times = {"begin_time": self._ms(start_s)}
        await self.ws.send_json(sentence_event(self.task_id, "sentence-begin", self.sentences, text, times, None))

    async def _end(self, text: str, start_s: float, end_s: float) -> None:
        times = {"begin_time": self._ms(start_s), "end_time": self._ms(end_s)}
        end = sentence_event(self.task_id, "sentence-end", self.sentences, text, times, self.characters)
        await self.ws.send_json(end)
        self.sentences += 1

    async def finish(self) -> None:
        """The encoder's tail (the last MP3/Opus frames)."""
        data = await self._in_thread(self.transcoder.finish)
        if data:
            await self.ws.send_bytes(data)

    def _ms(self, seconds: float) -> int:
        return round((seconds + self.delay_s) * 1000)

    async def _in_thread(self, work: Callable[..., bytes], *args: Any) -> bytes:
        return bytes(await anyio.to_thread.run_sync(work, *args, limiter=self.state.stream_threads))


@dataclass(eq=False)
class Task:
    """One run-task ... task-finished / task-failed: its sentences and audio stream (its pipeline holds a place of
    capacity while it has a sentence to speak)."""

    id: str
    pipeline: SpeechPipeline
    segmenter: IncrementalSegmenter
    sink: TaskSink
    started: float = field(default_factory=time.monotonic)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    done: anyio.Event = field(default_factory=anyio.Event)
    error: TTSError | None = None


class DashScopeSession:
    """One connection: any number of tasks, one at a time. The reader handles every message at once (a task's text
    goes into its pipeline, which a runner task speaks); each error ends the task it concerns with task-failed.

    A connection that sends nothing for TTS_WS_IDLE_TIMEOUT_S while nothing is being spoken is closed with 4408 (its
    task, if one runs, fails with `request_timeout` first). When the server drains, the reader stops, a running task
    finishes the sentence being spoken and fails with `shutting_down`, and the connection closes with 1001."""

    def __init__(self, ws: WebSocket, state: AppState) -> None:
        self.ws = ws
        self.state = state
        self.runtime = state.runtime
        self.task: Task | None = None
        self.ended: deque[str] = deque(maxlen=ENDED_TASKS_KEPT)
        self.closed = False  # we closed the connection (a wrong key)
        self._group: TaskGroup | None = None

    async def run(self) -> None:
        await self.ws.accept()  # always: the SDK can only report a refusal it receives as an event
        try:
            with contextlib.suppress(WebSocketDisconnect):
                await self._serve()
        except Exception:  # a fault of ours: logged, and the client gets 1011 rather than a dropped connection
            log.exception("DashScope session failed")
            await self._close(1011, "")

    async def _serve(self) -> None:
        try:
            async with anyio.create_task_group() as group:
                self._group = group
                with self.state.drain.until_begun():
                    await self._read()
                if not self.closed:  # the server drains
                    await self._go_away()
                group.cancel_scope.cancel()  # closed by us: a running task has nobody left to speak to
        except BaseExceptionGroup as group_error:
            reraise_first(group_error)

    async def _read(self) -> None:
        """Handle messages until we close the connection; RequestTimeoutError after TTS_WS_IDLE_TIMEOUT_S without one
        while nothing is being spoken."""
        idle_s = self.state.settings.ws_idle_timeout_s
        while not self.closed:
            try:
                message = await receive_unless_draining(self.ws, self.state.drain, idle_s)
            except TimeoutError:
                if self.task is None or self.task.pipeline.idle:
                    await self._idle(idle_s)
                continue
            if message is None:
                return
            text = message.get("text")
            await self._handle(None if text is None else str(text))

    async def _idle(self, idle_s: float) -> None:
        """Nothing came and nothing is spoken: the running task (if any) fails, then the connection closes with 4408."""
        error = RequestTimeoutError(f"no message for {idle_s:g} s (TTS_WS_IDLE_TIMEOUT_S)", param="message")
        if self.task is not None:
            await self._fail(self.task, error)
        await self._close(close_code(error), close_reason(error))

    async def _go_away(self) -> None:
        """The server drains: a running task finishes the sentence being spoken (by the drain's deadline) and fails with
        `shutting_down`; then the connection closes with 1001."""
        task = self.task
        if task is not None:
            task.error = task.error or ShuttingDownError("the server is shutting down; the rest of the text was not spoken")
            task.pipeline.stop_after_current()
            task.scope.deadline = await self.state.drain.wait()
            await task.done.wait()
        await self._close(GOING_AWAY_CLOSE, going_away_reason())

    async def _handle(self, raw: str | None) -> None:
        try:
            message = parse_message(raw, self.state.settings.max_body_bytes)
        except MessageError as error:
            await self._unreadable(error)
            return
        task = self.task
        if message.header.action == "run-task":
            await self._start(message)
        elif task is None or message.task_id != task.id:
            if message.task_id not in self.ended:
                await self._send(failed_event(message.task_id, InvalidInputError("no such task is running", param="task_id")))
        elif message.header.action == "continue-task":
            await self._continue(task, message)
        else:
            await self._finish(task, message)

    async def _unreadable(self, error: MessageError) -> None:
        """A message that cannot be read fails the task it names (or the running one when it names none)."""
        task = self.task
        if task is not None and error.task_id in (None, task.id):
            await self._fail(task, error)
        elif error.task_id not in self.ended:
            await self._send(failed_event(error.task_id or "", error))

    # ---- a task's life --------------------------------------------------------------------------
    async def _start(self, message: Message) -> None:
        if self.task is not None:
            busy = InvalidInputError(f"task {self.task.id} is still running on this connection", param="task_id")
            await self._send(failed_event(message.task_id, busy))
            return
        try:
            await self._admit()
            self.runtime.check_room()  # busy or loading: refused now; a place is taken per sentence (the pipeline)
            task = await self._build(message)
        except TTSError as error:
            self.runtime.observer.request_done(TRANSPORT, PATH, error.code.value, 0.0)
            await self._send(failed_event(message.task_id, error))
            if error.code is ErrorCode.UNAUTHORIZED:
                await self._close(UNAUTHORIZED_CLOSE, close_reason(error))
            return
        self.task = task
        assert self._group is not None
        self._group.start_soon(self._run, task)  # first: it reports the task however it ends
        await self._send(server_event(task.id, "task-started"))  # before any output: the runner waits for text
        if message.payload.input.text:  # some clients send the first text with run-task
            await self._feed(task, message.payload.input.text)

    async def _admit(self) -> None:
        """API key (from the SDK's Authorization header) and the caller's rate limit: one request per task."""
        headers = self.ws.headers
        key = presented_key(headers.get("authorization", ""), headers.get("x-api-key", ""))
        peer = self.ws.client.host if self.ws.client else "unknown"
        hint = "an `Authorization: Bearer <key>` header (dashscope.api_key)"
        caller = Caller(key=key, peer=peer, forwarded_for=headers.get("x-forwarded-for", ""), key_hint=hint)
        await check_gate(self.runtime, caller)  # Redis counters: off the event loop

    async def _build(self, message: Message) -> Task:
        """The task's options, voice and pipeline; the TTSError the client gets when one cannot be served."""
        settings = self.state.settings
        params = message.payload.parameters
        assert params is not None  # parse_message refused a run-task without them
        served = task_model(message.payload.model, self.runtime.models)
        service = served.service
        options = task_options(params)
        template = await anyio.to_thread.run_sync(self._template, served, params.voice, options)
        bitrate = options.bitrate_kbps or settings.audio_bitrate_kbps
        transcoder = Pcm16Transcoder(options.fmt, service.sample_rate, options.sample_rate_hz, bitrate, options.gain)
        delay_s = decoder_delay_s(options.fmt, options.sample_rate_hz)
        sink = TaskSink(self.ws, message.task_id, transcoder, delay_s, self.state)
        pipeline = SpeechPipeline(self.state, service, template, sink, PcmCounter, service.sample_rate)
        segmenter = IncrementalSegmenter(max_chars=settings.max_chars, language=options.language)
        return Task(message.task_id, pipeline, segmenter, sink)

    def _template(self, served: ServedModel, voice: str, options: TaskOptions) -> SpeechRequest:
        """Every sentence's request to `served`: the voice resolved once (a saved voice is read, an instruction encoded
        here: call it in a worker thread), PCM at the model's rate."""
        service = served.service
        reference: VoiceReference = NamedVoice(voice)
        if options.instruction is not None:
            if not served.voices.can_instruct:
                message = "instruction needs a CosyVoice-300M-Instruct or CosyVoice2 model"
                raise UnsupportedCapabilityError(message, param="instruction")
            reference = openai_voice(voice, options.instruction, can_instruct=True)
        return SpeechRequest(
            text="",
            voice=service.resolve_voice(reference),
            fmt=AudioFormat.PCM,
            speed=options.speed,
            seed=options.seed,
            engine_stream=True,
            chunked=True,
            max_chars=self.state.settings.max_chars,
            timestamps=True,  # a sentence-begin/sentence-end pair per synthesized piece
        )

    async def _continue(self, task: Task, message: Message) -> None:
        entered = message.payload.input
        if entered.flush:
            for sentence in task.segmenter.flush():
                await task.pipeline.put(sentence)
        if entered.text:
            await self._feed(task, entered.text)

    async def _feed(self, task: Task, text: str) -> None:
        limit = task.segmenter.max_chars
        try:
            if len(text) > limit:
                raise TextTooLongError(f"text has {len(text)} characters; the limit is {limit} per message", param="text")
            for sentence in task.segmenter.feed(text):
                await task.pipeline.put(sentence)
        except TTSError as error:
            await self._fail(task, error)

    async def _finish(self, task: Task, message: Message) -> None:
        """finish-task: speak what is left, then task-finished; with `directive: cancel` (the SDK's streaming_cancel)
        stop at once, dropping what is not spoken yet, then task-finished."""
        directive = message.payload.input.directive
        if directive == "cancel":
            task.segmenter.discard()
            await task.pipeline.cancel()
        elif directive is not None:
            await self._fail(task, InvalidInputError(f"unknown directive {directive!r}; use cancel", param="directive"))
            return
        for sentence in task.segmenter.flush():
            await task.pipeline.put(sentence)
        task.pipeline.finish()

    async def _fail(self, task: Task, error: TTSError) -> None:
        """End `task` with task-failed (sent by its runner once its pipeline has stopped)."""
        task.error = task.error or error
        task.scope.cancel()
        await task.done.wait()

    async def _run(self, task: Task) -> None:
        """Speak the task until it finishes or fails; then the client is told how it ended."""
        try:
            with task.scope:
                await task.pipeline.run()
                await task.sink.finish()
        except TTSError as error:
            task.error = task.error or error
        finally:
            self.task = None  # before the last event: the client may start its next task as soon as it has it
            self.ended.append(task.id)
            try:
                await self._report(task)
            finally:
                task.done.set()

    async def _report(self, task: Task) -> None:
        status = task.error.code.value if task.error else "ok"
        self.runtime.observer.request_done(TRANSPORT, PATH, status, time.monotonic() - task.started)
        if task.error is not None:
            await self._send(failed_event(task.id, task.error))
        else:
            await self._send(server_event(task.id, "task-finished", {"usage": {"characters": task.sink.characters}}))

    # ---- sending ------------------------------------------------------------------------------
    async def _send(self, body: dict[str, Any]) -> None:
        await self.ws.send_json(body)

    async def _close(self, code: int, reason: str) -> None:
        self.closed = True
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):  # the client is gone already
            await self.ws.close(code, reason)


async def _session(ws: WebSocket) -> None:
    await DashScopeSession(ws, ws.app.state.tts).run()


@router.websocket(PATH, name="dashscope")
async def dashscope(ws: WebSocket) -> None:
    """Alibaba Cloud's CosyVoice WebSocket protocol (run-task / continue-task / finish-task); see docs/dashscope.md."""
    await _session(ws)


@router.websocket(PATH + "/", name="dashscope_slash")
async def dashscope_slash(ws: WebSocket) -> None:
    """The same, for a base URL written with a trailing slash."""
    await _session(ws)
