"""CosyVoice2 voices beyond spk2info speakers: the shared prompt-voice library with the v2 analysis (CAM++,
speech_tokenizer_v2 at 25 Hz, the 24 kHz prompt mel) and instruct2 on any cloned, saved or built-in voice."""

from __future__ import annotations

import numpy as np

from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.errors import InvalidInputError, UnsupportedCapabilityError
from service.families.cosyvoice2.voice import Voice2
from service.families.model import ModelVoice
from service.families.voices import PromptVoices
from service.frontend import TextFrontend
from service.layers.prompt24k import PromptAnalyzer2
from service.stores.analysis_cache import AnalysisCache
from service.stores.voices import PromptFeatures, VoiceStore

ANALYSIS_VARIANT = "cosyvoice2"  # what a saved CosyVoice2 voice holds: 25 Hz tokens, (2 x tokens, 80) mel at 24 kHz
END_OF_PROMPT = "<|endofprompt|>"  # ends an instruction (the model was trained with it; official callers add it)


class Voices2(PromptVoices[Voice2]):
    """Prompt analysis and saved voices of a CosyVoice2 bundle; thread-safe."""

    def __init__(
        self,
        bundle: ModelBundle,
        frontend: TextFrontend,
        store: VoiceStore,
        cache: AnalysisCache,
        *,
        analyzer: PromptAnalyzer2 | None,
        max_voices: int = 100,
        reserved_names: tuple[str, ...] = (),
    ) -> None:
        super().__init__(
            bundle, frontend, tuple(bundle.speakers), store, cache, can_analyze=analyzer is not None,
            variant=ANALYSIS_VARIANT, max_voices=max_voices, reserved_names=reserved_names,
        )  # fmt: skip
        self.analyzer = analyzer

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
        max_voices: int = 100,
        reserved_names: tuple[str, ...] = (),
    ) -> Voices2:
        """Open the bundle's prompt models when it has them and `analyze` asks for them (cloning is off otherwise)."""
        analyzer = None
        if bundle.has_prompt_analysis and analyze:
            campplus, tokenizer = bundle.prompt_model_path("campplus"), bundle.prompt_model_path("speech_tokenizer")
            analyzer = PromptAnalyzer2.load(campplus, tokenizer, options)
        return cls(bundle, frontend, store, cache, analyzer=analyzer, max_voices=max_voices, reserved_names=reserved_names)

    @property
    def can_instruct(self) -> bool:
        return bool(self.bundle.capabilities.instruct2)

    def _features(self, audio: np.ndarray, sample_rate: int) -> PromptFeatures:
        assert self.analyzer is not None  # analyze() checked can_clone
        result = self.analyzer.analyze2(audio, sample_rate)
        return PromptFeatures(result.embedding, result.speech_tokens, result.mel, result.duration_s, ANALYSIS_VARIANT)

    def _voice(self, name: str, features: PromptFeatures, transcript_ids: tuple[int, ...]) -> Voice2:
        tokens = tuple(int(t) for t in features.speech_tokens)
        return Voice2.cloned(name, features.embedding, tokens, features.mel, transcript_ids)

    def instruct_voice(self, base: ModelVoice, instruct_text: str) -> Voice2:
        """instruct2: the instruction (as sent, `<|endofprompt|>` added when it does not end with it) in front of the
        text; `base`'s recording conditions the flow only (official frontend_instruct2)."""
        if not self.can_instruct:
            raise UnsupportedCapabilityError(
                f"the served model {self.bundle.manifest.model} has no instruct2 capability (its bundle has no prompt models)",
                param="instruction",
            )
        text = self._need_instruction(instruct_text)
        if not text.endswith(END_OF_PROMPT):
            text += END_OF_PROMPT
        return v2_voice(base).with_instruction(tuple(self.frontend.encode(text)))


def v2_voice(voice: ModelVoice) -> Voice2:
    """`voice` as the CosyVoice2 engine takes it: only a voice this family made is one (InvalidInputError otherwise)."""
    if not isinstance(voice, Voice2):
        raise InvalidInputError(f"the voice {voice.name!r} was made by another model family", param="voice")
    return voice
