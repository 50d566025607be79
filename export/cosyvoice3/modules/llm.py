"""CosyVoice3LM: the shared Qwen2 speech LLM whose prefill begins and ends with rows of its speech embedding (sos 6561,
task 6563) and whose decoder has no bias; official `llm.pt` key names."""

from __future__ import annotations

from torch import Tensor

from export.cosyvoice3.config import LLMConfig
from export.modules.qwen2 import Qwen2SpeechLM

SOS_OFFSET = 0  # rows of speech_embedding after the speech tokens (CosyVoice3LM: sos = speech_token_size + 0)
EOS_OFFSET = 1
TASK_OFFSET = 2


class CosyVoice3LM(Qwen2SpeechLM):
    """Official CosyVoice3LM at inference: [sos, text embeddings, task, prompt speech tokens] -> log-probs over 6761.

    Keys: llm.model.model.* (Qwen2 body), llm_decoder (no bias), speech_embedding; no llm_embedding.
    """

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self._init_body(cfg.qwen, cfg.llm_input_size, cfg.vocab_out, decoder_bias=False)

    def prompt(self, text_ids: Tensor) -> Tensor:
        """text_ids (B,T) int64 -> (B,T+2,D) = [sos, embed_tokens(text), task] (speech tokens are appended after)."""
        size = self.cfg.speech_token_size
        return self.framed(text_ids, self.speech_embedding.weight, size + SOS_OFFSET, size + TASK_OFFSET)
