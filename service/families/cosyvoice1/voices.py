"""CosyVoice-300M voices beyond the built-in speakers: the shared prompt-voice library with v1's analysis (CAM++,
speech_tokenizer_v1, the 22,050 Hz prompt mel) and instruct on a built-in or saved voice."""

from __future__ import annotations

import numpy as np

from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.errors import InvalidInputError, UnsupportedCapabilityError
from service.families.cosyvoice1.voice import Voice
from service.families.model import ModelVoice
from service.families.voices import PromptVoices
from service.frontend import TextFrontend
from service.layers.prompt import MelVariant, PromptAnalyzer
from service.stores.analysis_cache import AnalysisCache
from service.stores.voices import PromptFeatures, VoiceStore


class Voices(PromptVoices[Voice]):
    """Prompt analysis and saved voices of a CosyVoice-300M bundle; thread-safe."""

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
        super().__init__(
            bundle, frontend, builtin, store, cache, can_analyze=analyzer is not None, variant=mel_variant,
            max_voices=max_voices, reserved_names=reserved_names,
        )  # fmt: skip
        self.analyzer = analyzer
        self.mel_variant: MelVariant = mel_variant

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
    def can_instruct(self) -> bool:
        return bool(self.bundle.capabilities.instruct)

    def _features(self, audio: np.ndarray, sample_rate: int) -> PromptFeatures:
        assert self.analyzer is not None  # analyze() checked can_clone
        result = self.analyzer.analyze(audio, sample_rate, mel_variant=self.mel_variant)
        return PromptFeatures(result.embedding, result.speech_tokens, result.mel, result.duration_s, result.mel_variant)

    def _voice(self, name: str, features: PromptFeatures, transcript_ids: tuple[int, ...]) -> Voice:
        tokens = tuple(int(t) for t in features.speech_tokens)
        return Voice.cloned(name, features.embedding, tokens, features.mel, transcript_ids)

    def instruct_voice(self, base: ModelVoice, instruct_text: str) -> Voice:
        """Instruct mode (CosyVoice-300M-Instruct): `base` voice's flow, instruct text in front of the LLM text."""
        if not self.can_instruct:
            raise UnsupportedCapabilityError(
                f"the served model {self.bundle.manifest.model} has no instruct capability (use CosyVoice-300M-Instruct)",
                param="instruction",
            )
        text = self._need_instruction(instruct_text)
        return v1_voice(base).with_instruction(tuple(self._prompt_text_ids(text)))


def v1_voice(voice: ModelVoice) -> Voice:
    """`voice` as the v1 engine takes it: only a voice this family made is one (InvalidInputError otherwise)."""
    if not isinstance(voice, Voice):
        raise InvalidInputError(f"the voice {voice.name!r} was made by another model family", param="voice")
    return voice
