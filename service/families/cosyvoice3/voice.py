"""CosyVoice3 voices: what the LLM and the flow are conditioned on besides the text, per official mode.

Fun-CosyVoice3's LLM needs `<|endofprompt|>` in its prompt text or text (the official CosyVoice3LM asserts it): the
official examples put the system prompt and the marker in front of the transcript (zero-shot), the instruction
(instruct2) or the text (cross-lingual). A voice carries those ids; text that holds the marker already (the official
request shape) keeps its own and the voice adds none.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import numpy as np

from service.engine.types import LLMPrompt
from service.families.cosyvoice3.contract import END_OF_PROMPT_ID
from service.layers.flow_prompt import FlowPrompt

VoiceKind3 = Literal["sft", "zero_shot", "cross_lingual", "instruct2"]


@dataclass(frozen=True, eq=False)
class Voice3:
    """A CosyVoice3 voice under a display name; `fingerprint` names every number the audio depends on.

    `llm.prompt_text_ids` is what goes in front of every sentence's ids; `system_ids` (the system prompt and the marker)
    is its part that only a sentence without the marker needs (cross-lingual: all of it)."""

    name: str
    llm: LLMPrompt
    flow: FlowPrompt
    kind: VoiceKind3
    system_ids: tuple[int, ...] = ()
    fingerprint: str = ""

    def __post_init__(self) -> None:
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", _fingerprint(self))

    @classmethod
    def cloned(
        cls,
        name: str,
        embedding: np.ndarray,
        tokens: tuple[int, ...],
        mel: np.ndarray,
        transcript_ids: tuple[int, ...],
        system_ids: tuple[int, ...],
    ) -> Voice3:
        """A voice from a prompt recording: zero-shot with its transcript's ids (the system prompt in front unless the
        transcript holds the marker), cross-lingual without (the LLM sees the system prompt and no prompt tokens).
        Tokens and mel are cut to a common length, 2 frames a token."""
        n = min(len(tokens), mel.shape[0] // 2)
        flow = FlowPrompt(embedding, tuple(int(t) for t in tokens[:n]), np.asarray(mel)[: 2 * n])
        if not transcript_ids:
            return cls(name, LLMPrompt(None, system_ids), flow, "cross_lingual", system_ids)
        prompt_ids = transcript_ids if END_OF_PROMPT_ID in transcript_ids else system_ids + transcript_ids
        return cls(name, LLMPrompt(None, prompt_ids, flow.tokens), flow, "zero_shot")

    @classmethod
    def builtin(cls, name: str, embedding: np.ndarray, system_ids: tuple[int, ...]) -> Voice3:
        """A spk2info speaker (a benchmark bundle's random ones): its x-vector conditions the flow only."""
        return cls(name, LLMPrompt(None, system_ids), FlowPrompt(embedding), "sft", system_ids)

    def with_instruction(self, instruct_ids: tuple[int, ...]) -> Voice3:
        """instruct2: the instruction's ids (system prompt, instruction, marker) in front of the text; the recording
        conditions the flow only."""
        return Voice3(self.name, LLMPrompt(None, tuple(instruct_ids)), self.flow, "instruct2")

    def llm_prompt(self, text_ids: list[int]) -> LLMPrompt:
        """The LLM's prompt for one sentence: without the system ids when the sentence holds the marker itself."""
        if self.system_ids and END_OF_PROMPT_ID in text_ids:
            kept = self.llm.prompt_text_ids[len(self.system_ids) :]
            return LLMPrompt(None, kept, self.llm.speech_tokens)
        return self.llm


def _fingerprint(voice: Voice3) -> str:
    h = hashlib.sha256(f"cosyvoice3:{voice.kind}".encode())
    for part in (voice.flow.embedding, voice.flow.mel):
        h.update(part.tobytes())
        h.update(b"|")
    for ids in (voice.llm.prompt_text_ids, voice.llm.speech_tokens, voice.flow.tokens, voice.system_ids):
        h.update(np.asarray(ids, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:32]
