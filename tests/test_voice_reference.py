"""One voice reference: transports hand down a name, a prompt or an instruction; errors name domain fields, which each
transport renames to its own once (service.errors.wire_fields)."""

from __future__ import annotations

import dataclasses

import pytest
from test_tts_pauses import OnesEngine, ScriptedFrontend

from service.errors import InvalidInputError, TTSError, UnknownSpeakerError, wire_fields, wire_name
from service.families.model import InstructVoice, ModelVoice, NamedVoice, PromptAudio, PromptVoice, VoiceReference
from service.rpc import cosyvoice_pb2
from service.rpc.server import fields_of, voice_of
from service.speech.request import SpeechRequest
from service.speech.service import TTSService
from service.stores.audio_cache import MemoryAudioCache


@dataclasses.dataclass(frozen=True)
class _Voice:
    name: str
    fingerprint: str = "f"


def test_no_field_name_travels_with_a_request() -> None:
    """Field names for errors were `text_param` / `speaker_param` on every request; they stay in the transports."""
    assert [f.name for f in dataclasses.fields(SpeechRequest) if f.name.endswith("_param")] == []


def test_wire_fields_rename_domain_fields_only() -> None:
    names = {"text": "tts_text", "voice": "spk_id"}
    with pytest.raises(TTSError) as caught, wire_fields(names):
        raise InvalidInputError("bad", param="text")
    assert caught.value.param == "tts_text"
    with pytest.raises(TTSError) as caught, wire_fields(names):
        raise InvalidInputError("bad", param="format")
    assert caught.value.param == "format"
    assert wire_name(names, None) is None


def _service(resolved: list[VoiceReference], aliases: dict[str, str]) -> TTSService:
    def resolve(reference: VoiceReference) -> ModelVoice:
        resolved.append(reference)
        if isinstance(reference, NamedVoice | InstructVoice) and "nobody" in str(reference):
            raise UnknownSpeakerError("unknown speaker", param="voice")
        return _Voice(str(reference))

    return TTSService(ScriptedFrontend([]), OnesEngine(), MemoryAudioCache(0), bundle_sha256="0" * 64, voices=resolve,
                      aliases=aliases)  # fmt: skip


def test_an_alias_is_followed_for_a_name_and_an_instruction_base() -> None:
    resolved: list[VoiceReference] = []
    service = _service(resolved, {"alloy": "中文女"})
    try:
        service.resolve_voice(NamedVoice("alloy"))
        service.resolve_voice(InstructVoice("Alloy", "calm<|endofprompt|>"))
        prompt = PromptVoice(PromptAudio(b"x"), "hi")
        service.resolve_voice(prompt)
    finally:
        service.close()
    assert resolved == [NamedVoice("中文女"), InstructVoice("中文女", "calm<|endofprompt|>"), prompt]


def test_an_alias_to_nothing_says_what_it_speaks_as() -> None:
    service = _service([], {"alloy": "nobody"})
    try:
        with pytest.raises(UnknownSpeakerError) as caught:
            service.resolve_voice(InstructVoice("alloy", "calm"))
    finally:
        service.close()
    assert caught.value.message.startswith("the voice 'alloy' speaks as 'nobody' (TTS_VOICE_ALIASES)")
    assert caught.value.param == "voice"


def test_a_resolved_voice_passes_as_it_is() -> None:
    service = _service([], {})
    try:
        voice = _Voice("ready")
        assert service.resolve_voice(voice) is voice
    finally:
        service.close()


def test_grpc_builds_a_reference_per_kind_and_names_its_proto_fields() -> None:
    sft = cosyvoice_pb2.sftRequest(spk_id="中文女", tts_text="你好。")
    instruct = cosyvoice_pb2.instructRequest(spk_id="中文男", tts_text="你好。", instruct_text="calm")
    zero_shot = cosyvoice_pb2.zeroshotRequest(tts_text="你好。", prompt_text="hi", prompt_audio=b"\0\0")
    assert voice_of("sft_request", sft) == NamedVoice("中文女")
    assert voice_of("instruct_request", instruct) == InstructVoice("中文男", "calm")
    prompted = voice_of("zero_shot_request", zero_shot)
    assert isinstance(prompted, PromptVoice) and prompted.transcript == "hi" and prompted.prompt.pcm_rate_hz == 16_000
    names = fields_of("zero_shot_request")
    assert (names["text"], names["prompt_text"], names["prompt_audio"]) == (
        "zero_shot_request.tts_text", "zero_shot_request.prompt_text", "zero_shot_request.prompt_audio",
    )  # fmt: skip
