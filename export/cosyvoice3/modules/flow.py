"""CausalMaskedDiffWithDiT (the Fun-CosyVoice3 flow) with the official `flow.pt` key names, as a reference for its
graphs: speech tokens -> input_embedding -> PreLookaheadLayer -> each token twice = mu; Euler CFM solve with CFG
through the DiT = mel. No conformer encoder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.cosyvoice3.config import FlowConfig
from export.cosyvoice3.modules.dit import DiT
from export.modules.chunk_causal import CONV_TAIL, FULL_ATTENTION, PreLookaheadLayer
from export.modules.flow import time_span


class _CFM(nn.Module):
    """`decoder`: only its estimator holds weights."""

    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        self.estimator = DiT(cfg.dit)


class CausalMaskedDiffWithDiT(nn.Module):
    """Keys: input_embedding, spk_embed_affine_layer, pre_lookahead_layer.conv{1,2}, decoder.estimator.*."""

    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(cfg.input_size, cfg.lookahead_channels, cfg.pre_lookahead_len)
        self.decoder = _CFM(cfg)

    @property
    def estimator(self) -> DiT:
        return self.decoder.estimator

    def speaker(self, embedding: Tensor) -> Tensor:
        """Raw x-vector (B,192) -> spks (B,80) = spk_embed_affine_layer(l2norm(e))."""
        return self.spk_embed_affine_layer(F.normalize(embedding, dim=1))

    def embed(self, tokens: Tensor) -> Tensor:
        """Speech tokens (B,T) int64 (clamped >= 0 like the official) -> (B,T,80)."""
        return self.input_embedding(torch.clamp(tokens, min=0))

    def empty_tail(self, batch: int = 1) -> Tensor:
        return torch.zeros(batch, self.cfg.lookahead_channels, CONV_TAIL)

    def lookahead(self, tokens: Tensor, context: Tensor, tail: Tensor) -> tuple[Tensor, Tensor]:
        """h (B,T,80) of new tokens (B,T) with their look-ahead `context` (B,K<=3) after `tail` (B,C1,2), new tail."""
        return self.pre_lookahead_layer.chunk_step(self.embed(tokens), self.embed(context), tail)

    def mu(self, tokens: Tensor, context: Tensor) -> Tensor:
        """mu (B,80,2T) of a whole sequence in one call: every token's h twice."""
        h, _ = self.lookahead(tokens, context, self.empty_tail(tokens.shape[0]))
        return torch.repeat_interleave(h, self.cfg.token_mel_ratio, dim=1).transpose(1, 2)

    def velocity(self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, chunk: int) -> Tensor:
        """The DiT over a whole sequence in one call (no cache)."""
        cache = self.estimator.empty_cache(x.shape[0])
        v, _ = self.estimator.chunk_step(x, mu, t, spks, cond, torch.tensor([chunk]), torch.tensor([0]), cache)
        return v

    def solve(self, mu: Tensor, spks: Tensor, cond: Tensor, noise: Tensor, chunk: int, n_timesteps: int = 10) -> Tensor:
        """Official solve_euler with CFG over a whole sequence: mu, cond, noise (1,80,M), spks (1,80) -> mel (1,80,M)."""
        t_span = time_span(n_timesteps, self.cfg.t_scheduler)
        cfg_rate = self.cfg.inference_cfg_rate
        x = noise
        t, dt = t_span[0], t_span[1] - t_span[0]
        zero_spks, zero = torch.zeros_like(spks), torch.zeros_like(mu)
        for step in range(1, n_timesteps + 1):
            v = self.velocity(
                torch.cat([x, x]), torch.cat([mu, zero]), t.view(1).expand(2), torch.cat([spks, zero_spks]),
                torch.cat([cond, zero]), chunk,
            )  # fmt: skip
            x = x + dt * ((1.0 + cfg_rate) * v[:1] - cfg_rate * v[1:])
            t = t + dt
            if step < n_timesteps:
                dt = t_span[step + 1] - t
        return x

    def inference(
        self, tokens: Tensor, prompt_tokens: Tensor, prompt_feat: Tensor, embedding: Tensor, noise: Tensor, *, streaming: bool,
        finalize: bool,
    ) -> Tensor:  # fmt: skip
        """Official CausalMaskedDiffWithDiT.inference (batch 1): mel (1,80,2N) of `tokens` (1,N) after the prompt.

        prompt_feat (1,2P,80); noise (1,80,>=2(P+N)) the fixed buffer. Without `finalize` the last pre_lookahead_len
        tokens are only look-ahead context (their frames are not produced)."""
        seq = torch.cat([prompt_tokens, tokens], dim=1)
        look = self.cfg.pre_lookahead_len
        body, context = (seq, seq[:, :0]) if finalize else (seq[:, :-look], seq[:, -look:])
        mu = self.mu(body, context)
        frames = mu.shape[2]
        cond = torch.zeros(1, self.cfg.output_size, frames)
        cond[:, :, : prompt_feat.shape[1]] = prompt_feat.transpose(1, 2)
        chunk = self.cfg.dit.static_chunk_size if streaming else FULL_ATTENTION
        mel = self.solve(mu, self.speaker(embedding), cond, noise[:, :, :frames], chunk)
        return mel[:, :, prompt_feat.shape[1] :]
