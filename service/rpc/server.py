"""The official CosyVoice gRPC service (cosyvoice.CosyVoice/Inference) on the shared runtime, with health and reflection."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.access import Caller, presented_key
from service.audio.encode import AudioFormat
from service.errors import InvalidInputError, TTSError, wire_fields
from service.families.model import InstructVoice, NamedVoice, PromptAudio, PromptVoice, VoiceReference
from service.requestids import HEADER, in_own_context, request_id
from service.rpc import cosyvoice_pb2, cosyvoice_pb2_grpc
from service.rpc.errors import GRPC_STATUS
from service.rpc.parsing import MalformedRequest, parse_request
from service.runtime import Runtime
from service.speech.request import SpeechRequest

log = logging.getLogger(__name__)

SERVICE_NAME = cosyvoice_pb2.DESCRIPTOR.services_by_name["CosyVoice"].full_name  # "cosyvoice.CosyVoice"
METHOD = f"/{SERVICE_NAME}/Inference"
PROMPT_RATE_HZ = 16_000  # prompt_audio: raw int16 mono PCM at 16 kHz, as the official client sends it
_KEY_HINT = "`authorization: Bearer <key>` or `x-api-key: <key>` metadata"
MODEL_KEY = "x-model"  # metadata: the served model's id (GET /v1/models); without it the first served model


def metadata_of(context: grpc.ServicerContext) -> dict[str, str]:
    """The call's text metadata, keys lower-cased."""
    return {k.lower(): v for k, v in context.invocation_metadata() if isinstance(v, str)}


def caller_of(context: grpc.ServicerContext) -> Caller:
    """The API key in the call's metadata (Bearer or x-api-key), the peer's address and any x-forwarded-for."""
    meta = metadata_of(context)
    key = presented_key(meta.get("authorization", ""), meta.get("x-api-key", ""))
    return Caller(key=key, peer=_peer_host(context.peer()), forwarded_for=meta.get("x-forwarded-for", ""), key_hint=_KEY_HINT)


def _peer_host(peer: str) -> str:
    """'ipv4:127.0.0.1:5555' / 'ipv6:[::1]:5555' -> the address alone (rate limits count per address)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer or "unknown"


class CosyVoiceServicer(cosyvoice_pb2_grpc.CosyVoiceServicer):
    """Inference: admission (key, rate limit, capacity) as HTTP, the model the `x-model` metadata names (default the
    first served), then one message per audio chunk (int16 PCM)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def Inference(  # the proto's method name
        self, request: cosyvoice_pb2.Request | MalformedRequest, context: grpc.ServicerContext
    ) -> Iterator[cosyvoice_pb2.Response]:
        """The call under its request id (the client's `x-request-id` metadata, or a new one), sent back in the initial
        metadata and named by every log line written for it."""
        rid = request_id(metadata_of(context).get(HEADER))
        context.send_initial_metadata(((HEADER, rid),))
        return in_own_context(rid, self._call(request, context))

    def _call(
        self, request: cosyvoice_pb2.Request | MalformedRequest, context: grpc.ServicerContext
    ) -> Iterator[cosyvoice_pb2.Response]:
        start, status = time.monotonic(), grpc.StatusCode.OK
        try:
            yield from self._inference(request, context)
        except TTSError as error:
            status = GRPC_STATUS[error.code]
            retry = getattr(error, "retry_after_s", None)
            if retry is not None:
                context.set_trailing_metadata((("retry-after", str(retry)),))
            context.abort(status, f"{error.message} (field {error.param})" if error.param else error.message)
        except Exception:
            status = grpc.StatusCode.INTERNAL
            log.exception("gRPC Inference failed")
            context.abort(status, "internal error (see the server log)")
        finally:
            if not context.is_active() and status is grpc.StatusCode.OK:
                status = grpc.StatusCode.CANCELLED
            self.runtime.observer.request_done("grpc", METHOD, status.name, time.monotonic() - start)

    def _inference(
        self, request: cosyvoice_pb2.Request | MalformedRequest, context: grpc.ServicerContext
    ) -> Iterator[cosyvoice_pb2.Response]:
        runtime = self.runtime
        runtime.gate.check(caller_of(context))
        if isinstance(request, MalformedRequest):
            raise request.error
        kind = request.WhichOneof("RequestPayload")
        if kind is None:
            kinds = "sft_request, zero_shot_request, cross_lingual_request, instruct_request"
            raise InvalidInputError(f"the request sets none of {kinds}", param="RequestPayload")
        with wire_fields({"model": MODEL_KEY}):
            served = runtime.model_for(metadata_of(context).get(MODEL_KEY))
        slot = runtime.claim()
        try:
            with wire_fields(fields_of(kind)):
                job = served.service.submit(self._speech(kind, getattr(request, kind)))
            context.add_callback(job.cancel)  # the client cancelled or went away: stop at the next chunk
            for piece in job:
                if piece:  # an encoder's empty flush is no message
                    yield cosyvoice_pb2.Response(tts_audio=piece)
        finally:
            slot.release()

    def _speech(self, kind: str, payload: object) -> SpeechRequest:
        """The request as the service takes it: the voice of its kind, raw PCM at the model's rate, chunk by chunk."""
        return SpeechRequest(
            text=str(getattr(payload, "tts_text")),  # noqa: B009 (a proto field)
            voice=voice_of(kind, payload),
            fmt=AudioFormat.PCM,
            engine_stream=True,  # one message per engine chunk: first audio after the first hop, not the sentence
            chunked=True,
            max_chars=self.runtime.settings.max_chars,
        )


def fields_of(kind: str) -> dict[str, str]:
    """Domain field -> the request's proto field (`<kind>.tts_text`, ...), for errors."""
    names = {"text": "tts_text", "voice": "spk_id", "prompt_audio": "prompt_audio", "prompt_text": "prompt_text"}
    return {domain: f"{kind}.{field}" for domain, field in names.items()} | {"instruction": f"{kind}.instruct_text"}


def voice_of(kind: str, payload: object) -> VoiceReference:
    """The voice a request of `kind` names: a speaker, the prompt recording (raw 16 kHz PCM) with its transcript, or
    an instruction on a speaker."""
    if kind == "sft_request":
        return NamedVoice(str(getattr(payload, "spk_id")))  # noqa: B009 (a proto field)
    if kind == "instruct_request":
        return InstructVoice(str(getattr(payload, "spk_id")), str(getattr(payload, "instruct_text")))  # noqa: B009
    prompt = PromptAudio(bytes(getattr(payload, "prompt_audio")), pcm_rate_hz=PROMPT_RATE_HZ)  # noqa: B009
    label = "zero-shot prompt" if kind == "zero_shot_request" else "cross-lingual prompt"
    return PromptVoice(prompt, str(getattr(payload, "prompt_text", "")), label)


def inference_handler(servicer: CosyVoiceServicer) -> grpc.GenericRpcHandler:
    """The CosyVoice service as the generated stubs would register it, with our request deserializer: a request whose
    strings are not UTF-8 reaches the servicer as a MalformedRequest (INVALID_ARGUMENT), not grpc's INTERNAL."""
    method = grpc.unary_stream_rpc_method_handler(
        servicer.Inference,
        request_deserializer=parse_request,
        response_serializer=cosyvoice_pb2.Response.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {"Inference": method})


class GrpcServer:
    """The gRPC transport of one runtime: CosyVoice, grpc.health.v1 and server reflection on `host:port`.

    Thread model: a pool of `concurrent_requests + queue_max + 4` threads, each iterating one job (the synthesis
    itself runs on the service's workers); admission refuses what the runtime cannot take before it queues.
    Health says NOT_SERVING until `ready()`, and again from `stop_accepting()`.
    """

    def __init__(self, runtime: Runtime, host: str, port: int) -> None:
        s = runtime.settings
        self.runtime = runtime
        self._stopped: threading.Event | None = None  # set once the server has stopped, after `stop_accepting`
        self.health = health.HealthServicer()
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        options = [
            ("grpc.so_reuseport", 0),  # a port already in use is an error, not a second silent listener
            ("grpc.max_receive_message_length", s.max_upload_bytes + 65_536),  # a prompt as large as HTTP allows
        ]
        self.server = grpc.server(futures.ThreadPoolExecutor(s.concurrent_requests + s.queue_max + 4), options=options)
        self.server.add_generic_rpc_handlers((inference_handler(CosyVoiceServicer(runtime)),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError as e:
            raise OSError(f"cannot listen for gRPC on {address} (TTS_GRPC_PORT): {e}") from e

    def start(self) -> None:
        self.server.start()
        log.info("gRPC service %s on port %d", SERVICE_NAME, self.port)

    def ready(self) -> None:
        self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def stop_accepting(self, grace_s: float) -> None:
        """Refuse new calls from now on (health NOT_SERVING); running ones get `grace_s` seconds, then are cancelled.
        Returns at once (the first call counts; later ones change nothing)."""
        if self._stopped is None:
            self.health.enter_graceful_shutdown()
            self._stopped = self.server.stop(grace_s)

    def wait_stopped(self) -> None:
        """Block until the server has stopped (its last call ended or was cancelled at the end of its grace)."""
        if self._stopped is not None:
            self._stopped.wait()

    def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):  # "" = the server as a whole
            self.health.set(name, status)
