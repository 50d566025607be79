"""WebSocket text-in / audio-out: text deltas in (an LLM's reply as it is written), each sentence synthesized as soon
as it is complete, audio frames out with sequence numbers and a timed caption per sentence, `cancel` for barge-in.
Protocol: docs/websocket.md."""

from __future__ import annotations

import contextlib
import json
import logging
import struct
import time
from collections.abc import Mapping
from typing import Literal, TypeVar, get_args

import anyio
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter, ValidationError

from service.access import Caller, presented_key
from service.api.admission import check_gate
from service.api.deps import AppState
from service.api.drain import receive_unless_draining
from service.api.errors import STATUS, field_of
from service.api.pipeline import Caption, SpeechPipeline, SpokenSentence, reraise_first
from service.api.schemas import MAX_SEED
from service.api.tracing import request_id_of
from service.audio.encode import MP3_RATES_HZ, OPUS_SAMPLE_RATE_HZ, AudioFormat, output_sample_rate
from service.audio.timeline import sample_counter
from service.errors import EngineError, InvalidInputError, RequestTimeoutError, ShuttingDownError, TTSError, wire_name
from service.families.model import ModelVoice, NamedVoice
from service.frontend.incremental import IncrementalSegmenter
from service.speech.request import SpeechRequest
from service.speech.service import TTSService

log = logging.getLogger(__name__)
T = TypeVar("T")
router = APIRouter(tags=["streaming"])

PATH = "/v1/audio/speech/stream"
SUBPROTOCOL = "tts.v1"  # browsers: offer it with "api-key.<key>" (they cannot set headers on a WebSocket)
KEY_PROTOCOL_PREFIX = "api-key."
FRAME_HEADER = struct.Struct(">II")  # binary frame: sequence number, sentence index (uint32 big-endian), then audio
CONFIG_TIMEOUT_S = 10.0  # the config message must come this soon after the connection opens
PCM_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
SAMPLE_RATES = {AudioFormat.PCM: PCM_RATES, AudioFormat.MP3: MP3_RATES_HZ, AudioFormat.OPUS: (OPUS_SAMPLE_RATE_HZ,)}
INTERNAL_ERROR_CLOSE = 1011
GOING_AWAY_CLOSE = 1001  # the server is shutting down (RFC 6455): after the sentence being spoken
FIELDS: Mapping[str, str] = {}  # domain field -> this protocol's, for errors: its "text" and "voice" are the domain's


class StreamConfig(BaseModel):
    """The first message: voice, output format and rate, speed, a language hint for sentence ends, an optional seed."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["config"]
    voice: str | None = Field(
        None, description="Built-in speaker, saved voice or OpenAI voice name; default TTS_DEFAULT_SPEAKER."
    )
    format: Literal["pcm", "mp3", "opus"] = "pcm"
    sample_rate: int | None = Field(
        None, description="pcm: 8000, 16000, 22050, 24000, 44100 or 48000; mp3: any MP3 rate; opus: 24000."
    )
    speed: float = Field(1.0, ge=0.5, le=2.0, allow_inf_nan=False)
    language: Literal["auto", "zh", "en", "ja", "ko", "yue"] = "auto"
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    model: str | None = Field(
        None, max_length=256, description="A served model's id (GET /v1/models); default (or an OpenAI name) the first."
    )


def _message_types(model: type[BaseModel]) -> tuple[str, ...]:
    """The `type` values a message model takes (its Literal)."""
    return tuple(str(v) for v in get_args(model.model_fields["type"].annotation))


class TextMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ControlMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["flush", "close", "cancel"]


ClientMessage = TextMessage | ControlMessage
JSON_OBJECT: TypeAdapter[dict[str, JsonValue]] = TypeAdapter(dict[str, JsonValue])
CONFIG_MESSAGES: dict[str, TypeAdapter[StreamConfig]] = {"config": TypeAdapter(StreamConfig)}
CLIENT_MESSAGES: dict[str, TypeAdapter[ClientMessage]] = {
    kind: TypeAdapter(model) for model in (TextMessage, ControlMessage) for kind in _message_types(model)
}


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


def going_away_reason() -> str:
    """The close reason of a session ended by the server's shutdown (with GOING_AWAY_CLOSE)."""
    return close_reason(ShuttingDownError("the server is shutting down; reconnect to continue"))


class SpeechStreamSession:
    """One connection: admission, config, then a reader (text -> sentences) feeding a SpeechPipeline (sentences ->
    jobs, at most two at a time -> frames), which this connection frames as the protocol says (it is the pipeline's sink).

    The connection holds a place of capacity only while its pipeline has a job; one that sends nothing for
    TTS_WS_IDLE_TIMEOUT_S while nothing is being spoken is closed (4408). When the server drains, the session stops
    reading, finishes the sentence being spoken and closes with 1001."""

    def __init__(self, ws: WebSocket, state: AppState) -> None:
        self.ws = ws
        self.state = state
        self.runtime = state.runtime
        self.status = "ok"

    async def run(self) -> None:
        start = time.monotonic()
        offered = self.ws.scope.get("subprotocols", [])
        await self.ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
        try:
            await check_gate(self.runtime, self._caller(offered))  # Redis counters: off the event loop
            self.runtime.check_room()  # busy or loading: refused now; a place is taken per sentence (the pipeline)
            configured = await self._configure()
            if configured is None or not await self._serve(*configured):
                await self._go_away()
        except TTSError as error:
            await self._fail(error)
        except WebSocketDisconnect:
            self.status = "client_closed"
        except Exception:  # a fault of ours: logged, and the client gets 1011 rather than a dropped connection
            log.exception("WebSocket session failed")
            await self._fail(EngineError("internal error (see the server log)"))
        finally:
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

    async def _configure(self) -> tuple[TTSService, StreamConfig, SpeechRequest] | None:
        """Read and check the config message (its `model` chooses the service); answer `ready` with what the audio
        frames will hold. None: the server began to drain first."""
        try:
            raw = await self._receive_text(CONFIG_TIMEOUT_S)
        except TimeoutError:
            raise InvalidInputError(f"no config message within {CONFIG_TIMEOUT_S:g} s", param="config") from None
        if raw is None:
            return None
        config = _parse(raw, CONFIG_MESSAGES)
        served = self.runtime.model_for(config.model)
        service = served.service
        fmt = AudioFormat(config.format)
        if config.sample_rate is not None and config.sample_rate not in SAMPLE_RATES[fmt]:
            rates = ", ".join(map(str, SAMPLE_RATES[fmt]))  # the close reason (123 bytes) names them all
            raise InvalidInputError(f"{fmt.value} sample_rate: {rates}", param="sample_rate")
        s = self.state.settings
        wanted = config.voice or s.default_speaker
        speaker = service.voice_name(wanted)  # an OpenAI name: what it speaks as (named in `ready`)
        # resolved once for every sentence (a saved voice is read here); an error names what the client sent
        voice: ModelVoice = await anyio.to_thread.run_sync(service.resolve_voice, NamedVoice(wanted))
        template = SpeechRequest(
            text="",
            voice=voice,
            fmt=fmt,
            speed=config.speed,
            seed=config.seed,
            engine_stream=True,
            chunked=True,
            rate_hz=config.sample_rate,
            bitrate_kbps=s.audio_bitrate_kbps,
            max_chars=s.max_chars,
            timestamps=True,  # a caption per synthesized piece (sentence_end `captions`)
        )
        rate = output_sample_rate(fmt, service.sample_rate, rate_hz=config.sample_rate)
        ready = {
            "type": "ready",
            "format": fmt.value,
            "sample_rate": rate,
            "voice": speaker,
            "frame_header": "seq:u32be,sentence:u32be",
        }
        limits = {"max_pending_chars": s.max_chars, "model": served.id, "request_id": request_id_of(self.ws.scope)}
        await self.ws.send_json(ready | limits)
        return service, config, template

    async def _receive_text(self, timeout_s: float) -> str | None:
        """The next client message, which must be a text frame; None once the server drains, TimeoutError when none
        came within `timeout_s`, WebSocketDisconnect when the client left."""
        message = await receive_unless_draining(self.ws, self.state.drain, timeout_s)
        if message is None:
            return None
        if message.get("text") is None:
            raise InvalidInputError("messages must be JSON text frames, not binary", param="message")
        return str(message["text"])

    # ---- reading, and framing what the pipeline produces ----------------------------------------
    async def _serve(self, service: TTSService, config: StreamConfig, template: SpeechRequest) -> bool:
        """Speak what the client sends until `close` (then `done` and 1000: True); False when the server drains."""
        rate = output_sample_rate(template.fmt, service.sample_rate, rate_hz=template.rate_hz)
        pipeline = SpeechPipeline(self.state, service, template, self, lambda: sample_counter(template.fmt, rate), rate)
        segmenter = IncrementalSegmenter(max_chars=template.max_chars, language=config.language)
        drain, drained = self.state.drain, False
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_run_then_cancel, pipeline, group.cancel_scope)
                with drain.until_begun():
                    await self._read(segmenter, pipeline)  # returns after `close`; raises on disconnect or bad input
                deadline = await drain.wait()  # the rest is spoken meanwhile (then the group is cancelled), or:
                drained = True
                pipeline.stop_after_current()  # the sentence being spoken is finished by the deadline, the rest dropped
                group.cancel_scope.deadline = deadline
        except BaseExceptionGroup as group_error:
            reraise_first(group_error)
        if drained:
            return False
        await self.ws.send_json({"type": "done", "sentences": pipeline.sentences_done, "frames": pipeline.seq})
        await self.ws.close(1000)
        return True

    async def _read(self, segmenter: IncrementalSegmenter, pipeline: SpeechPipeline) -> None:
        """Client messages -> complete sentences, until `close` or a drain. Blocks (stops reading) while the queued
        sentences hold `max_chars` characters; a `cancel` is acted on before the next message is read."""
        idle_s = self.state.settings.ws_idle_timeout_s
        while True:
            try:
                raw = await self._receive_text(idle_s)
            except TimeoutError:
                if not pipeline.idle:
                    continue  # the client waits for speech: not idle
                raise RequestTimeoutError(f"no message for {idle_s:g} s (TTS_WS_IDLE_TIMEOUT_S)", param="message") from None
            if raw is None:
                return
            message = _parse(raw, CLIENT_MESSAGES)
            if isinstance(message, ControlMessage) and message.type == "cancel":
                await self._cancel(segmenter, pipeline)
                continue
            ready = segmenter.feed(message.text) if isinstance(message, TextMessage) else segmenter.flush()
            for sentence in ready:
                await pipeline.put(sentence)
            if isinstance(message, ControlMessage) and message.type == "close":
                pipeline.finish()
                return

    async def _cancel(self, segmenter: IncrementalSegmenter, pipeline: SpeechPipeline) -> None:
        """Barge-in: drop the text without an end, the queued sentences and the sentence being spoken, then say where
        the audio stopped. The connection takes new text at once."""
        cut = pipeline.speaking
        segmenter.discard()
        await pipeline.cancel()
        await self.ws.send_json({"type": "cancelled", "last_seq": pipeline.seq - 1, "sentence": cut, "time": pipeline.time_s})

    async def begin(self, index: int, text: str, start_s: float, pieces: tuple[str, ...]) -> None:
        """Nothing is sent before a sentence's audio in this protocol."""

    async def audio(self, index: int, seq: int, piece: bytes) -> None:
        await self.ws.send_bytes(FRAME_HEADER.pack(seq, index) + piece)

    async def caption(self, index: int, number: int, caption: Caption) -> None:
        """A sentence's captions go out with its sentence_end."""

    async def end(self, sentence: SpokenSentence) -> None:
        s = sentence
        caption = {"type": "sentence_end", "sentence": s.index, "text": s.text, "first_seq": s.first_seq}
        timing = {"last_seq": s.last_seq, "audio_bytes": s.audio_bytes, "start": s.start_s, "end": s.end_s}
        captions = [{"text": c.text, "start": c.start_s, "end": c.end_s} for c in s.captions]
        await self.ws.send_json(caption | timing | {"spoken": s.spoken, "captions": captions})

    async def _go_away(self) -> None:
        """The server drains: close with 1001 and a JSON reason (after the sentence being spoken, if any)."""
        self.status = ShuttingDownError.code.value
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):  # the client is gone already
            await self.ws.close(GOING_AWAY_CLOSE, going_away_reason())

    async def _fail(self, error: TTSError) -> None:
        self.status = error.code.value
        error.param = wire_name(FIELDS, error.param)
        body = {"type": "error", "error": {"code": error.code.value, "message": error.message, "param": error.param}}
        try:
            await self.ws.send_json(body)
            await self.ws.close(close_code(error), close_reason(error))
        except (WebSocketDisconnect, RuntimeError):
            pass  # the client is gone already


async def _run_then_cancel(pipeline: SpeechPipeline, scope: anyio.CancelScope) -> None:
    """Speak until the pipeline ends, then cancel `scope` (the session's reader and drain watch have nothing left)."""
    await pipeline.run()
    scope.cancel()


def _parse(raw: str, adapters: Mapping[str, TypeAdapter[T]]) -> T:
    """A client message: a JSON object whose `type` picks the model; InvalidInputError naming what is wrong, in the
    protocol's terms (a field of that message, never the name of a model class)."""
    try:
        document = JSON_OBJECT.validate_json(raw)
    except ValidationError as e:
        first = e.errors()[0]
        reason = f"the message is not valid JSON: {first['msg']}" if first["type"] == "json_invalid" else ""
        raise InvalidInputError(reason or "the message must be a JSON object", param="message") from e
    kind = document.get("type")
    adapter = adapters.get(kind) if isinstance(kind, str) else None
    if adapter is None:
        given = f"unknown message type {kind!r}" if kind is not None else 'the message has no "type"'
        raise InvalidInputError(f"{given}; this message must be one of: {', '.join(adapters)}", param="type")
    try:
        return adapter.validate_python(document)
    except ValidationError as e:
        first = e.errors()[0]
        where = field_of(first["loc"]) or "message"
        raise InvalidInputError(f"invalid {kind} message: {where}: {first['msg']}", param=where) from e


@router.websocket(PATH, name="speech_stream")
async def speech_stream(ws: WebSocket) -> None:
    """Text deltas in, audio out (see docs/websocket.md)."""
    await SpeechStreamSession(ws, ws.app.state.tts).run()
