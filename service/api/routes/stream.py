"""WebSocket text-in / audio-out: text deltas in (an LLM's reply as it is written), each sentence synthesized as soon
as it is complete, audio frames out with sequence numbers and a caption per sentence. Protocol: docs/websocket.md."""

from __future__ import annotations

import json
import logging
import struct
import time
from contextlib import aclosing
from dataclasses import replace
from typing import Literal, NoReturn, TypeVar

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from service.access import Caller, presented_key
from service.api.admission import check_gate
from service.api.deps import AppState
from service.api.errors import STATUS
from service.api.schemas import MAX_SEED
from service.api.streaming import JobPieces
from service.audio import AudioFormat, output_sample_rate
from service.engine.voice import Voice
from service.errors import EmptyTextError, EngineError, InvalidInputError, OverloadedError, TTSError
from service.frontend.incremental import IncrementalSegmenter
from service.runtime import Slot
from service.tts import SpeechJob, SpeechRequest, TTSService

log = logging.getLogger(__name__)
T = TypeVar("T")
router = APIRouter(tags=["streaming"])

PATH = "/v1/audio/speech/stream"
SUBPROTOCOL = "tts.v1"  # browsers: offer it with "api-key.<key>" (they cannot set headers on a WebSocket)
KEY_PROTOCOL_PREFIX = "api-key."
FRAME_HEADER = struct.Struct(">II")  # binary frame: sequence number, sentence index (uint32 big-endian), then audio
CONFIG_TIMEOUT_S = 10.0  # the config message must come this soon after the connection opens
QUEUED_SENTENCES = 8  # sentences waiting for synthesis; more and the server stops reading the client's text
OVERLOADED_WAIT_S = 30.0  # a sentence the service cannot take yet is retried this long before the session fails
PCM_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
INTERNAL_ERROR_CLOSE = 1011


class StreamConfig(BaseModel):
    """The first message: voice, output format and rate, speed, a language hint for sentence ends, an optional seed."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["config"]
    voice: str | None = Field(
        None, description="Built-in speaker, saved voice or OpenAI voice name; default TTS_DEFAULT_SPEAKER."
    )
    format: Literal["pcm", "mp3", "opus"] = "pcm"
    sample_rate: int | None = Field(None, description="pcm only: one of 8000, 16000, 22050, 24000, 44100, 48000.")
    speed: float = Field(1.0, ge=0.5, le=2.0)
    language: Literal["auto", "zh", "en", "ja", "ko", "yue"] = "auto"
    seed: int | None = Field(None, ge=0, le=MAX_SEED)


class TextMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ControlMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["flush", "close"]


CONFIG_MESSAGE: TypeAdapter[StreamConfig] = TypeAdapter(StreamConfig)
CLIENT_MESSAGE: TypeAdapter[TextMessage | ControlMessage] = TypeAdapter(TextMessage | ControlMessage)


def close_code(error: TTSError) -> int:
    """4000 + the HTTP status of the error's code (4400, 4401, 4413, 4429, 4503 ...); 1011 for server faults."""
    status = STATUS[error.code][0]
    return 4000 + status if status < 500 or status == 503 else INTERNAL_ERROR_CLOSE


def close_reason(error: TTSError) -> str:
    """A JSON reason that fits a close frame (123 bytes): the code and as much of the message as fits."""
    message = error.message
    while True:
        reason = json.dumps({"code": error.code.value, "message": message}, ensure_ascii=False)
        if len(reason.encode("utf-8")) <= 123 or not message:
            return reason
        message = message[: max(0, len(message) - 8)] + "…" if len(message) > 8 else ""


class SpeechStreamSession:
    """One connection: admission, config, then a reader (text -> sentences), a submitter (sentences -> jobs, at
    most two ahead of the audio being sent) and a sender (jobs -> frames), joined by bounded streams."""

    def __init__(self, ws: WebSocket, state: AppState) -> None:
        self.ws = ws
        self.state = state
        self.runtime = state.runtime
        self.seq = 0  # audio frames sent
        self.sentences_done = 0
        self.status = "ok"

    async def run(self) -> None:
        start = time.monotonic()
        offered = self.ws.scope.get("subprotocols", [])
        await self.ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
        slot: Slot | None = None
        try:
            await check_gate(self.runtime, self._caller(offered))  # Redis counters: off the event loop
            slot = self.runtime.claim()
            service = self.runtime.service
            config, template = await self._configure(service)
            await self._serve(service, config, template)
        except TTSError as error:
            await self._fail(error)
        except WebSocketDisconnect:
            self.status = "client_closed"
        except Exception:  # a fault of ours: logged, and the client gets 1011 rather than a dropped connection
            log.exception("WebSocket session failed")
            await self._fail(EngineError("internal error (see the server log)"))
        finally:
            if slot is not None:
                slot.release()
            self.runtime.observer.request_done("websocket", PATH, self.status, time.monotonic() - start)

    # ---- setup -------------------------------------------------------------------------------
    def _caller(self, offered: list[str]) -> Caller:
        """The key from `Authorization: Bearer`, `X-API-Key`, or a subprotocol `api-key.<key>` (browsers)."""
        headers = self.ws.headers
        key = presented_key(headers.get("authorization", ""), headers.get("x-api-key", ""))
        key = key or next((p[len(KEY_PROTOCOL_PREFIX) :] for p in offered if p.startswith(KEY_PROTOCOL_PREFIX)), None)
        peer = self.ws.client.host if self.ws.client else "unknown"
        hint = "an `Authorization: Bearer <key>` header, `X-API-Key`, or the subprotocol `api-key.<key>`"
        return Caller(key=key, peer=peer, forwarded_for=headers.get("x-forwarded-for", ""), key_hint=hint)

    async def _configure(self, service: TTSService) -> tuple[StreamConfig, SpeechRequest]:
        """Read and check the config message; answer `ready` with what the audio frames will hold."""
        with anyio.move_on_after(CONFIG_TIMEOUT_S) as scope:
            raw = await self._receive_text()
        if scope.cancelled_caught:
            raise InvalidInputError(f"no config message within {CONFIG_TIMEOUT_S:g} s", param="config")
        config = _parse(raw, CONFIG_MESSAGE)
        fmt = AudioFormat(config.format)
        if config.sample_rate is not None and (fmt is not AudioFormat.PCM or config.sample_rate not in PCM_RATES):
            rates = ", ".join(map(str, PCM_RATES))
            raise InvalidInputError(f"sample_rate applies to pcm only, one of {rates}", param="sample_rate")
        s = self.state.settings
        wanted = config.voice or s.default_speaker
        speaker = service.voice_name(wanted)  # an OpenAI name: what it speaks as (named in `ready`)
        probe = SpeechRequest(text="", speaker=wanted, speaker_param="voice")  # an error names what the client sent
        voice: Voice = await anyio.to_thread.run_sync(service.resolve_voice, probe)  # saved voices: resolved once
        template = SpeechRequest(
            text="",
            speaker=speaker,
            voice=voice,
            fmt=fmt,
            speed=config.speed,
            seed=config.seed,
            engine_stream=True,
            chunked=True,
            pcm_rate_hz=config.sample_rate,
            bitrate_kbps=s.audio_bitrate_kbps,
            max_chars=s.max_chars,
            text_param="text",
            speaker_param="voice",
        )
        rate = output_sample_rate(fmt, service.sample_rate, config.sample_rate)
        ready = {
            "type": "ready",
            "format": fmt.value,
            "sample_rate": rate,
            "voice": speaker,
            "frame_header": "seq:u32be,sentence:u32be",
        }
        await self.ws.send_json(ready | {"max_pending_chars": s.max_chars, "model": self.runtime.model_id})
        return config, template

    async def _receive_text(self) -> str:
        """The next client message, which must be a text frame (WebSocketDisconnect when the client left)."""
        message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        if message.get("text") is None:
            raise InvalidInputError("messages must be JSON text frames, not binary", param="message")
        return str(message["text"])

    # ---- the three stages ----------------------------------------------------------------------
    async def _serve(self, service: TTSService, config: StreamConfig, template: SpeechRequest) -> None:
        sentences_in, sentences_out = anyio.create_memory_object_stream[tuple[int, str]](QUEUED_SENTENCES)
        jobs_in, jobs_out = anyio.create_memory_object_stream[tuple[int, str, SpeechJob | None]](0)
        segmenter = IncrementalSegmenter(max_chars=template.max_chars, language=config.language)
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._submit, service, template, sentences_out, jobs_in)
                group.start_soon(self._send, jobs_out)
                await self._read(segmenter, sentences_in)  # returns after `close`; raises on disconnect or bad input
        except BaseExceptionGroup as group_error:
            _reraise_first(group_error)
        await self.ws.send_json({"type": "done", "sentences": self.sentences_done, "frames": self.seq})
        await self.ws.close(1000)

    async def _read(self, segmenter: IncrementalSegmenter, out: ObjectSendStream[tuple[int, str]]) -> None:
        """Client messages -> complete sentences. Blocks (stops reading) while QUEUED_SENTENCES wait."""
        index = 0
        async with out:
            while True:
                message = _parse(await self._receive_text(), CLIENT_MESSAGE)
                ready = segmenter.feed(message.text) if isinstance(message, TextMessage) else segmenter.flush()
                for sentence in ready:
                    await out.send((index, sentence))
                    index += 1
                if isinstance(message, ControlMessage) and message.type == "close":
                    return

    async def _submit(
        self,
        service: TTSService,
        template: SpeechRequest,
        sentences: ObjectReceiveStream[tuple[int, str]],
        jobs: ObjectSendStream[tuple[int, str, SpeechJob | None]],
    ) -> None:
        """Sentences -> running jobs, one ahead of the sender: sentence 2 synthesizes while sentence 1 is sent."""
        async with sentences, jobs:
            async for index, text in sentences:
                job = await self._start(service, replace(template, text=text))
                try:
                    await jobs.send((index, text, job))
                except BaseException:
                    if job is not None:
                        job.cancel()
                    raise

    async def _start(self, service: TTSService, request: SpeechRequest) -> SpeechJob | None:
        """Submit one sentence; None when it has nothing to speak (e.g. only an emoji). While the service is full,
        retry for up to OVERLOADED_WAIT_S: the connection holds its place and must not lose a sentence."""
        deadline = time.monotonic() + OVERLOADED_WAIT_S
        while True:
            try:
                return await anyio.to_thread.run_sync(service.submit, request)
            except EmptyTextError:
                return None
            except OverloadedError:
                if time.monotonic() > deadline:
                    raise
                await anyio.sleep(0.05)

    async def _send(self, jobs: ObjectReceiveStream[tuple[int, str, SpeechJob | None]]) -> None:
        """Jobs -> binary frames (header + audio) and one `sentence_end` per sentence, in order."""
        async with jobs:
            async for index, text, job in jobs:
                first_seq, audio_bytes = self.seq, 0
                if job is not None:
                    audio_bytes = await self._send_audio(index, job)
                end = {"type": "sentence_end", "sentence": index, "text": text, "first_seq": first_seq}
                await self.ws.send_json(end | {"last_seq": self.seq - 1, "audio_bytes": audio_bytes, "spoken": job is not None})
                self.sentences_done += 1

    async def _send_audio(self, index: int, job: SpeechJob) -> int:
        """The job's audio as numbered frames; leaving early (disconnect, failure) cancels its synthesis."""
        pieces, sent = JobPieces(job, self.state), 0
        await pieces.start()
        async with aclosing(pieces.stream()) as audio:
            async for piece in audio:
                if piece:
                    await self.ws.send_bytes(FRAME_HEADER.pack(self.seq, index) + piece)
                    self.seq += 1
                    sent += len(piece)
        return sent

    async def _fail(self, error: TTSError) -> None:
        self.status = error.code.value
        body = {"type": "error", "error": {"code": error.code.value, "message": error.message, "param": error.param}}
        try:
            await self.ws.send_json(body)
            await self.ws.close(close_code(error), close_reason(error))
        except (WebSocketDisconnect, RuntimeError):
            pass  # the client is gone already


def _reraise_first(group_error: BaseExceptionGroup[BaseException]) -> NoReturn:
    """The error that ended a session's task group: ours (TTSError) or the client leaving, before anything else."""
    for kind in (TTSError, WebSocketDisconnect):
        match = group_error.subgroup(lambda e, kind=kind: isinstance(e, kind))  # type: ignore[misc]
        if match is not None:
            first: BaseException = match.exceptions[0]
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first
    raise group_error


def _parse(raw: str, adapter: TypeAdapter[T]) -> T:
    """A client message read by `adapter`; InvalidInputError naming what is wrong."""
    try:
        return adapter.validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "message"
        raise InvalidInputError(f"invalid message: {where}: {first['msg']}", param=where) from e


@router.websocket(PATH, name="speech_stream")
async def speech_stream(ws: WebSocket) -> None:
    """Text deltas in, audio out (see docs/websocket.md)."""
    await SpeechStreamSession(ws, ws.app.state.tts).run()
