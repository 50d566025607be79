"""UpsampleConformerEncoder (CosyVoice2 flow encoder) as chunk calls with explicit caches, official key names."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from export.config import EncoderConfig as LayerConfig
from export.cosyvoice2.config import UP_BLOCKS, UP_STRIDE, EncoderConfig
from export.modules.chunk_causal import CONV_TAIL, PreLookaheadLayer, chunk_allowed
from export.modules.transformer import MASKED_SCORE, InputLayer, RelPosAttention, RelPosLayer, espnet_sinusoids


class ChunkAttention(RelPosAttention):
    """espnet rel-pos attention of new positions over cached keys/values and each other, under a chunk mask."""

    def chunk_step(self, x: Tensor, past_k: Tensor, past_v: Tensor, chunk: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B,T,D) at positions C..C+T-1 after past_k/past_v (B,H,C,DK); returns (out, k, v (B,H,T,DK)).

        The positional term of query i and key j uses the espnet sinusoid of the distance (C+i)-j, which spans
        -(T-1)..C+T-1; the table is built and projected for exactly those C+2T-1 distances.
        """
        q_u, q_v, k, v = self._qkv(x)
        n_past, n_new = past_k.shape[2], x.shape[1]
        rel = torch.arange(n_past + n_new - 1, -n_new, -1)  # row r holds distance C+T-1-r
        bd_raw = torch.matmul(q_v, self.project_pos(espnet_sinusoids(rel, x.shape[-1])).transpose(-2, -1))
        steps = torch.arange(n_new).view(-1, 1)
        index = (n_new - 1) - steps + torch.arange(n_past + n_new).view(1, -1)  # row of distance (C+i)-j
        bd = torch.gather(bd_raw, -1, index.expand(x.shape[0], self.heads, -1, -1))
        ac = torch.cat((torch.matmul(q_u, past_k.transpose(-2, -1)), torch.matmul(q_u, k.transpose(-2, -1))), dim=-1)
        scores = (ac + bd) / math.sqrt(self.d_k)
        scores = scores.masked_fill(~chunk_allowed(n_past, n_new, chunk), MASKED_SCORE)
        attn = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(attn[..., :n_past], past_v) + torch.matmul(attn[..., n_past:], v)
        return self._merge(ctx), k, v


class ChunkLayer(RelPosLayer):
    """Pre-LN conformer layer (no conv module, no macaron): x + MHA(LN(x)), then x + FFN(LN(x))."""

    def __init__(self, cfg: LayerConfig) -> None:
        super().__init__(cfg)
        self.self_attn = ChunkAttention(cfg.output_size, cfg.attention_heads)

    def chunk_step(self, x: Tensor, past_k: Tensor, past_v: Tensor, chunk: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        att, k, v = cast(ChunkAttention, self.self_attn).chunk_step(self._norm(0, x), past_k, past_v, chunk)
        x = x + att
        return x + self.feed_forward(self._norm(1, x)), k, v


class Upsample(nn.Module):
    """Official Upsample1D: nearest x stride, left-padded (2 * stride) conv of kernel 2 * stride + 1."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, 2 * stride + 1)

    def chunk_step(self, x: Tensor, cache: Tensor) -> tuple[Tensor, Tensor]:
        """x (B,T,D) token-rate after the cached (B,D,2) last two positions -> (B,stride*T,D), new cache."""
        seq = torch.cat((cache, x.transpose(1, 2)), dim=2)
        up = torch.repeat_interleave(seq, self.stride, dim=2)
        return self.conv(up).transpose(1, 2), seq[:, :, -CONV_TAIL:]


@dataclass
class EncoderCache:
    """What the encoder keeps between chunk calls (all zero-length / zeros at the start of a sequence)."""

    look_ahead: Tensor  # (B,D,2) conv1 outputs before the next chunk
    up: Tensor  # (B,D,2) token-rate block outputs before the next chunk
    enc_k: list[Tensor]  # per token-rate block (B,H,C,DK)
    enc_v: list[Tensor]
    up_k: list[Tensor]  # per up-sampled block (B,H,2C,DK)
    up_v: list[Tensor]


class UpsampleConformerEncoder(nn.Module):
    """embed -> look-ahead layer -> conformer blocks -> up-sample x2 -> up_embed -> conformer blocks -> after_norm.

    Keys: embed.out.*, pre_lookahead_layer.conv{1,2}, encoders.N.*, up_layer.conv, up_embed.out.*, up_encoders.N.*,
    after_norm. Attention runs under chunk masks (chunk_size tokens, x2 after up-sampling) in streaming calls.
    """

    def __init__(self, cfg: EncoderConfig, look_ahead: int) -> None:
        super().__init__()
        self.cfg = cfg
        layer = LayerConfig(
            kind="conformer",
            input_size=cfg.input_size,
            output_size=cfg.output_size,
            attention_heads=cfg.attention_heads,
            linear_units=cfg.linear_units,
            num_blocks=cfg.num_blocks,
            input_layer="linear",
            causal=False,
        )
        self.embed = InputLayer(layer)
        self.pre_lookahead_layer = PreLookaheadLayer(cfg.output_size, cfg.output_size, look_ahead)
        self.encoders = nn.ModuleList(ChunkLayer(layer) for _ in range(cfg.num_blocks))
        self.up_layer = Upsample(cfg.output_size, UP_STRIDE)
        self.up_embed = InputLayer(layer)
        self.up_encoders = nn.ModuleList(ChunkLayer(layer) for _ in range(UP_BLOCKS))
        self.after_norm = nn.LayerNorm(cfg.output_size, eps=1e-5)

    def empty_cache(self, batch: int = 1) -> EncoderCache:
        cfg = self.cfg

        def kv(n: int) -> list[Tensor]:
            return [torch.zeros(batch, cfg.attention_heads, 0, cfg.head_dim) for _ in range(n)]

        tail = torch.zeros(batch, cfg.output_size, CONV_TAIL)
        return EncoderCache(tail, tail.clone(), kv(cfg.num_blocks), kv(cfg.num_blocks), kv(UP_BLOCKS), kv(UP_BLOCKS))

    def chunk_step(
        self, x: Tensor, context: Tensor, chunk: Tensor, cache: EncoderCache
    ) -> tuple[Tensor, EncoderCache, tuple[Tensor, Tensor, Tensor, Tensor]]:
        """New token features x (B,T,512) (input embeddings) with look-ahead `context` (B,K,512), K in 0..3.

        `chunk` (1,) int64: tokens per attention chunk (a huge value: full attention, the non-streaming mode).
        Returns (h (B,2T,512), the cache's new conv tails in a new EncoderCache whose K/V lists are unchanged,
        (enc_k, enc_v (NB,B,H,T,DK), up_k, up_v (4,B,H,2T,DK)) of the new positions).
        """
        xs, look_ahead = self.pre_lookahead_layer.chunk_step(self.embed(x), self.embed(context), cache.look_ahead)
        enc_k, enc_v = [], []
        for i, layer in enumerate(cast(list[ChunkLayer], list(self.encoders))):
            xs, k, v = layer.chunk_step(xs, cache.enc_k[i], cache.enc_v[i], chunk)
            enc_k.append(k)
            enc_v.append(v)
        ups, up_tail = self.up_layer.chunk_step(xs, cache.up)
        ups = self.up_embed(ups)
        up_k, up_v = [], []
        for i, layer in enumerate(cast(list[ChunkLayer], list(self.up_encoders))):
            ups, k, v = layer.chunk_step(ups, cache.up_k[i], cache.up_v[i], chunk * UP_STRIDE)
            up_k.append(k)
            up_v.append(v)
        tails = EncoderCache(look_ahead, up_tail, cache.enc_k, cache.enc_v, cache.up_k, cache.up_v)
        return self.after_norm(ups), tails, (torch.stack(enc_k), torch.stack(enc_v), torch.stack(up_k), torch.stack(up_v))
