"""TransformerLM (CosyVoice v1 SFT LLM) with the official `llm.pt` key names and its inference math."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.config import LLMConfig
from export.modules.transformer import RelPosEncoder, espnet_sinusoids

SOS_INDEX = 0  # rows of llm_embedding.weight
TASK_INDEX = 1


class TransformerLM(nn.Module):
    """Text encoder + rel-pos Transformer decoder predicting speech tokens (spec §3).

    Keys: text_embedding, text_encoder, text_encoder_affine_layer, llm_embedding, llm, llm_decoder,
    speech_embedding, spk_embed_affine_layer (`load_state_dict(torch.load("llm.pt"), strict=True)`).
    """

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.text_embedding = nn.Embedding(cfg.text_token_size, cfg.text_encoder_input_size)
        self.text_encoder = RelPosEncoder(cfg.text_encoder)
        self.text_encoder_affine_layer = nn.Linear(cfg.text_encoder.output_size, cfg.llm_input_size)
        self.llm_embedding = nn.Embedding(2, cfg.llm_input_size)
        self.llm = RelPosEncoder(cfg.llm)
        self.llm_decoder = nn.Linear(cfg.llm_output_size, cfg.speech_token_size + 1)
        self.speech_embedding = nn.Embedding(cfg.speech_token_size, cfg.llm_input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.llm_input_size)

    def encode(self, text_ids: Tensor, embedding: Tensor) -> Tensor:
        """text_ids (B,T) int64, raw x-vector (B,192) -> lm_input (B,T+3,DI) = [sos, spk, text, task]."""
        text = self.text_encoder_affine_layer(self.text_encoder(self.text_embedding(text_ids)))
        spk = self.spk_embed_affine_layer(F.normalize(embedding, dim=1)).unsqueeze(1)
        batch = text.shape[0]
        sos = self.llm_embedding.weight[SOS_INDEX].view(1, 1, -1).expand(batch, 1, -1)
        task = self.llm_embedding.weight[TASK_INDEX].view(1, 1, -1).expand(batch, 1, -1)
        return torch.cat((sos, spk, text, task), dim=1)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """Speech tokens (B,T) int64 -> LLM inputs (B,T,DI)."""
        return self.speech_embedding(tokens)

    def log_probs(self, hidden: Tensor) -> Tensor:
        """Decoder hidden states (...,D) -> log-softmax over the V = speech_token_size + 1 classes."""
        return torch.log_softmax(self.llm_decoder(hidden), dim=-1)

    def positional(self, pe: Tensor) -> Tensor:
        """pe (R,D) rows for distances 0..R-1 -> pos (NL,H,R,DK), every decoder layer's linear_pos."""
        return self.llm.project_positions(pe)

    def step(
        self, x: Tensor, past_len: Tensor, past_k: list[Tensor], past_v: list[Tensor], pos: list[Tensor]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One cached LLM call over new inputs x (B,T,DI) (prefill: T = prompt, past 0; decode: T = 1).

        past_len (B,) int64; past_k/past_v per layer (B,H,C,DK), columns >= past_len[b] ignored; pos per layer
        (H,R,DK) with R >= max(past_len)+T. Returns (logp (B,V) at the last new position, new_k, new_v (NL,B,H,T,DK)).
        """
        hidden, new_k, new_v = self.llm.step(x, past_len, past_k, past_v, pos)
        return self.log_probs(hidden[:, -1]), new_k, new_v

    def score_all(self, x: Tensor) -> Tensor:
        """No-cache causal pass over a whole sequence x (B,L,DI) -> logp (B,L,V) at every position."""
        return self.log_probs(self.llm(x))

    def pe_rows(self, rows: int) -> Tensor:
        """espnet sinusoids (rows, D) for relative distances 0..rows-1."""
        return espnet_sinusoids(torch.arange(rows), self.cfg.llm.output_size)

    def teacher_force(self, text_ids: Tensor, embedding: Tensor, speech_ids: Tensor) -> Tensor:
        """Official SFT loop with forced tokens: prefill, then one cached step per token -> logp (N+1, V).

        text_ids (T,) int64, embedding (192,) raw, speech_ids (N,) int64; row i is the distribution that the
        official sampler sees before emitting speech_ids[i] (row N: after the last token).
        """
        lm_input = self.encode(text_ids.view(1, -1), embedding.view(1, -1))
        pos = list(self.positional(self.pe_rows(lm_input.shape[1] + speech_ids.shape[0])))
        heads, d_k = self.llm.layers()[0].self_attn.heads, self.llm.layers()[0].self_attn.d_k
        empty = lm_input.new_zeros(1, heads, 0, d_k)
        n_layers = len(pos)
        logp, cache_k, cache_v = self.step(
            lm_input, torch.zeros(1, dtype=torch.long), [empty] * n_layers, [empty] * n_layers, pos
        )
        rows = [logp[0]]
        for token in speech_ids.tolist():
            past_len = torch.tensor([cache_k.shape[3]])
            x = self.embed_tokens(torch.tensor([[token]]))
            logp, new_k, new_v = self.step(x, past_len, list(cache_k), list(cache_v), pos)
            cache_k = torch.cat((cache_k, new_k), dim=3)
            cache_v = torch.cat((cache_v, new_v), dim=3)
            rows.append(logp[0])
        return torch.stack(rows)
