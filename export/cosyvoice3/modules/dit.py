"""The Fun-CosyVoice3 flow estimator: the DiT (official cosyvoice/flow/DiT) as chunk calls with explicit caches.

A chunk call takes the new frames, where the first of them stands in the sequence (`start`, for the rotary positions),
the two position-embedding convolutions' last inputs and every block's keys and values of the frames before; it returns
the velocity and what the caches gain. The same call over a whole sequence (empty caches, `chunk` huge) is the
official non-streaming estimator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.cosyvoice3.config import CONV_POS_GROUPS, CONV_POS_KERNEL, TIME_FREQ_DIM, DiTConfig
from export.modules.chunk_causal import attend_cached, chunk_allowed
from export.modules.estimator import Mish, SinusoidalPosEmb

MASK_BIAS = -1.0e10  # additive score of a key a query may not see
LN_EPS = 1e-6
ROPE_BASE = 10000.0


def layer_norm(x: Tensor, dim: int) -> Tensor:
    """LayerNorm over the last axis (`dim` values) without affine weights (eps 1e-6), as the DiT's norms."""
    return F.layer_norm(x, (dim,), eps=LN_EPS)


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x-transformers apply_rotary_pos_emb on the first cos.shape[-1] features of x (B,M,D), interleaved pairs; cos,
    sin (M,R). Only those features are rotated (the DiT's q and k before the head split: head 0 only)."""
    rot = cos.shape[-1]
    head, tail = x[..., :rot], x[..., rot:]
    pairs = head.reshape(*head.shape[:-1], rot // 2, 2)
    halves = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).reshape(head.shape)
    return torch.cat((head * cos + halves * sin, tail), dim=-1)


class TimestepEmbedding(nn.Module):
    """Sinusoidal features of t (256, scale 1000) -> Linear -> SiLU -> Linear (`time_mlp.0`, `time_mlp.2`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.time_embed = SinusoidalPosEmb(TIME_FREQ_DIM)
        self.time_mlp = nn.Sequential(nn.Linear(TIME_FREQ_DIM, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        return cast(Tensor, self.time_mlp(self.time_embed(t)))


class CausalConvPositionEmbedding(nn.Module):
    """Two grouped convolutions (kernel 31, 16 groups), each after kernel - 1 frames of left context, with Mish."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, CONV_POS_KERNEL, groups=CONV_POS_GROUPS), Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, CONV_POS_KERNEL, groups=CONV_POS_GROUPS), Mish())

    def chunk_step(self, x: Tensor, tails: Tensor) -> tuple[Tensor, Tensor]:
        """x (B,M,D) after tails (B,2D,30): each convolution's last inputs. Returns (out (B,M,D), new tails)."""
        dim, keep = x.shape[-1], CONV_POS_KERNEL - 1
        seq1 = torch.cat((tails[:, :dim], x.transpose(1, 2)), dim=2)
        seq2 = torch.cat((tails[:, dim:], self.conv1(seq1)), dim=2)
        out = self.conv2(seq2).transpose(1, 2)
        return out, torch.cat((seq1[:, :, -keep:], seq2[:, :, -keep:]), dim=1)


class InputEmbedding(nn.Module):
    """proj([x, cond, mu, spks]) (320 -> D) plus the causal convolutional position embedding."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * cfg.mel_dim + cfg.mu_dim + cfg.spk_dim, cfg.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(cfg.dim)

    def chunk_step(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor, tails: Tensor) -> tuple[Tensor, Tensor]:
        """x, cond, mu (B,M,80), spks (B,80) -> (B,M,D), new tails."""
        h = self.proj(torch.cat((x, cond, mu, spks.unsqueeze(1).expand(-1, x.shape[1], -1)), dim=-1))
        pos, tails = self.conv_pos_embed.chunk_step(h, tails)
        return pos + h, tails


class AdaLayerNormZero(nn.Module):
    """Six modulations from SiLU(t): the attention input's shift/scale/gate and the feed-forward's."""

    def __init__(self, dim: int, parts: int = 6) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * parts)
        self.parts = parts

    def modulations(self, t: Tensor) -> tuple[Tensor, ...]:
        return tuple(m.unsqueeze(1) for m in torch.chunk(self.linear(F.silu(t)), self.parts, dim=1))


class DiTAttention(nn.Module):
    """Self-attention of new frames over cached keys/values and each other, rotary positions on q and k (`to_q`,
    `to_k`, `to_v`, `to_out.0` with biases, as the official Attention)."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.dim_head
        self.to_q = nn.Linear(cfg.dim, cfg.inner_dim)
        self.to_k = nn.Linear(cfg.dim, cfg.inner_dim)
        self.to_v = nn.Linear(cfg.dim, cfg.inner_dim)
        self.to_out = nn.ModuleList([nn.Linear(cfg.inner_dim, cfg.dim), nn.Dropout(0.0)])

    def _split(self, x: Tensor) -> Tensor:
        return x.reshape(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def chunk_step(
        self, x: Tensor, past_k: Tensor, past_v: Tensor, bias: Tensor, rope: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x (B,M,D); past_k/past_v (B,H,C,DK); bias (M,C+M) -> (out (B,M,D), k, v (B,H,M,DK), k rotated)."""
        q, k = rotate_pairs(self.to_q(x), *rope), rotate_pairs(self.to_k(x), *rope)
        q, k, v = self._split(q), self._split(k), self._split(self.to_v(x))
        out = attend_cached(q, k, v, past_k, past_v, bias, self.head_dim**-0.5)
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], self.heads * self.head_dim)
        return self.to_out[0](out), k, v


class FeedForward(nn.Module):
    """Linear -> GELU(tanh) -> Linear (`ff.0.0`, `ff.2`)."""

    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        inner = dim * mult
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")), nn.Dropout(0.0), nn.Linear(inner, dim)
        )

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.ff(x))


class DiTBlock(nn.Module):
    """AdaLN-zero modulated attention and feed-forward, each with a gated residual."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.dim = cfg.dim
        self.attn_norm = AdaLayerNormZero(cfg.dim)
        self.attn = DiTAttention(cfg)
        self.ff = FeedForward(cfg.dim, cfg.ff_mult)

    def chunk_step(
        self, x: Tensor, t: Tensor, past_k: Tensor, past_v: Tensor, bias: Tensor, rope: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, Tensor, Tensor]:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm.modulations(t)
        att, k, v = self.attn.chunk_step(layer_norm(x, self.dim) * (1 + scale_msa) + shift_msa, past_k, past_v, bias, rope)
        x = x + gate_msa * att
        x = x + gate_mlp * self.ff(layer_norm(x, self.dim) * (1 + scale_mlp) + shift_mlp)
        return x, k, v


@dataclass
class DiTCache:
    """The position embedding's convolution inputs (B,2D,30) and every block's keys/values (B,H,C,DK) so far."""

    tails: Tensor
    k: list[Tensor]
    v: list[Tensor]


class DiT(nn.Module):
    """Velocity v(x, mu, t, spks, cond) of the CFM, official key names: time_embed, input_embed, rotary_embed.inv_freq,
    transformer_blocks.N, norm_out, proj_out. Frames are the time axis; every frame is valid (no padding mask)."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.time_embed = TimestepEmbedding(cfg.dim)
        self.input_embed = InputEmbedding(cfg)
        self.rotary_embed = nn.Module()
        inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, cfg.dim_head, 2).float() / cfg.dim_head))
        self.rotary_embed.register_buffer("inv_freq", inv_freq)
        self.transformer_blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.depth))
        self.norm_out = AdaLayerNormZero(cfg.dim, parts=2)
        self.proj_out = nn.Linear(cfg.dim, cfg.mel_dim)

    def empty_cache(self, batch: int = 1) -> DiTCache:
        cfg = self.cfg
        kv = [torch.zeros(batch, cfg.heads, 0, cfg.dim_head) for _ in range(cfg.depth)]
        return DiTCache(torch.zeros(batch, 2 * cfg.dim, CONV_POS_KERNEL - 1), kv, list(kv))

    def rope(self, start: Tensor, frames: int) -> tuple[Tensor, Tensor]:
        """cos, sin (M, dim_head) of positions start..start+M-1, each frequency twice (interleaved pairs)."""
        positions = (start + torch.arange(frames)).float()
        freqs = positions.unsqueeze(-1) * cast(Tensor, self.rotary_embed.inv_freq).unsqueeze(0)
        freqs = torch.stack((freqs, freqs), dim=-1).reshape(frames, -1)
        return freqs.cos(), freqs.sin()

    def chunk_step(
        self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, chunk: Tensor, start: Tensor, cache: DiTCache
    ) -> tuple[Tensor, DiTCache]:
        """x, mu, cond (B,80,M) of the new frames at positions start.. (start (1,) int64), t (B,), spks (B,80);
        `chunk` (1,) int64 frames per attention chunk (huge: full attention), counted with the cached frames in front
        (their count C and start agree modulo `chunk`). Returns (v (B,80,M), DiTCache of the new tails and the new
        frames' k/v (B,H,M,DK) per block)."""
        temb = self.time_embed(t)
        h, tails = self.input_embed.chunk_step(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks, cache.tails)
        n_past, n_new = cache.k[0].shape[2], x.shape[-1]
        bias = torch.zeros(n_new, n_past + n_new).masked_fill(~chunk_allowed(n_past, n_new, chunk), MASK_BIAS)
        rope = self.rope(start, n_new)
        out = DiTCache(tails, [], [])
        for i, block in enumerate(cast(list[DiTBlock], list(self.transformer_blocks))):
            h, k, v = block.chunk_step(h, temb, cache.k[i], cache.v[i], bias, rope)
            out.k.append(k)
            out.v.append(v)
        scale, shift = self.norm_out.modulations(temb)
        return self.proj_out(layer_norm(h, self.cfg.dim) * (1 + scale) + shift).transpose(1, 2), out
