"""CosyVoice-300M voices beyond the built-in speakers: prompt recordings analysed once (cached by their hash), saved
voices by name, one-off prompts and instruct requests, all turned into the v1 engine's Voice objects."""

from __future__ import annotations

import hashlib
import logging

from service.audio.decode import container_format, decode_audio, pcm16_to_float
from service.bundle import PROMPT_GRAPH_NAMES, ModelBundle
from service.engine.prompt import MAX_PROMPT_S, MelVariant, PromptAnalyzer
from service.engine.sessions import RuntimeOptions
from service.engine.voice import Voice
from service.errors import InvalidInputError, NotFoundError, PromptAudioError, UnsupportedCapabilityError, VoiceExistsError
from service.families.model import ModelVoice, PromptAudio
from service.frontend import TextFrontend
from service.stores.voices import AnalysisCache, PromptFeatures, SavedVoice, VoiceStore, check_voice_name

log = logging.getLogger(__name__)

# A transcript the prompt could not hold: more text tokens than fast speech has in that time (whisper BPE;
# Chinese runs ~5 characters ~ 5-8 tokens per second, English ~3 words ~ 4 tokens per second).
MAX_TRANSCRIPT_TOKENS_PER_S = 15.0
TRANSCRIPT_TOKEN_SLACK = 10
MAX_INSTRUCT_CHARS = 500


class Voices:
    """Prompt analysis and saved voices for one loaded bundle; thread-safe (stores and caches lock themselves)."""

    def __init__(
        self,
        bundle: ModelBundle,
        frontend: TextFrontend,
        builtin: tuple[str, ...],
        store: VoiceStore,
        cache: AnalysisCache,
        *,
        analyzer: PromptAnalyzer | None,
        mel_variant: MelVariant = "trained",
        max_voices: int = 100,
        reserved_names: tuple[str, ...] = (),
    ) -> None:
        self.bundle = bundle
        self.frontend = frontend
        self.builtin = builtin
        self.store = store
        self.cache = cache
        self.analyzer = analyzer
        self.mel_variant = mel_variant
        self.max_voices = max_voices
        self.reserved = frozenset((*builtin, *reserved_names))
        self.models = models_fingerprint(bundle)

    @classmethod
    def load(
        cls,
        bundle: ModelBundle,
        frontend: TextFrontend,
        store: VoiceStore,
        cache: AnalysisCache,
        options: RuntimeOptions,
        *,
        analyze: bool = True,
        **kw: object,
    ) -> Voices:
        """Open the bundle's prompt models when it has them and `analyze` asks for them (cloning is off otherwise)."""
        analyzer = None
        if bundle.has_prompt_analysis and analyze:
            analyzer = PromptAnalyzer.load(
                bundle.prompt_model_path("campplus"), bundle.prompt_model_path("speech_tokenizer"), options
            )
        return cls(bundle, frontend, tuple(bundle.speakers), store, cache, analyzer=analyzer, **kw)  # type: ignore[arg-type]

    @property
    def can_clone(self) -> bool:
        return self.analyzer is not None

    @property
    def can_instruct(self) -> bool:
        return bool(self.bundle.capabilities.instruct)

    # ---- analysis ---------------------------------------------------------------------------
    def analyze(self, prompt: PromptAudio) -> PromptFeatures:
        """Decode and analyse a prompt (1-30 s), or take the cached analysis of the same bytes."""
        analyzer = self._analyzer()
        pcm_rate_hz = self._raw_pcm_rate(prompt)
        key = f"{prompt.sha256}:{self.models}:{self.mel_variant}:{pcm_rate_hz or 'file'}"
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        try:
            if pcm_rate_hz is not None:
                audio, rate = pcm16_to_float(prompt.data, sample_rate=pcm_rate_hz, max_seconds=MAX_PROMPT_S)
            else:
                audio, rate = decode_audio(prompt.data, max_seconds=MAX_PROMPT_S)
            result = analyzer.analyze(audio, rate, mel_variant=self.mel_variant)
        except PromptAudioError as e:
            e.param = "prompt_audio"  # the domain's name; each transport renames it to its own field
            raise
        features = PromptFeatures(result.embedding, result.speech_tokens, result.mel, result.duration_s, result.mel_variant)
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

    def prompt_voice(self, prompt: PromptAudio, transcript: str = "", *, name: str = "prompt") -> Voice:
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
        voice = SavedVoice(name, transcript.strip(), features, prompt.sha256, self.models)
        self.store.add(voice, self.max_voices)
        return voice

    def saved(self, name: str) -> SavedVoice:
        found = self.store.get(name)
        if found is None:
            raise NotFoundError(f"no saved voice named {name!r}", param="voice_id")
        return found

    def delete(self, name: str) -> None:
        if not self.store.delete(name):
            raise NotFoundError(f"no saved voice named {name!r}", param="voice_id")

    def resolve(self, name: str) -> Voice | None:
        """The saved voice `name` as the engine takes it, or None (the TTSService's saved-voice resolver)."""
        saved = self.store.get(name)
        if saved is None:
            return None
        if saved.models != self.models:
            log.warning("saved voice %r was analysed by other prompt models; it is not used", name)
            return None
        return self._voice(saved.name, saved.features, self._transcript_ids(saved.transcript, saved.features.duration_s))

    # ---- instruct ----------------------------------------------------------------------------
    def instruct_voice(self, base: ModelVoice, instruct_text: str) -> Voice:
        """Instruct mode (CosyVoice-300M-Instruct): `base` voice's flow, instruct text in front of the LLM text."""
        if not self.can_instruct:
            raise UnsupportedCapabilityError(
                f"the served model {self.bundle.manifest.model} has no instruct capability (use CosyVoice-300M-Instruct)",
                param="instruction",
            )
        text = instruct_text.strip()
        if not text or len(text) > MAX_INSTRUCT_CHARS:
            raise InvalidInputError(f"instruct_text must have 1-{MAX_INSTRUCT_CHARS} characters", param="instruction")
        return v1_voice(base).with_instruction(tuple(self._prompt_text_ids(text)))

    # ---- internals ---------------------------------------------------------------------------
    def _analyzer(self) -> PromptAnalyzer:
        if self.analyzer is None:
            raise UnsupportedCapabilityError(
                f"the served model {self.bundle.manifest.model} has no prompt analysis (campplus.onnx and "
                "speech_tokenizer_v1.onnx were not in its checkpoint): voice cloning is off",
                param="prompt_audio",
            )
        return self.analyzer

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

    def _voice(self, name: str, features: PromptFeatures, transcript_ids: tuple[int, ...]) -> Voice:
        tokens = tuple(int(t) for t in features.speech_tokens)
        return Voice.cloned(name, features.embedding, tokens, features.mel, transcript_ids)


def models_fingerprint(bundle: ModelBundle) -> str:
    """What a prompt analysis depends on: the prompt models' hashes (empty when the bundle has none)."""
    if not bundle.has_prompt_analysis:
        return "none"
    parts = [bundle.manifest.graphs[n].sha256 for n in PROMPT_GRAPH_NAMES]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def v1_voice(voice: ModelVoice) -> Voice:
    """`voice` as the v1 engine takes it: only a voice this family made is one (InvalidInputError otherwise)."""
    if not isinstance(voice, Voice):
        raise InvalidInputError(f"the voice {voice.name!r} was made by another model family", param="voice")
    return voice
