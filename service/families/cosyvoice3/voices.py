"""CosyVoice3 voices beyond built-in speakers: the shared prompt-voice library with the v3 analysis (CAM++,
speech_tokenizer_v3 at 25 Hz, the 24 kHz prompt mel up to 12 kHz) and instruct2 on any cloned or saved voice."""

from __future__ import annotations

import numpy as np

from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.errors import InvalidInputError, UnsupportedCapabilityError
from service.families.cosyvoice3.contract import END_OF_PROMPT, SYSTEM_PROMPT, instruction_text
from service.families.cosyvoice3.voice import Voice3
from service.families.model import ModelVoice
from service.families.voices import PromptVoices
from service.frontend import TextFrontend
from service.layers.prompt24k import PromptAnalyzer2
from service.stores.analysis_cache import AnalysisCache
from service.stores.voices import PromptFeatures, VoiceStore

ANALYSIS_VARIANT = "cosyvoice3"  # what a saved CosyVoice3 voice holds: 25 Hz v3 tokens, (2 x tokens, 80) mel up to 12 kHz


class PromptAnalyzer3(PromptAnalyzer2):
    """CosyVoice2's analysis with the v3 tokenizer and the prompt mel's filters up to 12 kHz (`fmax: null`)."""

    mel_fmax_hz = None


class Voices3(PromptVoices[Voice3]):
    """Prompt analysis and saved voices of a CosyVoice3 bundle; thread-safe."""

    def __init__(
        self,
        bundle: ModelBundle,
        frontend: TextFrontend,
        store: VoiceStore,
        cache: AnalysisCache,
        *,
        analyzer: PromptAnalyzer3 | None,
        max_voices: int = 100,
        reserved_names: tuple[str, ...] = (),
    ) -> None:
        super().__init__(
            bundle, frontend, tuple(bundle.speakers), store, cache, can_analyze=analyzer is not None,
            variant=ANALYSIS_VARIANT, max_voices=max_voices, reserved_names=reserved_names,
        )  # fmt: skip
        self.analyzer = analyzer
        self.system_ids = tuple(frontend.encode(SYSTEM_PROMPT + END_OF_PROMPT))

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
    ) -> Voices3:
        """Open the bundle's prompt models when it has them and `analyze` asks for them (cloning is off otherwise)."""
        analyzer = None
        if bundle.has_prompt_analysis and analyze:
            campplus, tokenizer = bundle.prompt_model_path("campplus"), bundle.prompt_model_path("speech_tokenizer")
            analyzer = PromptAnalyzer3.load(campplus, tokenizer, options)
        return cls(bundle, frontend, store, cache, analyzer=analyzer, max_voices=max_voices, reserved_names=reserved_names)

    @property
    def can_instruct(self) -> bool:
        return bool(self.bundle.capabilities.instruct2)

    def _features(self, audio: np.ndarray, sample_rate: int) -> PromptFeatures:
        assert self.analyzer is not None  # analyze() checked can_clone
        result = self.analyzer.analyze2(audio, sample_rate)
        return PromptFeatures(result.embedding, result.speech_tokens, result.mel, result.duration_s, ANALYSIS_VARIANT)

    def _voice(self, name: str, features: PromptFeatures, transcript_ids: tuple[int, ...]) -> Voice3:
        tokens = tuple(int(t) for t in features.speech_tokens)
        return Voice3.cloned(name, features.embedding, tokens, features.mel, transcript_ids, self.system_ids)

    def instruct_voice(self, base: ModelVoice, instruct_text: str) -> Voice3:
        """instruct2: "You are a helpful assistant. <instruction><|endofprompt|>" in front of the text, as the official
        examples write it (an instruction that starts with the system prompt or ends with the marker keeps it);
        `base`'s recording conditions the flow only."""
        if not self.can_instruct:
            raise UnsupportedCapabilityError(
                f"the served model {self.bundle.manifest.model} has no instruct2 capability (its bundle has no prompt models)",
                param="instruction",
            )
        text = instruction_text(self._need_instruction(instruct_text))
        return v3_voice(base).with_instruction(tuple(self.frontend.encode(text)))


def v3_voice(voice: ModelVoice) -> Voice3:
    """`voice` as the CosyVoice3 engine takes it: only a voice this family made is one (InvalidInputError otherwise)."""
    if not isinstance(voice, Voice3):
        raise InvalidInputError(f"the voice {voice.name!r} was made by another model family", param="voice")
    return voice
