"""Turning a SpeechJob into HTTP: whole-file and chunked responses, SSE events, and stop-on-disconnect."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import aclosing
from typing import TypeVar

import anyio
from fastapi.responses import Response, StreamingResponse
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from service.api.deps import AppState
from service.errors import TTSError
from service.speech.job import SentenceMark, SpeechJob

log = logging.getLogger(__name__)

SSE_MEDIA_TYPE = "text/event-stream"
DISCONNECT_POLL_S = 0.1  # how often a request still waiting for its first audio checks that its client is there
T = TypeVar("T")


Item = bytes | SentenceMark


def _next_piece(pieces: Iterator[Item]) -> Item | None:
    return next(pieces, None)


class JobPieces:
    """Reads a job's pieces in worker threads; the first piece is fetched before the response starts,
    so an error raised before any audio becomes a normal JSON error response."""

    def __init__(self, job: SpeechJob, state: AppState) -> None:
        self.job = job
        self._state = state
        self._it = job.events()
        self._first: Item | None = None

    async def start(self) -> None:
        """Wait for the first piece (raises the job's TTSError if it fails before producing audio). Leaving the wait
        early (the caller cancelled: a WebSocket whose client left before the first audio) cancels the synthesis."""
        try:
            self._first = await self._read()
        except BaseException:
            self.job.cancel()
            raise

    async def stream(self) -> AsyncGenerator[bytes, None]:
        """Yield every piece of audio; leaving early (disconnect, send error) cancels the synthesis."""
        async with aclosing(self.events()) as items:
            async for item in items:
                if isinstance(item, bytes):
                    yield item

    async def events(self) -> AsyncGenerator[Item, None]:
        """Yield every piece, and a SentenceMark after each sentence when the request asked for timestamps;
        leaving early cancels the synthesis."""
        metrics = self._state.metrics
        metrics.active_streams.inc()
        finished = False
        try:
            piece = self._first
            while piece is not None:
                yield piece
                piece = await self._read()
            finished = True
        finally:
            if not finished:
                self.job.cancel()  # the client left (or sending failed): stop the synthesis
            metrics.active_streams.dec()

    async def _read(self) -> Item | None:
        return await anyio.to_thread.run_sync(_next_piece, self._it, abandon_on_cancel=True, limiter=self._state.stream_threads)


class JobStreamingResponse(StreamingResponse):
    """A chunked response that notices a disconnect even while the next chunk is still being computed.

    Starlette skips disconnect listening for ASGI >= 2.4 servers and only notices on the next send;
    here the listener always runs, so the synthesis is cancelled as soon as the client goes away.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away while we were sending
                except TTSError as e:
                    # Too late for an error status: end without the closing chunk, so the client sees
                    # a truncated response instead of a complete-looking short file.
                    log.error("stream aborted after %s started: %s", self.media_type, e.message)
                finally:
                    group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()
        close = getattr(self.body_iterator, "aclose", None)
        if close is not None:
            await close()


async def whole_response(request: Request, job: SpeechJob, state: AppState, headers: Mapping[str, str]) -> Response:
    """Wait for the complete file (in a worker thread) and send it with Content-Length and Server-Timing."""
    limiter = state.stream_threads
    body = await _watching(request, job, lambda: anyio.to_thread.run_sync(job.read_all, abandon_on_cancel=True, limiter=limiter))
    timing = {"Server-Timing": job.timings.server_timing()} if not job.cache_hit else {}
    return Response(body, media_type=job.prepared.media_type, headers={**headers, **timing})


async def chunked_response(request: Request, job: SpeechJob, state: AppState, headers: Mapping[str, str]) -> Response:
    """Stream the pieces as they are produced; the first byte leaves with the first audio chunk."""
    pieces = JobPieces(job, state)
    await _watching(request, job, pieces.start)
    return JobStreamingResponse(pieces.stream(), media_type=job.prepared.media_type, headers={**headers, **STREAM_HEADERS})


async def sse_response(
    request: Request, job: SpeechJob, state: AppState, headers: Mapping[str, str], token_rate_hz: int
) -> Response:
    """OpenAI `stream_format=sse`: speech.audio.delta events (base64 audio), then speech.audio.done with usage (speech
    tokens at the model's `token_rate_hz`)."""
    pieces = JobPieces(job, state)
    await _watching(request, job, pieces.start)
    events = _sse_events(pieces, token_rate_hz)
    return JobStreamingResponse(events, media_type=SSE_MEDIA_TYPE, headers={**headers, **STREAM_HEADERS})


STREAM_HEADERS = {"X-Accel-Buffering": "no", "Cache-Control": "no-store"}


async def _sse_events(pieces: JobPieces, token_rate_hz: int) -> AsyncIterator[bytes]:
    async with aclosing(pieces.events()) as items:
        async for item in items:
            if isinstance(item, SentenceMark):
                yield _event(_sentence_event(item))
            else:
                yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(item).decode("ascii")})
    prepared, timings = pieces.job.prepared, pieces.job.timings
    # speech tokens come at a fixed rate (50 Hz for v1), so audio seconds x speed give the token count
    output_tokens = round(timings.audio_s * prepared.speed * token_rate_hz)
    usage = {"input_tokens": prepared.input_tokens, "output_tokens": output_tokens}
    yield _event({"type": "speech.audio.done", "usage": {**usage, "total_tokens": sum(usage.values())}})


async def _watching(request: Request, job: SpeechJob, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work` (waiting for the job) while watching the connection: a disconnect cancels the job.
    Any failure or cancellation of the wait cancels the job too, so no synthesis outlives its request."""
    done: list[T] = []
    failed: list[Exception] = []
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(_cancel_on_disconnect, request, job)
            try:
                done.append(await work())
            except Exception as e:  # re-raised below, outside the task group (which would wrap it in a group)
                failed.append(e)
            finally:
                group.cancel_scope.cancel()
    finally:
        if not done:
            job.cancel()
    if failed:
        raise failed[0]
    return done[0]


async def _cancel_on_disconnect(request: Request, job: SpeechJob) -> None:
    while not await request.is_disconnected():
        await anyio.sleep(DISCONNECT_POLL_S)
    job.cancel()


def _sentence_event(mark: SentenceMark) -> dict[str, object]:
    """`speech.audio.sentence` (our extension, with `timestamps: true`): a caption with its place in the audio."""
    return {"type": "speech.audio.sentence", "sentence": mark.index, "text": mark.text, "start": mark.start_s, "end": mark.end_s}


def _event(payload: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode("utf-8") + b"\n\n"
