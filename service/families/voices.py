"""What every family's voice library shares: prompt recordings decoded and analysed once (cached by their hash),
saved voices by name, transcripts checked against the recording; a family supplies its analysis and voice type."""

from __future__ import annotations

import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import numpy as np

from service.audio.decode import container_format, decode_audio, pcm16_to_float
from service.bundle import GROUP_PROMPT, ModelBundle
from service.errors import (
    InvalidInputError,
    NotFoundError,
    PromptAudioError,
    UnknownSpeakerError,
    UnsupportedCapabilityError,
    VoiceExistsError,
)
from service.families.model import InstructVoice, ModelVoice, NamedVoice, PromptAudio, PromptVoice, VoiceReference
from service.frontend import TextFrontend
from service.layers.prompt import MAX_PROMPT_S
from service.stores.analysis_cache import AnalysisCache
from service.stores.voices import (
    MAX_NAME_CHARS,
    NAME_RULE,
    PromptFeatures,
    SavedVoice,
    VoiceStore,
    check_voice_name,
    is_voice_name,
)

log = logging.getLogger(__name__)

# A transcript the prompt could not hold: more text tokens than fast speech has in that time (Chinese runs
# ~5 characters ~ 5-8 tokens per second, English ~3 words ~ 4 tokens per second, in either family's BPE).
MAX_TRANSCRIPT_TOKENS_PER_S = 15.0
TRANSCRIPT_TOKEN_SLACK = 10
MAX_INSTRUCT_CHARS = 500

V = TypeVar("V", bound=ModelVoice)


class PromptVoices(ABC, Generic[V]):
    """Prompt analysis and saved voices for one loaded bundle; thread-safe (stores and caches lock themselves).

    A family implements `_features` (a decoded recording -> what its model is conditioned on), `_voice` (features
    and transcript ids -> its voice type) and `instruct_voice`; `variant` names what its analysis computes (part
    of the analysis cache key and of every saved voice).
    """

    def __init__(
        self,
        bundle: ModelBundle,
        frontend: TextFrontend,
        builtin: tuple[str, ...],
        store: VoiceStore,
        cache: AnalysisCache,
        *,
        can_analyze: bool,
        variant: str,
        max_voices: int = 100,
        reserved_names: tuple[str, ...] = (),
    ) -> None:
        self.bundle = bundle
        self.frontend = frontend
        self.builtin = builtin
        self.store = store
        self.cache = cache
        self.variant = variant
        self.max_voices = max_voices
        self.reserved = frozenset((*builtin, *reserved_names))
        self.models = models_fingerprint(bundle)
        self._can_analyze = can_analyze

    @property
    def can_clone(self) -> bool:
        return self._can_analyze

    @property
    @abstractmethod
    def can_instruct(self) -> bool: ...

    @abstractmethod
    def _features(self, audio: np.ndarray, sample_rate: int) -> PromptFeatures:
        """The family's analysis of a decoded mono recording (PromptAudioError for one it refuses)."""

    @abstractmethod
    def _voice(self, name: str, features: PromptFeatures, transcript_ids: tuple[int, ...]) -> V:
        """A cloned voice: zero-shot with the transcript's ids, cross-lingual without."""

    @abstractmethod
    def instruct_voice(self, base: ModelVoice, instruct_text: str) -> V:
        """`base` speaking as `instruct_text` says (UnsupportedCapabilityError on a model without instructions)."""

    # ---- analysis ---------------------------------------------------------------------------
    def analyze(self, prompt: PromptAudio) -> PromptFeatures:
        """Decode and analyse a prompt (1-30 s), or take the cached analysis of the same bytes."""
        self._need_analysis()
        pcm_rate_hz = self._raw_pcm_rate(prompt)
        key = f"{prompt.sha256}:{self.models}:{self.variant}:{pcm_rate_hz or 'file'}"
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        try:
            if pcm_rate_hz is not None:
                audio, rate = pcm16_to_float(prompt.data, sample_rate=pcm_rate_hz, max_seconds=MAX_PROMPT_S)
            else:
                audio, rate = decode_audio(prompt.data, max_seconds=MAX_PROMPT_S)
            features = self._features(audio, rate)
        except PromptAudioError as e:
            e.param = "prompt_audio"  # the domain's name; each transport renames it to its own field
            raise
        self.cache.put(key, features)
        return features

    @staticmethod
    def _raw_pcm_rate(prompt: PromptAudio) -> int | None:
        """The rate to read a raw-PCM field at, or None to decode it as a file: a whole file sent where raw PCM is
        expected (a WAV or MP3 as gRPC prompt_audio, a common mistake) would be cloned from its header bytes and at
        the wrong rate, so it is recognised by its first bytes and decoded as the file it is."""
        if prompt.pcm_rate_hz is None:
            return None
        found = container_format(prompt.data)
        if found is not None:
            log.info("the prompt recording holds a %s file, not raw PCM: decoding it as a file", found)
            return None
        return prompt.pcm_rate_hz

    def voice_for(self, reference: VoiceReference, speakers: Sequence[str], speaker: Callable[[str], V]) -> V:
        """A family's Model.resolve: a built-in speaker (`speaker(name)` for a name in `speakers`) or saved voice by
        name, a one-off prompt (zero-shot with a transcript, cross-lingual without), or either styled by an
        instruction. Reads the store and may analyse a recording: blocking."""
        if isinstance(reference, PromptVoice):
            return self.prompt_voice(reference.prompt, reference.transcript, name=reference.label)
        if isinstance(reference, InstructVoice):
            base = reference.base
            named = NamedVoice(base) if isinstance(base, str) else base
            return self.instruct_voice(self.voice_for(named, speakers, speaker), reference.instruction)
        return speaker(reference.name) if reference.name in speakers else self.named(reference.name, speakers)

    def close(self) -> None:
        """Close the voice store and the analysis cache."""
        self.store.close()
        self.cache.close()

    def prompt_voice(self, prompt: PromptAudio, transcript: str = "", *, name: str = "prompt") -> V:
        """A one-off voice: zero-shot with the prompt's transcript, cross-lingual without one."""
        features = self.analyze(prompt)
        return self._voice(name, features, self._transcript_ids(transcript, features.duration_s))

    # ---- saved voices -----------------------------------------------------------------------
    def save(self, name: str, prompt: PromptAudio, transcript: str = "") -> SavedVoice:
        """Analyse and store a voice under `name` (VoiceExistsError, TooManyVoicesError; nothing stored on failure)."""
        name = check_voice_name(name, self.reserved)
        if self.store.get(name) is not None:  # answer a duplicate before the analysis work
            raise VoiceExistsError(f"a voice named {name!r} exists; delete it first", param="name")
        features = self.analyze(prompt)
        self._transcript_ids(transcript, features.duration_s)  # refuse a transcript the audio cannot hold
        voice = SavedVoice(name, transcript.strip(), features, prompt.sha256, self.models, made_for=self.bundle.manifest.model)
        self.store.add(voice, self.max_voices)
        return voice

    def saved(self, name: str) -> SavedVoice:
        found = self._stored(name)
        if found is None:
            raise _not_saved(name)
        return found

    def delete(self, name: str) -> None:
        if not is_voice_name(name) or not self.store.delete(name):
            raise _not_saved(name)

    def usable(self, voice: SavedVoice) -> bool:
        return voice.models == self.models

    def resolve(self, name: str) -> V | None:
        """The saved voice `name` as the engine takes it, or None (also for a voice another model analysed)."""
        saved = self._stored(name)
        if saved is None:
            return None
        if saved.models != self.models:
            log.warning("saved voice %r was analysed by other prompt models; it is not used", name)
            return None
        return self._saved_voice(saved)

    def named(self, name: str, speakers: Sequence[str]) -> V:
        """The saved voice `name` as the engine takes it; UnknownSpeakerError naming what exists when there is none,
        or saying why a voice another model's prompt models analysed (a store shared with another model) is not used."""
        saved = self._stored(name)
        if saved is None:
            raise unknown_voice(name, speakers)
        if saved.models != self.models:
            raise UnknownSpeakerError(
                f"the saved voice {name!r} was analysed by other prompt models than those of the served model "
                f"{self.bundle.manifest.model} (it was saved while another model was served), so it cannot speak here; "
                "save its recording again under another name (POST /v1/voices)",
                param="voice",
            )
        return self._saved_voice(saved)

    # ---- internals ---------------------------------------------------------------------------
    def _stored(self, name: str) -> SavedVoice | None:
        """The saved voice `name`; None without asking the store for a name no voice can have (one that cannot be a
        file name or a Redis key: 10,000 characters, a lone surrogate)."""
        return self.store.get(name) if is_voice_name(name) else None

    def _saved_voice(self, saved: SavedVoice) -> V:
        return self._voice(saved.name, saved.features, self._transcript_ids(saved.transcript, saved.features.duration_s))

    def _need_analysis(self) -> None:
        if not self._can_analyze:
            raise UnsupportedCapabilityError(
                f"the served model {self.bundle.manifest.model} has no prompt analysis (its checkpoint had no CAM++ and "
                "speech tokenizer models): voice cloning is off",
                param="prompt_audio",
            )

    def _need_instruction(self, instruct_text: str) -> str:
        text = instruct_text.strip()
        if not text or len(text) > MAX_INSTRUCT_CHARS:
            raise InvalidInputError(f"instruct_text must have 1-{MAX_INSTRUCT_CHARS} characters", param="instruction")
        return text

    def _prompt_text_ids(self, text: str) -> list[int]:
        """Official prompt-text handling: normalized without splitting (texts with `<|...|>` pass as they are)."""
        return self.frontend.encode("".join(self.frontend.normalize(text, split=False)))

    def _transcript_ids(self, transcript: str, duration_s: float) -> tuple[int, ...]:
        text = transcript.strip()
        if not text:
            return ()
        ids = self._prompt_text_ids(text)
        limit = int(MAX_TRANSCRIPT_TOKENS_PER_S * duration_s) + TRANSCRIPT_TOKEN_SLACK
        if len(ids) > limit:
            raise InvalidInputError(
                f"the transcript has {len(ids)} text tokens, more than {duration_s:.1f} s of speech can hold "
                f"(at most {limit}); give the words spoken in the prompt recording",
                param="prompt_text",
            )
        return tuple(ids)


def neutral_embedding(dim: int) -> np.ndarray:
    """A unit x-vector with equal components: the speaker of a model's warm-up voice when it has no built-in one."""
    return np.full(dim, dim**-0.5, dtype=np.float32)


def models_fingerprint(bundle: ModelBundle) -> str:
    """What a prompt analysis depends on: the prompt models' hashes (empty when the bundle has none)."""
    if not bundle.has_prompt_analysis:
        return "none"
    parts = [g.sha256 for g in bundle.manifest.graphs_in(GROUP_PROMPT).values()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def shown_name(name: str) -> str:
    """A name as an error message quotes it: escaped (repr), and cut after what a voice name may hold."""
    return repr(name) if len(name) <= MAX_NAME_CHARS else f"{name[:MAX_NAME_CHARS]!r}… ({len(name)} characters)"


def _not_saved(name: str) -> NotFoundError:
    rule = "" if is_voice_name(name) else f": {NAME_RULE}"
    return NotFoundError(f"no saved voice named {shown_name(name)}{rule}", param="voice_id")


def unknown_voice(name: str, speakers: Sequence[str], *, saved: bool = True) -> UnknownSpeakerError:
    """The error for a voice name that is neither a built-in speaker nor (when `saved`) a saved voice."""
    if not speakers:
        return UnknownSpeakerError(
            f"unknown voice {shown_name(name)}: the served model has no built-in speakers; save a voice first (POST /v1/voices "
            "with a recording and a name) and name it, or send a prompt recording; GET /v1/voices lists the saved ones",
            param="voice",
        )
    known = ", ".join(speakers)
    more = " or a saved voice (GET /v1/voices)" if saved else ""
    return UnknownSpeakerError(f"unknown speaker {shown_name(name)}; known: {known}{more}", param="voice")
