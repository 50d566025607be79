"""CosyVoice2 voices: what the LLM and the flow are conditioned on besides the text, per official mode."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import numpy as np

from service.engine.types import LLMPrompt
from service.layers.flow_prompt import FlowPrompt

VoiceKind2 = Literal["sft", "zero_shot", "cross_lingual", "instruct2"]


FlowPrompt2 = FlowPrompt  # the shared type (service/layers/flow_prompt.py) under its CosyVoice2 name


@dataclass(frozen=True, eq=False)
class Voice2:
    """A CosyVoice2 voice under a display name; `fingerprint` names every number the audio depends on."""

    name: str
    llm: LLMPrompt
    flow: FlowPrompt2
    kind: VoiceKind2
    fingerprint: str = ""

    def __post_init__(self) -> None:
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", _fingerprint(self))

    @classmethod
    def cloned(
        cls, name: str, embedding: np.ndarray, tokens: tuple[int, ...], mel: np.ndarray, prompt_text_ids: tuple[int, ...] = ()
    ) -> Voice2:
        """A voice from a prompt recording: zero-shot with its transcript's ids (prompt text and tokens in the LLM),
        cross-lingual without (the LLM sees neither). Tokens and mel are cut to a common length, 2 frames a token."""
        n = min(len(tokens), mel.shape[0] // 2)
        flow = FlowPrompt2(embedding, tuple(int(t) for t in tokens[:n]), np.asarray(mel)[: 2 * n])
        zero_shot = bool(prompt_text_ids)
        llm = LLMPrompt(None, tuple(prompt_text_ids), flow.tokens if zero_shot else ())
        return cls(name, llm, flow, "zero_shot" if zero_shot else "cross_lingual")

    @classmethod
    def builtin(cls, name: str, embedding: np.ndarray) -> Voice2:
        """A spk2info speaker: its x-vector conditions the flow only (the CosyVoice2 LLM takes no speaker vector)."""
        return cls(name, LLMPrompt(None), FlowPrompt2(embedding), "sft")

    def with_instruction(self, instruct_ids: tuple[int, ...]) -> Voice2:
        """instruct2: the instruction's ids in front of the text; the prompt recording conditions the flow only."""
        return Voice2(self.name, LLMPrompt(None, tuple(instruct_ids)), self.flow, "instruct2")


def _fingerprint(voice: Voice2) -> str:
    h = hashlib.sha256(voice.kind.encode())
    for part in (voice.flow.embedding, voice.flow.mel):
        h.update(part.tobytes())
        h.update(b"|")
    for ids in (voice.llm.prompt_text_ids, voice.llm.speech_tokens, voice.flow.tokens):
        h.update(np.asarray(ids, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:32]
