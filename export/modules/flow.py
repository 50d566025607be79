"""MaskedDiffWithXvec: token encoder, length regulator and CFM decoder with the official flow.pt key names."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.config import FlowConfig
from export.modules.estimator import ConditionalDecoder, Mish
from export.modules.transformer import RelPosEncoder

# The official flow hard-codes the mel frame rate as 22050 / 256 frames per second.
SAMPLE_RATE = 22050
MEL_HOP = 256
# Head and tail tokens interpolated on their own (= the streaming token overlap), so chunk seams fall on frames.
EDGE_TOKENS = 20
# Frames of noise and mu carried to the next streaming call (= the mel overlap).
CACHE_FRAMES = 34
N_TIMESTEPS = 10


# The chunk-causal flows (CosyVoice2 and later) draw their fixed noise buffer right after seeding every generator with 0.
NOISE_SEED = 0
NOISE_FRAMES = 50 * 300


def flow_noise(n_mels: int = 80, frames: int = NOISE_FRAMES) -> Tensor:
    """The official fixed noise buffer `rand_noise` (1, 80, 15000) of CausalConditionalCFM: torch.randn after seeding
    with 0."""
    return torch.randn(1, n_mels, frames, generator=torch.Generator().manual_seed(NOISE_SEED))


def write_flow_noise(path: Path) -> None:
    """The fixed noise buffer as a bundle file: (80, 15000) float32 .npy."""
    buf = io.BytesIO()
    np.save(buf, flow_noise()[0].numpy().astype(np.float32), allow_pickle=False)
    path.write_bytes(buf.getvalue())


def mel_frames(n_tokens: int, token_rate: int) -> int:
    """Mel frames produced for `n_tokens` speech tokens, with the official float arithmetic."""
    return int(n_tokens / token_rate * SAMPLE_RATE / MEL_HOP)


def time_span(n_timesteps: int, scheduler: str) -> Tensor:
    """Solver time grid (n_timesteps + 1,) float32 from 0 to 1; 'cosine' warps it as 1 - cos(t * pi / 2)."""
    t = torch.linspace(0, 1, n_timesteps + 1, dtype=torch.float32)
    return 1 - torch.cos(t * 0.5 * torch.pi) if scheduler == "cosine" else t


def _interpolate(x: Tensor, size: int) -> Tensor:
    """x (B, T, C) -> (B, C, size), linear, align_corners=False (the official regulator's resampling)."""
    return F.interpolate(x.transpose(1, 2), size=size, mode="linear", align_corners=False)


class InterpolateRegulator(nn.Module):
    """Token-rate features -> mel-rate features: linear interpolation, then a conv/GroupNorm/Mish stack."""

    def __init__(self, channels: int, sampling_ratios: tuple[int, ...]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in sampling_ratios:
            layers += [nn.Conv1d(channels, channels, 3, padding=1), nn.GroupNorm(1, channels), Mish()]
        layers.append(nn.Conv1d(channels, channels, 1))
        self.model = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Conv stack only: x (B, C, M) already at mel rate -> (B, C, M)."""
        return self.model(x)

    def resample(self, h: Tensor, n_frames: int, token_rate: int) -> Tensor:
        """Interpolate h (B, T, C) to (B, C, n_frames); more than 2*EDGE_TOKENS tokens splits head/middle/tail."""
        n_tokens = h.shape[1]
        if n_tokens <= 2 * EDGE_TOKENS:
            return _interpolate(h, n_frames)
        edge = mel_frames(EDGE_TOKENS, token_rate)
        parts = [
            _interpolate(h[:, :EDGE_TOKENS], edge),
            _interpolate(h[:, EDGE_TOKENS:-EDGE_TOKENS], n_frames - 2 * edge),
            _interpolate(h[:, -EDGE_TOKENS:], edge),
        ]
        return torch.cat(parts, dim=2)


class ConditionalCFM(nn.Module):
    """Conditional flow matching decoder: Euler integration of the estimator with classifier-free guidance."""

    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        if cfg.solver != "euler":
            raise ValueError(f"flow solver {cfg.solver!r} is not supported (only 'euler')")
        self.cfg_rate = cfg.inference_cfg_rate
        self.t_scheduler = cfg.t_scheduler
        self.estimator = ConditionalDecoder(cfg.estimator)

    def velocity(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        """CFG velocity for a batch of 1: the estimator runs [conditional, unconditional] as a batch of 2."""
        zeros = torch.zeros_like
        v = self.estimator(
            torch.cat([x, x]),
            torch.cat([mask, mask]),
            torch.cat([mu, zeros(mu)]),
            t.expand(2),
            torch.cat([spks, zeros(spks)]),
            torch.cat([cond, zeros(cond)]),
        )
        return (1.0 + self.cfg_rate) * v[:1] - self.cfg_rate * v[1:]

    def solve(self, noise: Tensor, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, n_timesteps: int) -> Tensor:
        """Integrate from `noise` (1, 80, M) at t=0 to the mel at t=1 over the scheduled grid."""
        span = time_span(n_timesteps, self.t_scheduler)
        x, t, dt = noise, span[:1], span[1] - span[0]
        for step in range(1, n_timesteps + 1):
            x = x + dt * self.velocity(x, mask, mu, t, spks, cond)
            t = t + dt
            if step < n_timesteps:
                dt = span[step + 1] - t
        return x


@dataclass(frozen=True)
class FlowOutput:
    """Everything one SFT flow call produces (torch reference)."""

    mel: Tensor  # (1, 80, M)
    mu: Tensor  # (1, 80, M) conditioning mean after any cache overwrite
    spks: Tensor  # (1, 80)
    cache: Tensor  # (1, 80, CACHE_FRAMES, 2): [noise, mu] of the last frames, for the next streaming call


class MaskedDiffWithXvec(nn.Module):
    """The CosyVoice v1 flow stage: speech tokens + x-vector -> 80-bin log-mel (SFT path: no prompt)."""

    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = RelPosEncoder(cfg.encoder)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.output_size)
        self.length_regulator = InterpolateRegulator(cfg.lr_channels, cfg.lr_sampling_ratios)
        self.decoder = ConditionalCFM(cfg)

    def speaker(self, embedding: Tensor) -> Tensor:
        """Raw x-vector (B, 192) -> spks (B, 80) = affine(l2-normalized embedding)."""
        return self.spk_embed_affine_layer(F.normalize(embedding, dim=1))

    def encode(self, tokens: Tensor) -> Tensor:
        """Speech tokens (B, T) int64, already >= 0, equal-length rows -> h (B, T, 80) at token rate."""
        return self.encoder_proj(self.encoder(self.input_embedding(tokens)))

    def condition(self, tokens: Tensor) -> Tensor:
        """Tokens (1, T) -> mu (1, 80, M): encoder, interpolation to mel_frames(T), conv stack."""
        rate = self.cfg.input_frame_rate
        h = self.encode(tokens.clamp(min=0))
        return self.length_regulator(self.length_regulator.resample(h, mel_frames(tokens.shape[1], rate), rate))

    @torch.no_grad()
    def inference(self, tokens: Tensor, embedding: Tensor, noise: Tensor, cache: Tensor | None = None) -> FlowOutput:
        """SFT flow call. tokens (1, T) int64; embedding (1, 192) raw; noise (1, 80, mel_frames(T)) standard normal.

        `cache` (1, 80, c, 2) from the previous streaming call overwrites the first c frames of noise and mu.
        """
        spks = self.speaker(embedding)
        mu = self.condition(tokens)
        if noise.shape != mu.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} != mu shape {tuple(mu.shape)}")
        noise = noise.clone()
        if cache is not None and cache.shape[2] > 0:
            c = cache.shape[2]
            noise[:, :, :c], mu[:, :, :c] = cache[..., 0], cache[..., 1]
        new_cache = torch.stack([noise[:, :, -CACHE_FRAMES:], mu[:, :, -CACHE_FRAMES:]], dim=-1)
        mask = torch.ones_like(mu[:, :1])
        mel = self.decoder.solve(noise, mu, mask, spks, torch.zeros_like(mu), N_TIMESTEPS)
        return FlowOutput(mel=mel, mu=mu, spks=spks, cache=new_cache)
