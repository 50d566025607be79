"""Voices: what the model is conditioned on besides the text (speaker vectors, prompt text, tokens and mel)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from service.engine.types import LLMPrompt

VoiceKind = Literal["sft", "zero_shot", "cross_lingual", "instruct"]


def _floats(x: np.ndarray | None) -> np.ndarray | None:
    return None if x is None else np.ascontiguousarray(x, dtype=np.float32)


@dataclass(frozen=True, eq=False)
class FlowPrompt:
    """The flow's side of a voice: x-vector (spk_embed_dim,), prompt speech tokens, prompt mel (P, n_mels).

    With prompt tokens, the flow encodes prompt ++ chunk tokens together, conditions its first P frames on
    `mel` and cuts them from the output (official MaskedDiffWithXvec.inference).
    """

    embedding: np.ndarray
    tokens: tuple[int, ...] = ()
    mel: np.ndarray | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "embedding", _floats(self.embedding))
        object.__setattr__(self, "mel", _floats(self.mel))
        if bool(self.tokens) != (self.mel is not None and self.mel.shape[0] > 0):
            raise ValueError("a flow prompt needs both prompt tokens and a prompt mel, or neither")

    @property
    def frames(self) -> int:
        """Prompt mel frames P (0 without a prompt)."""
        return 0 if self.mel is None else int(self.mel.shape[0])

    def window(self, max_frames: int | None) -> FlowPrompt:
        """The last `max_frames` prompt mel frames with their share of the prompt tokens (None or more: all of it).

        The tokens kept are the last round(max_frames * tokens / frames), so the kept part has the prompt's own
        frames-per-token ratio and its tokens line up with its frames as in the whole prompt.
        """
        if max_frames is None or self.mel is None or max_frames >= self.frames:
            return self
        if max_frames <= 0:
            return FlowPrompt(self.embedding)
        n_tokens = max(1, round(max_frames * len(self.tokens) / self.frames))
        return FlowPrompt(self.embedding, self.tokens[-n_tokens:], self.mel[-max_frames:])


def as_flow_prompt(prompt: FlowPrompt | np.ndarray) -> FlowPrompt:
    """A FlowPrompt, given one or a bare x-vector (a built-in speaker: no prompt tokens or mel)."""
    return prompt if isinstance(prompt, FlowPrompt) else FlowPrompt(np.asarray(prompt, dtype=np.float32).reshape(-1))


@dataclass(frozen=True, eq=False)
class Voice:
    """A speaker as the model takes it: one LLM prompt and one flow prompt, under a display name.

    Built-in speakers condition both stages on their table embedding (SFT). A cloned voice carries its
    prompt analysis (zero-shot, or cross-lingual without prompt text and LLM prompt tokens). Instruct
    requests drop the LLM speaker slot and put the instruct text in front (`with_instruction`).
    `fingerprint` names every number the audio depends on, for cache keys.
    """

    name: str
    llm: LLMPrompt
    flow: FlowPrompt
    fingerprint: str = field(default="")

    def __post_init__(self) -> None:
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", _fingerprint(self.llm, self.flow))

    @classmethod
    def builtin(cls, name: str, embedding: np.ndarray) -> Voice:
        """A built-in speaker (spk2info): the same raw x-vector for the LLM slot and the flow."""
        return cls(name, LLMPrompt(embedding), FlowPrompt(embedding))

    @classmethod
    def cloned(
        cls,
        name: str,
        embedding: np.ndarray,
        speech_tokens: tuple[int, ...],
        mel: np.ndarray,
        prompt_text_ids: tuple[int, ...] = (),
    ) -> Voice:
        """A voice from a prompt recording. With its transcript's ids it clones zero-shot (prompt text and
        prompt tokens in the LLM); without, cross-lingually (the LLM sees only the speaker vector)."""
        zero_shot = bool(prompt_text_ids)
        llm = LLMPrompt(embedding, prompt_text_ids, speech_tokens if zero_shot else ())
        return cls(name, llm, FlowPrompt(embedding, speech_tokens, mel))

    def with_instruction(self, instruct_ids: tuple[int, ...]) -> Voice:
        """Instruct mode (CosyVoice-300M-Instruct): no LLM speaker slot, the instruct text ids in front."""
        llm = LLMPrompt(None, tuple(instruct_ids))
        return replace(self, llm=llm, fingerprint="")

    @property
    def kind(self) -> VoiceKind:
        if self.llm.embedding is None:
            return "instruct"
        if self.flow.tokens:
            return "zero_shot" if self.llm.speech_tokens else "cross_lingual"
        return "sft"


def _fingerprint(llm: LLMPrompt, flow: FlowPrompt) -> str:
    h = hashlib.sha256()
    for part in (llm.embedding, flow.embedding, flow.mel):
        h.update(b"-" if part is None else part.tobytes())
        h.update(b"|")
    for ids in (llm.prompt_text_ids, llm.speech_tokens, flow.tokens):
        h.update(np.asarray(ids, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:32]
