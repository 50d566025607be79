"""The Qwen2 LLM of CosyVoice2 and later families: its prefill graph and rotary step graph on the kit's runner."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from service.bundle import ModelConstants
from service.engine.llm import LLMRunner
from service.engine.types import LLMPrompt, as_llm_prompt
from service.errors import InvalidInputError

QWEN2_GRAPHS: tuple[str, ...] = ("llm_prompt", "llm_embed", "llm_step")


class Qwen2Runner(LLMRunner):
    """LLMRunner over the CosyVoice2 graphs: the prefill is [sos, prompt text ++ text, task, prompt speech tokens].

    There is no speaker slot (a CosyVoice2 LLMPrompt's embedding is ignored, as the official Qwen2LM ignores
    it) and no position table: the step graph applies rotary positions from past_len. Decode steps batch on
    the same BatchScheduler as v1's; sampling stops at EOS or either of the two stop tokens after it.
    """

    GRAPHS = QWEN2_GRAPHS

    def __init__(self, sessions: Mapping[str, Any], constants: ModelConstants, text_vocab_size: int) -> None:
        self.text_vocab_size = text_vocab_size
        super().__init__(sessions, constants)

    def _bind(self, sessions: Mapping[str, Any]) -> None:
        self._prompt = sessions["llm_prompt"]

    def encode(self, text_ids: Sequence[int], prompt: LLMPrompt | np.ndarray) -> np.ndarray:
        """LM input (L, D) float32: [sos, embed(prompt text ++ text), task, speech_embedding(prompt tokens)]."""
        prompt = as_llm_prompt(prompt)
        if len(text_ids) == 0:
            raise InvalidInputError("text_ids is empty")
        ids = np.asarray([*prompt.prompt_text_ids, *text_ids], dtype=np.int64).reshape(1, -1)
        if ids.min() < 0 or ids.max() >= self.text_vocab_size:
            raise InvalidInputError(f"text ids must be in 0..{self.text_vocab_size - 1}")
        lm_input = np.asarray(self._prompt.run(["x"], {"text_ids": ids})[0][0], dtype=np.float32)
        if prompt.speech_tokens:
            tokens = np.asarray(prompt.speech_tokens, dtype=np.int64)[None]
            (speech,) = self._embed.run(["x"], {"token": tokens})
            lm_input = np.concatenate([lm_input, speech[0]], axis=0)
        return np.ascontiguousarray(lm_input, dtype=np.float32)

    def _run_step(self, x: np.ndarray, past: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        feeds = dict(past)
        feeds["x"] = x
        logp, new_k, new_v = self._step.run(["logp", "new_k", "new_v"], feeds)
        return logp, new_k, new_v
