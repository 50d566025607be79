"""CausalMaskedDiffWithXvec (CosyVoice2 flow) with the official `flow.pt` key names, as a reference for its graphs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.cosyvoice2.config import FlowConfig
from export.cosyvoice2.modules.encoder import UpsampleConformerEncoder
from export.cosyvoice2.modules.estimator import CausalConditionalDecoder
from export.modules.chunk_causal import FULL_ATTENTION
from export.modules.flow import flow_noise, time_span

__all__ = ["FULL_ATTENTION", "CausalMaskedDiffWithXvec", "flow_noise"]


class _CFM(nn.Module):
    """`decoder`: only its estimator holds weights."""

    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        self.estimator = CausalConditionalDecoder(cfg.estimator)


class CausalMaskedDiffWithXvec(nn.Module):
    """input_embedding -> UpsampleConformerEncoder -> encoder_proj = mu; Euler CFM solve with CFG = mel.

    Keys: input_embedding, spk_embed_affine_layer, encoder.*, encoder_proj, decoder.estimator.*.
    """

    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = UpsampleConformerEncoder(cfg.encoder, cfg.pre_lookahead_len)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.output_size)
        self.decoder = _CFM(cfg)

    @property
    def estimator(self) -> CausalConditionalDecoder:
        return self.decoder.estimator

    def speaker(self, embedding: Tensor) -> Tensor:
        """Raw x-vector (B,192) -> spks (B,80) = spk_embed_affine_layer(l2norm(e))."""
        return self.spk_embed_affine_layer(F.normalize(embedding, dim=1))

    def embed(self, tokens: Tensor) -> Tensor:
        """Speech tokens (B,T) int64 (clamped >= 0 like the official) -> encoder inputs (B,T,512)."""
        return self.input_embedding(torch.clamp(tokens, min=0))

    def mu(self, tokens: Tensor, context: Tensor, chunk: int) -> Tensor:
        """mu (B,80,2T) of a whole sequence in one call (no cache): tokens (B,T), look-ahead context (B,K)."""
        h, _, _ = self.encoder.chunk_step(
            self.embed(tokens), self.embed(context), torch.tensor([chunk]), self.encoder.empty_cache(tokens.shape[0])
        )
        return self.encoder_proj(h).transpose(1, 2)

    def velocity(self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, chunk: int) -> Tensor:
        """Estimator over a whole sequence in one call (no cache)."""
        cache = self.estimator.empty_cache(x.shape[0])
        v, _ = self.estimator.chunk_step(x, mu, t, spks, cond, torch.tensor([chunk]), cache)
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
                torch.cat([x, x]),
                torch.cat([mu, zero]),
                t.view(1).expand(2),
                torch.cat([spks, zero_spks]),
                torch.cat([cond, zero]),
                chunk,
            )
            x = x + dt * ((1.0 + cfg_rate) * v[:1] - cfg_rate * v[1:])
            t = t + dt
            if step < n_timesteps:
                dt = t_span[step + 1] - t
        return x

    def inference(
        self,
        tokens: Tensor,
        prompt_tokens: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        noise: Tensor,
        streaming: bool,
        finalize: bool,
    ) -> Tensor:
        """Official CausalMaskedDiffWithXvec.inference (batch 1): mel (1,80,2N) of `tokens` (1,N) after the prompt.

        prompt_feat (1,2P,80); noise (1,80,>=2(P+N)) the fixed buffer. Without `finalize` the last pre_lookahead_len
        tokens are only look-ahead context (their frames are not produced).
        """
        seq = torch.cat([prompt_tokens, tokens], dim=1)
        look = self.cfg.pre_lookahead_len
        body, context = (seq, seq[:, :0]) if finalize else (seq[:, :-look], seq[:, -look:])
        chunk = self.cfg.encoder.chunk_size if streaming else FULL_ATTENTION
        mu = self.mu(body, context, chunk)
        frames = mu.shape[2]
        cond = torch.zeros(1, self.cfg.output_size, frames)
        cond[:, :, : prompt_feat.shape[1]] = prompt_feat.transpose(1, 2)
        chunk_frames = self.cfg.estimator.static_chunk_size if streaming else FULL_ATTENTION
        mel = self.solve(mu, self.speaker(embedding), cond, noise[:, :, :frames], chunk_frames)
        return mel[:, :, prompt_feat.shape[1] :]
