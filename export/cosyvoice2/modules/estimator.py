"""CausalConditionalDecoder (the CosyVoice2 flow-matching velocity U-Net) as chunk calls with explicit caches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from export.cosyvoice2.config import EstimatorConfig
from export.modules.chunk_causal import CONV_TAIL, attend_cached, chunk_allowed
from export.modules.estimator import Attention, BasicTransformerBlock, Mish, SinusoidalPosEmb, TimestepEmbedding

_MASK_BIAS = -1.0e10  # the official mask_to_bias value for keys a query may not see


class CausalConv(nn.Conv1d):
    """Conv1d whose kernel - 1 frames of left context come from a cache (official CausalConv1d pads zeros).

    Computed time-first as one matrix product: the kernel's frames side by side (B,T,k*Cin) times the weight
    rearranged to (k*Cin, Cout). The same sums as the convolution, but a MatMul with a constant weight, which the int8
    bundle quantizes (an fp32 Conv ran 3x slower than the int8 MatMul on the full-size shapes; ONNX Runtime's
    ConvInteger was slower still), and no layout change around the LayerNorms that follow.
    """

    def __init__(self, channels_in: int, channels_out: int, kernel_size: int = CONV_TAIL + 1) -> None:
        super().__init__(channels_in, channels_out, kernel_size)

    def chunk_step(self, x: Tensor, tail: Tensor) -> tuple[Tensor, Tensor]:
        """x (B,T,Cin) after tail (B,kernel-1,Cin) -> (B,T,Cout), new tail."""
        seq = torch.cat((tail, x), dim=1)
        return conv_time_first(self, seq), seq[:, -CONV_TAIL:]


def conv_time_first(conv: nn.Conv1d, seq: Tensor) -> Tensor:
    """A valid (unpadded, stride 1) Conv1d on time-first frames seq (B,T+k-1,Cin) -> (B,T,Cout) as one MatMul."""
    k = conv.kernel_size[0]
    # frame t of the output reads seq[t + j] for each kernel tap j; constant slice ends keep the graph shape-free
    stacked = seq if k == 1 else torch.cat([seq[:, j : (j - k + 1) or None] for j in range(k)], dim=2)
    weight = conv.weight.permute(0, 2, 1).reshape(conv.out_channels, k * conv.in_channels)  # [o, j*Cin + c] = w[o, c, j]
    return torch.nn.functional.linear(stacked, weight, conv.bias)


class CausalBlock(nn.Module):
    """CausalConv1d -> LayerNorm over channels -> Mish (`block.0`, `block.2` as the official Sequential), time-first."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.ModuleList([CausalConv(dim, dim_out), nn.Identity(), nn.LayerNorm(dim_out), nn.Identity(), Mish()])

    def chunk_step(self, x: Tensor, tail: Tensor) -> tuple[Tensor, Tensor]:
        conv, _, norm, _, act = self.block
        h, tail = cast(CausalConv, conv).chunk_step(x, tail)
        return act(norm(h)), tail


class CausalResnetBlock(nn.Module):
    """block1 + time projection, block2, plus a 1x1 residual conv (official CausalResnetBlock1D), time-first."""

    def __init__(self, dim: int, dim_out: int, time_emb_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = CausalBlock(dim, dim_out)
        self.block2 = CausalBlock(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def chunk_step(self, x: Tensor, temb: Tensor, tails: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """x (B,T,dim), temb (B,E), tails (B,2,dim) and (B,2,dim_out) -> (B,T,dim_out), new tails."""
        h, tail1 = self.block1.chunk_step(x, tails[0])
        h = h + self.mlp(temb).unsqueeze(1)
        h, tail2 = self.block2.chunk_step(h, tails[1])
        return h + conv_time_first(self.res_conv, x), [tail1, tail2]


class CachedAttention(Attention):
    """Self-attention of new frames over cached keys/values and each other (official diffusers Attention math)."""

    def chunk_step(self, x: Tensor, past_k: Tensor, past_v: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B,T,dim); past_k/past_v (B,H,C,DK); bias (T,C+T) additive -> (out (B,T,dim), k, v (B,H,T,DK))."""
        q, k, v = self._split(self.to_q(x)), self._split(self.to_k(x)), self._split(self.to_v(x))
        out = attend_cached(q, k, v, past_k, past_v, bias, self.head_dim**-0.5)
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], self.heads * self.head_dim)
        return self.to_out[0](out), k, v


class CachedTransformerBlock(BasicTransformerBlock):
    def __init__(self, dim: int, heads: int, head_dim: int, act_fn: str) -> None:
        super().__init__(dim, heads, head_dim, act_fn)
        self.attn1 = CachedAttention(dim, heads, head_dim)

    def chunk_step(self, x: Tensor, past_k: Tensor, past_v: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        att, k, v = cast(CachedAttention, self.attn1).chunk_step(self.norm1(x), past_k, past_v, bias)
        x = x + att
        return x + self.ff(self.norm3(x)), k, v


@dataclass
class EstimatorCache:
    """Left context of every causal conv (in call order) and every transformer block's keys/values so far."""

    tails: list[Tensor]  # (B,2,Cin) each (time-first, as the convolutions read them)
    k: list[Tensor]  # (B,H,C,DK) each
    v: list[Tensor]


class CausalConditionalDecoder(nn.Module):
    """Velocity v(x, mu, t, spks, cond) of the CFM decoder, one U-Net level (the released CosyVoice2 layout).

    Keys as the official estimator: time_mlp, down_blocks.0.{0,1.N,2}, mid_blocks.N.{0,1.M}, up_blocks.0.{0,1.N,2},
    final_block.block.{0,2}, final_proj. Frames are the time axis; every frame is valid (no padding mask).
    """

    def __init__(self, cfg: EstimatorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        ch = cfg.channels
        temb_dim = ch * 4
        self.time_embeddings = SinusoidalPosEmb(cfg.in_channels)
        self.time_mlp = TimestepEmbedding(cfg.in_channels, temb_dim)

        def blocks() -> nn.ModuleList:
            return nn.ModuleList(
                CachedTransformerBlock(ch, cfg.num_heads, cfg.attention_head_dim, "gelu") for _ in range(cfg.n_blocks)
            )

        self.down_blocks = nn.ModuleList(
            [nn.ModuleList([CausalResnetBlock(cfg.in_channels, ch, temb_dim), blocks(), CausalConv(ch, ch)])]
        )
        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([CausalResnetBlock(ch, ch, temb_dim), blocks()]) for _ in range(cfg.num_mid_blocks)
        )
        self.up_blocks = nn.ModuleList([nn.ModuleList([CausalResnetBlock(2 * ch, ch, temb_dim), blocks(), CausalConv(ch, ch)])])
        self.final_block = CausalBlock(ch, ch)
        self.final_proj = nn.Conv1d(ch, cfg.out_channels, 1)

    @staticmethod
    def tail_channels_of(cfg: EstimatorConfig) -> list[int]:
        """Input channels of every causal conv, in the order chunk_step uses their tails."""
        ch, mid = cfg.channels, [cfg.channels] * (2 * cfg.num_mid_blocks)
        return [cfg.in_channels, ch, ch, *mid, 2 * ch, ch, ch, ch]

    def tail_channels(self) -> list[int]:
        return self.tail_channels_of(self.cfg)

    def empty_cache(self, batch: int = 1) -> EstimatorCache:
        cfg = self.cfg
        n = cfg.transformer_blocks
        kv = [torch.zeros(batch, cfg.num_heads, 0, cfg.attention_head_dim) for _ in range(n)]
        return EstimatorCache([torch.zeros(batch, CONV_TAIL, c) for c in self.tail_channels()], kv, list(kv))

    def _stage(
        self,
        x: Tensor,
        temb: Tensor,
        stage: nn.Module,
        cache: EstimatorCache,
        slots: tuple[int, int],
        bias: Tensor,
        out: EstimatorCache,
    ) -> Tensor:
        resnet, blocks = list(stage.children())[:2]
        tail, block = slots
        x, new_tails = cast(CausalResnetBlock, resnet).chunk_step(x, temb, cache.tails[tail : tail + 2])
        out.tails.extend(new_tails)
        h = x
        for j, transformer in enumerate(cast(list[CachedTransformerBlock], list(blocks.children()))):
            h, k, v = transformer.chunk_step(h, cache.k[block + j], cache.v[block + j], bias)
            out.k.append(k)
            out.v.append(v)
        return h

    def chunk_step(
        self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, chunk: Tensor, cache: EstimatorCache
    ) -> tuple[Tensor, EstimatorCache]:
        """x, mu, cond (B,80,T) of the new frames, t (B,), spks (B,80); `chunk` (1,) int64 frames per attention
        chunk (huge: full attention). Returns (v (B,80,T), EstimatorCache of the new tails and the new frames'
        k/v (B,H,T,DK) per block)."""
        temb = self.time_mlp(self.time_embeddings(t))
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]), cond], dim=1).transpose(1, 2)  # (B,T,320)
        n_past, n_new = cache.k[0].shape[2], x.shape[-1]
        bias = torch.zeros(n_new, n_past + n_new).masked_fill(~chunk_allowed(n_past, n_new, chunk), _MASK_BIAS)
        out = EstimatorCache([], [], [])
        nb = self.cfg.n_blocks
        down = cast(nn.ModuleList, self.down_blocks[0])
        h = self._stage(h, temb, down, cache, (0, 0), bias, out)
        skip = h
        h, tail = cast(CausalConv, down[2]).chunk_step(h, cache.tails[2])
        out.tails.append(tail)
        for i, stage in enumerate(self.mid_blocks):
            h = self._stage(h, temb, stage, cache, (3 + 2 * i, nb * (1 + i)), bias, out)
        up = cast(nn.ModuleList, self.up_blocks[0])
        n_tail = 3 + 2 * self.cfg.num_mid_blocks
        h = self._stage(torch.cat([h, skip], dim=2), temb, up, cache, (n_tail, nb * (1 + self.cfg.num_mid_blocks)), bias, out)
        h, tail = cast(CausalConv, up[2]).chunk_step(h, cache.tails[n_tail + 2])
        out.tails.append(tail)
        h, tail = self.final_block.chunk_step(h, cache.tails[n_tail + 3])
        out.tails.append(tail)
        return conv_time_first(self.final_proj, h).transpose(1, 2), out
