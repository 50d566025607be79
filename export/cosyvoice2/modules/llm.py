"""Qwen2LM (the CosyVoice2 LLM): the shared Qwen2 speech LLM whose prefill begins and ends with rows of its own
`llm_embedding` (sos, task); official `llm.pt` key names."""

from __future__ import annotations

from torch import Tensor, nn

from export.cosyvoice2.config import LLMConfig
from export.modules.qwen2 import Qwen2SpeechLM, drop_unused

__all__ = ["Qwen2LM", "drop_unused"]

SOS_INDEX = 0  # rows of llm_embedding.weight
TASK_INDEX = 1


class Qwen2LM(Qwen2SpeechLM):
    """Official Qwen2LM at inference: [sos, text embeddings, task, prompt speech tokens] -> speech-token log-probs.

    Keys: llm_embedding, llm.model.model.* (Qwen2 body), llm_decoder, speech_embedding.
    """

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.llm_embedding = nn.Embedding(2, cfg.llm_input_size)
        self._init_body(cfg.qwen, cfg.llm_input_size, cfg.vocab_out, decoder_bias=True)

    def prompt(self, text_ids: Tensor) -> Tensor:
        """text_ids (B,T) int64 -> (B,T+2,D) = [sos, embed_tokens(text), task] (speech tokens are appended after)."""
        return self.framed(text_ids, self.llm_embedding.weight, SOS_INDEX, TASK_INDEX)
