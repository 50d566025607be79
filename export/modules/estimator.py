"""ConditionalDecoder: the flow-matching velocity U-Net (spec §4.5), written with opset-13-exportable ops."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.config import EstimatorConfig

# Large negative additive bias for padded keys; the official mask_to_bias uses the same value.
_MASK_BIAS = -1.0e10


# Above this input Mish(x) == x in float32 (tanh(softplus(20)) is within 1e-16 of 1); clamping keeps exp() finite.
_MISH_LINEAR_FROM = 20.0


class Mish(nn.Module):
    """Mish(x) = x * tanh(softplus(x)), evaluated as x * n / (n + 2) with n = e^x (e^x + 2).

    The same function (tanh(ln(1 + e^x)) = ((1 + e^x)^2 - 1) / ((1 + e^x)^2 + 1)) in elementwise ops that
    ONNX Runtime vectorizes: its Softplus kernel is scalar, and Softplus -> Tanh cost 4.6x this form on the
    estimator's shapes. The Mish op itself only exists from opset 18.
    """

    def forward(self, x: Tensor) -> Tensor:
        e = torch.exp(torch.clamp(x, max=_MISH_LINEAR_FROM))
        n = e * (e + 2.0)
        return x * (n / (n + 2.0))


class SinusoidalPosEmb(nn.Module):
    """Timestep embedding: t (B,) in [0, 1] -> [sin | cos] of 1000 * t * f_k, shape (B, dim)."""

    def __init__(self, dim: int, scale: float = 1000.0) -> None:
        super().__init__()
        self.dim = dim
        self.scale = scale

    def forward(self, t: Tensor) -> Tensor:
        half = self.dim // 2
        step = math.log(10000) / (half - 1)
        freqs = torch.exp(torch.arange(half, device=t.device).float() * -step)
        arg = self.scale * t.unsqueeze(1) * freqs.unsqueeze(0)
        return torch.cat((arg.sin(), arg.cos()), dim=-1)


class TimestepEmbedding(nn.Module):
    """Linear -> SiLU -> Linear on the sinusoidal timestep features."""

    def __init__(self, in_channels: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class Block1D(nn.Module):
    """Conv1d(k3) -> GroupNorm -> Mish on the masked input; output masked again."""

    def __init__(self, dim: int, dim_out: int, groups: int = 8) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Conv1d(dim, dim_out, 3, padding=1), nn.GroupNorm(groups, dim_out), Mish())

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.block(x * mask) * mask


class ResnetBlock1D(nn.Module):
    """Two Block1D with the timestep projection added in between, plus a 1x1 residual conv."""

    def __init__(self, dim: int, dim_out: int, time_emb_dim: int, groups: int = 8) -> None:
        super().__init__()
        self.mlp = nn.Sequential(Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = Block1D(dim, dim_out, groups)
        self.block2 = Block1D(dim_out, dim_out, groups)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, mask: Tensor, temb: Tensor) -> Tensor:
        h = self.block1(x, mask) + self.mlp(temb).unsqueeze(-1)
        return self.block2(h, mask) + self.res_conv(x * mask)


class Downsample1D(nn.Module):
    """Strided conv halving the time axis: M -> ceil(M / 2)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class Upsample1D(nn.Module):
    """Transposed conv doubling the time axis: M2 -> 2 * M2."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(channels, channels, 4, stride=2, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class Attention(nn.Module):
    """Multi-head self-attention as MatMul -> scale -> add bias -> Softmax -> MatMul (no SDPA: opset 13)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.head_dim = head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def _split(self, x: Tensor) -> Tensor:
        return x.reshape(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        """x (B, M, dim); bias (B, 1, 1, M) additive key bias -> (B, M, dim)."""
        q, k, v = self._split(self.to_q(x)), self._split(self.to_k(x)), self._split(self.to_v(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) * (self.head_dim**-0.5) + bias
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], self.heads * self.head_dim)
        return self.to_out[0](out)


class GELUProj(nn.Module):
    """Linear followed by the exact (erf) GELU."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    """dim -> 4*dim (GELU) -> dim; index 1 is the (inactive) dropout slot of the official layout."""

    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(GELUProj(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class BasicTransformerBlock(nn.Module):
    """Pre-LN self-attention + pre-LN feed-forward, both residual (no cross-attention)."""

    def __init__(self, dim: int, heads: int, head_dim: int, act_fn: str) -> None:
        super().__init__()
        if act_fn != "gelu":
            raise ValueError(f"estimator act_fn {act_fn!r} is not supported (only 'gelu')")
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        x = x + self.attn1(self.norm1(x), bias)
        return x + self.ff(self.norm3(x))


def _transformers(cfg: EstimatorConfig, dim: int) -> nn.ModuleList:
    return nn.ModuleList(
        [BasicTransformerBlock(dim, cfg.num_heads, cfg.attention_head_dim, cfg.act_fn) for _ in range(cfg.n_blocks)]
    )


def _run_transformers(blocks: nn.Module, x: Tensor, mask: Tensor) -> Tensor:
    """x (B, C, M), mask (B, 1, M) -> (B, C, M) through the transformer blocks in (B, M, C) layout."""
    bias = ((1.0 - mask) * _MASK_BIAS).unsqueeze(1)
    h = x.transpose(1, 2)
    for block in blocks.children():
        h = block(h, bias)
    return h.transpose(1, 2)


def _parts(stage: nn.Module) -> list[nn.Module]:
    """The [resnet, transformer blocks, (resampler)] entries of one U-Net stage."""
    return list(stage.children())


class ConditionalDecoder(nn.Module):
    """Velocity field v(x, mask, mu, t, spks, cond) of the CFM decoder; every tensor is batch-first, channels-first."""

    def __init__(self, cfg: EstimatorConfig) -> None:
        super().__init__()
        channels = tuple(cfg.channels)
        temb_dim = channels[0] * 4
        self.time_embeddings = SinusoidalPosEmb(cfg.in_channels)
        self.time_mlp = TimestepEmbedding(cfg.in_channels, temb_dim)
        self.down_blocks = nn.ModuleList()
        self.mid_blocks = nn.ModuleList()
        self.up_blocks = nn.ModuleList()
        dim_in = cfg.in_channels
        for i, dim_out in enumerate(channels):
            last = i == len(channels) - 1
            down: nn.Module = nn.Conv1d(dim_out, dim_out, 3, padding=1) if last else Downsample1D(dim_out)
            self.down_blocks.append(nn.ModuleList([ResnetBlock1D(dim_in, dim_out, temb_dim), _transformers(cfg, dim_out), down]))
            dim_in = dim_out
        for _ in range(cfg.num_mid_blocks):
            self.mid_blocks.append(nn.ModuleList([ResnetBlock1D(dim_in, dim_in, temb_dim), _transformers(cfg, dim_in)]))
        ups = (*channels[::-1], channels[0])
        for i in range(len(ups) - 1):
            dim_out = ups[i + 1]
            last = i == len(ups) - 2
            up: nn.Module = nn.Conv1d(dim_out, dim_out, 3, padding=1) if last else Upsample1D(dim_out)
            self.up_blocks.append(nn.ModuleList([ResnetBlock1D(ups[i] * 2, dim_out, temb_dim), _transformers(cfg, dim_out), up]))
        self.final_block = Block1D(ups[-1], ups[-1])
        self.final_proj = nn.Conv1d(ups[-1], cfg.out_channels, 1)

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        """x, mu, cond (B, 80, M); mask (B, 1, M) of 0/1; t (B,); spks (B, 80) -> v (B, 80, M), zero where mask is 0."""
        temb = self.time_mlp(self.time_embeddings(t))
        spk_map = spks.unsqueeze(-1).expand(-1, -1, x.shape[-1])
        h = torch.cat([x, mu, spk_map, cond], dim=1)
        skips: list[Tensor] = []
        masks = [mask]
        for stage in self.down_blocks:
            resnet, blocks, down = _parts(stage)
            m = masks[-1]
            h = _run_transformers(blocks, resnet(h, m, temb), m)
            skips.append(h)
            h = down(h * m)
            masks.append(m[:, :, ::2])
        masks.pop()
        m = masks[-1]
        for stage in self.mid_blocks:
            resnet, blocks = _parts(stage)
            h = _run_transformers(blocks, resnet(h, m, temb), m)
        for stage in self.up_blocks:
            resnet, blocks, up = _parts(stage)
            m = masks.pop()
            skip = skips.pop()
            h = torch.cat([h[:, :, : skip.shape[-1]], skip], dim=1)
            h = _run_transformers(blocks, resnet(h, m, temb), m)
            h = up(h * m)
        h = self.final_block(h, m)
        return self.final_proj(h * m) * mask
