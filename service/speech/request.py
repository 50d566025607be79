"""A synthesis request as transports hand it over, the checks its text must pass, and the request once prepared."""

from __future__ import annotations

import codecs
import dataclasses
import unicodedata
from dataclasses import dataclass

from service.audio.encode import DEFAULT_BITRATE_KBPS, AudioFormat
from service.errors import InvalidInputError, TextTooLongError
from service.families.model import InstructVoice, ModelVoice, NamedVoice, VoiceReference
from service.frontend import Sentence

_ALLOWED_CONTROLS = frozenset("\t\n\r")


@dataclass(frozen=True)
class SpeechRequest:
    """One synthesis request, already validated for type and range by the API schema. Errors about it name domain
    fields ("text", "voice", ...): the transport that built it renames them to its own."""

    text: str
    voice: VoiceReference | ModelVoice  # as the client named it, or a voice resolved once for many requests
    fmt: AudioFormat = AudioFormat.WAV
    speed: float = 1.0
    seed: int | None = None
    engine_stream: bool = False  # stream inside a sentence too (first audio after the engine's first hop)
    chunked: bool = False  # deliver the response in pieces (else one complete file)
    pcm_rate_hz: int | None = None  # output rate of raw PCM; None = the model's
    rate_hz: int | None = None  # an output rate the client chose for PCM or MP3 (checked by its transport)
    bitrate_kbps: int = DEFAULT_BITRATE_KBPS  # MP3/Opus/AAC only
    max_chars: int = 4096
    timestamps: bool = False  # a SentenceMark after each sentence's audio (from the cache only for a one-piece text)


@dataclass(frozen=True)
class PreparedSpeech:
    """A request after validation and the text frontend: what the engine will read, and its cache key."""

    request: SpeechRequest
    sentences: tuple[Sentence, ...]
    cache_key: str
    sample_rate_hz: int
    media_type: str
    started: float  # time.monotonic() when the request reached the service
    frontend_s: float
    voice: ModelVoice
    speed: float = 1.0  # the request's speed times the text's SSML <prosody rate>

    @property
    def spoken(self) -> tuple[Sentence, ...]:
        """The sentences the engine speaks (a leading pause alone is not one of them)."""
        return tuple(s for s in self.sentences if s.ids)

    @property
    def input_tokens(self) -> int:
        return sum(len(s.ids) for s in self.sentences)


def key_text(sentence: Sentence) -> str:
    """A sentence's part of the audio cache key; a pause after it changes the key (no pause: the text alone)."""
    return f"{sentence.text}\t{sentence.pause_after_s!r}" if sentence.pause_after_s else sentence.text


def decode_text(raw: bytes, what: str, param: str | None, charset: str = "utf-8") -> str:
    """`raw` decoded as `charset` (strictly); InvalidInputError naming `what`, the first bad byte and its offset
    otherwise. Every transport decodes request text with it: a GBK transcript is refused, never kept as mojibake."""
    try:
        return raw.decode(charset)
    except UnicodeDecodeError as e:
        name = codecs.lookup(charset).name.upper().replace("_", "-")
        bad = f"byte 0x{raw[e.start]:02X} at offset {e.start}"
        raise InvalidInputError(f"{what} is not valid {name} text ({bad}); encode text as UTF-8", param=param) from e


def check_text(text: str, max_chars: int, param: str = "text") -> None:
    """Reject over-long text (TextTooLongError) and characters no text should hold: C0/C1 controls, lone
    surrogates (InvalidInputError). `param` names the field in the error."""
    if len(text) > max_chars:
        raise TextTooLongError(f"text has {len(text)} characters; the limit is {max_chars}", param=param)
    for i, ch in enumerate(text):
        if ch in _ALLOWED_CONTROLS:
            continue
        category = unicodedata.category(ch)
        if category in ("Cc", "Cs"):
            raise InvalidInputError(f"text holds a disallowed character U+{ord(ch):04X} at position {i}", param=param)


MIN_SPEED, MAX_SPEED = 0.25, 4.0  # the widest any transport accepts


def effective_speed(requested: float, sentences: list[Sentence]) -> float:
    """The request's speed times the SSML <prosody rate> of its text (the frontend makes it one rate per text);
    InvalidInputError when the product leaves MIN_SPEED..MAX_SPEED."""
    rate = next((s.rate for s in sentences if s.ids), 1.0)
    speed = requested * rate
    if rate != 1.0 and not MIN_SPEED <= speed <= MAX_SPEED:
        raise InvalidInputError(
            f"speed {requested:g} times the SSML <prosody rate> {rate:g} is {speed:g}; it must be within "
            f"{MIN_SPEED:g}..{MAX_SPEED:g}",
            param="text",
        )
    return speed


def name_of(reference: VoiceReference) -> str | None:
    """The voice name a reference holds (a NamedVoice's, an InstructVoice's base), None for a prompt."""
    if isinstance(reference, NamedVoice):
        return reference.name
    if isinstance(reference, InstructVoice) and isinstance(reference.base, str):
        return reference.base
    return None


def named_as(reference: VoiceReference, name: str) -> VoiceReference:
    """`reference` with its voice name replaced by `name` (what an alias speaks as)."""
    if isinstance(reference, NamedVoice):
        return NamedVoice(name)
    return dataclasses.replace(reference, base=name) if isinstance(reference, InstructVoice) else reference
