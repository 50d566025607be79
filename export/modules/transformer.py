"""wenet/espnet rel-pos encoders (Conformer without conv module, Transformer) with the official key names."""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor, nn

from export.config import EncoderConfig

# Finite fill for masked attention scores: exp() underflows to exactly 0 and a row can never become NaN.
MASKED_SCORE = -1e30

# What every layer of a cached step shares (see step_geometry): gather index and additive mask.
StepGeometry = tuple[Tensor, Tensor]


def espnet_sinusoids(rel: Tensor, dim: int) -> Tensor:
    """espnet rel-pos rows (R, dim) float32 for relative distances `rel` (R,): [sin(r*w_j), cos(r*w_j)] interleaved.

    `w_j = exp(2j * -(ln(10000)/dim))` as EspnetRelPositionalEncoding builds its table, with the exp taken in float64
    and rounded to float32 (service.bundle.relative_pe, the engine's rows, does the same): torch's float32 exp
    differs by a unit in the last place between CPUs (an AVX-512 Intel host and a Zen 4 one, measured), and the
    exporter folds these values into the graphs as constants, so a float32 exp made the export depend on the host
    it ran on. A negative distance gives PE(-r) exactly as the table's second half does.
    """
    exponent = torch.arange(0, dim, 2, dtype=torch.float32) * -(math.log(10000.0) / dim)
    div_term = torch.exp(exponent.to(torch.float64)).to(torch.float32)
    angle = rel.to(torch.float32).unsqueeze(1) * div_term.unsqueeze(0)
    return torch.stack((torch.sin(angle), torch.cos(angle)), dim=-1).flatten(1)


def relative_table(length: int, dim: int, causal: bool) -> Tensor:
    """Positional rows for a full sequence of `length`: distances 0..T-1 (causal) or T-1..-(T-1) (2T-1 rows)."""
    rel = torch.arange(length) if causal else (length - 1) - torch.arange(2 * length - 1)
    return espnet_sinusoids(rel, dim)


def _shift_index(length: int, causal: bool) -> Tensor:
    """(T,T) column of the positional table holding the distance i-j (gather form of espnet rel_shift)."""
    i = torch.arange(length).unsqueeze(1)
    j = torch.arange(length).unsqueeze(0)
    # causal: row r of the table is distance r; |i-j| keeps masked (j > i) entries in range
    return (i - j).abs() if causal else (length - 1) - i + j


class RelPosAttention(nn.Module):
    """espnet RelPositionMultiHeadedAttention (Transformer-XL style, pos_bias_u/v, linear_pos without bias)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.d_k = dim // heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.d_k))

    def _heads(self, x: Tensor) -> Tensor:
        """(B,T,D) -> (B,H,T,DK)."""
        return x.unflatten(-1, (self.heads, self.d_k)).transpose(1, 2)

    def project_pos(self, pe: Tensor) -> Tensor:
        """Positional rows (R,D) -> per-head projections (H,R,DK)."""
        return self.linear_pos(pe).unflatten(-1, (self.heads, self.d_k)).transpose(0, 1)

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """q+u, q+v, k, v, each (B,H,T,DK)."""
        q = self._heads(self.linear_q(x))
        q_u = q + self.pos_bias_u.unsqueeze(1)
        q_v = q + self.pos_bias_v.unsqueeze(1)
        return q_u, q_v, self._heads(self.linear_k(x)), self._heads(self.linear_v(x))

    def _merge(self, ctx: Tensor) -> Tensor:
        """(B,H,T,DK) -> linear_out over (B,T,D)."""
        return self.linear_out(ctx.transpose(1, 2).flatten(2))

    def forward(self, x: Tensor, pe: Tensor, index: Tensor, allowed: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Full-sequence attention over x (B,T,D); pe (R,D) table rows, index (T,T) row of distance i-j.

        `allowed` (T,T) bool masks keys (None = full attention). Returns (out (B,T,D), k, v (B,H,T,DK)).
        """
        q_u, q_v, k, v = self._qkv(x)
        ac = torch.matmul(q_u, k.transpose(-2, -1))
        bd_raw = torch.matmul(q_v, self.project_pos(pe).transpose(-2, -1))
        bd = torch.gather(bd_raw, -1, index.expand_as(ac))
        scores = (ac + bd) / math.sqrt(self.d_k)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, MASKED_SCORE)
        return self._merge(torch.matmul(torch.softmax(scores, dim=-1), v)), k, v

    def step(
        self, x: Tensor, past_k: Tensor, past_v: Tensor, pos: Tensor, geometry: StepGeometry
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Attention of T new positions (x (B,T,D)) over a per-row cache, causal within the new block.

        past_k/past_v (B,H,C,DK): column j of row b is valid iff j < past_len[b]; new token t of row b sits at
        position past_len[b]+t. pos (H,R,DK) = project_pos(pe) with R >= max(past_len)+T. `geometry` holds the
        step's distance index and mask, built once for all layers (`step_geometry`). Returns (out (B,T,D),
        k_new, v_new (B,H,T,DK)); the cache is never concatenated.
        """
        index, bias = geometry
        q_u, q_v, k, v = self._qkv(x)
        ac = torch.cat((torch.matmul(q_u, past_k.transpose(-2, -1)), torch.matmul(q_u, k.transpose(-2, -1))), dim=-1)
        bd = torch.gather(torch.matmul(q_v, pos.transpose(-2, -1)), -1, index)  # (B,H,T,C+T)
        attn = torch.softmax((ac + bd) / math.sqrt(self.d_k) + bias, dim=-1)
        n_past = past_k.shape[2]
        ctx = torch.matmul(attn[..., :n_past], past_v) + torch.matmul(attn[..., n_past:], v)
        return self._merge(ctx), k, v


def step_geometry(past_len: Tensor, n_past: int, n_new: int, heads: int) -> StepGeometry:
    """What every layer of a cached step shares: (index (B,H,T,C+T) int64, bias (B,1,T,C+T) float32).

    index[b,h,t,j] is the row of the positional table holding the distance from new token t of row b (at position
    past_len[b]+t) to key j: cache column j < C, or new token j-C. Masked keys (cache columns >= past_len[b],
    new tokens after t) point at row 0 and get `MASKED_SCORE` in bias, 0 elsewhere; adding it to a score gives
    exactly `MASKED_SCORE` in float32, so the softmax equals the masked_fill form.
    """
    batch = past_len.shape[0]
    cols = torch.arange(n_past)
    steps = torch.arange(n_new)
    start = past_len.view(-1, 1, 1) + steps.view(1, -1, 1)  # (B,T,1) absolute position of each new token
    valid_past = (cols.view(1, 1, -1) < past_len.view(-1, 1, 1)).expand(-1, n_new, -1)  # (B,T,C)
    dist_past = torch.where(valid_past, start - cols.view(1, 1, -1), torch.zeros_like(start))  # (B,T,C)
    dist_new = (steps.view(-1, 1) - steps.view(1, -1)).abs().expand(batch, -1, -1)  # (B,T,T), masked where t' > t
    index = torch.cat((dist_past, dist_new), dim=-1).unsqueeze(1).expand(-1, heads, -1, -1)
    allowed_new = (steps.view(1, -1) <= steps.view(-1, 1)).expand(batch, -1, -1)  # (B,T,T)
    allowed = torch.cat((valid_past, allowed_new), dim=-1).unsqueeze(1)
    bias = torch.zeros_like(allowed, dtype=torch.float32).masked_fill(~allowed, MASKED_SCORE)
    return index, bias


class FeedForward(nn.Module):
    """w_2(act(w_1(x))) with SiLU (Conformer) or ReLU (Transformer)."""

    def __init__(self, dim: int, hidden: int, activation: str) -> None:
        super().__init__()
        self.w_1 = nn.Linear(dim, hidden)
        self.w_2 = nn.Linear(hidden, dim)
        self.act: nn.Module = nn.SiLU() if activation == "silu" else nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(self.act(self.w_1(x)))


class RelPosLayer(nn.Module):
    """Pre-LN encoder layer: x + MHA(LN(x)), then x + FFN(LN(x)); LayerNorm eps 1e-12.

    Conformer layers name their norms `norm_mha`/`norm_ff`, transformer layers `norm1`/`norm2`.
    """

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        dim = cfg.output_size
        self.self_attn = RelPosAttention(dim, cfg.attention_heads)
        self.feed_forward = FeedForward(dim, cfg.linear_units, cfg.activation)
        self._norm_names = ("norm_mha", "norm_ff") if cfg.kind == "conformer" else ("norm1", "norm2")
        for name in self._norm_names:
            self.add_module(name, nn.LayerNorm(dim, eps=1e-12))

    def _norm(self, which: int, x: Tensor) -> Tensor:
        norm = self.get_submodule(self._norm_names[which])
        return norm(x)

    def forward(self, x: Tensor, pe: Tensor, index: Tensor, allowed: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Full sequence; returns (x, k, v) with k, v (B,H,T,DK) after projection."""
        att, k, v = self.self_attn(self._norm(0, x), pe, index, allowed)
        x = x + att
        return x + self.feed_forward(self._norm(1, x)), k, v

    def step(
        self, x: Tensor, past_k: Tensor, past_v: Tensor, pos: Tensor, geometry: StepGeometry
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Cached step (see RelPosAttention.step); returns (x, k_new, v_new)."""
        att, k, v = self.self_attn.step(self._norm(0, x), past_k, past_v, pos, geometry)
        x = x + att
        return x + self.feed_forward(self._norm(1, x)), k, v


class InputLayer(nn.Module):
    """wenet LinearNoSubsampling ('linear': Linear, LN) or LegacyLinearNoSubsampling (+ReLU), then x * sqrt(d)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        dim = cfg.output_size
        layers: list[nn.Module] = [nn.Linear(cfg.input_size, dim), nn.LayerNorm(dim, eps=1e-5), nn.Dropout(0.0)]
        if cfg.input_layer == "linear_legacy":
            layers.append(nn.ReLU())
        elif cfg.input_layer != "linear":
            raise ValueError(f"unsupported input_layer {cfg.input_layer!r}")
        self.out = nn.Sequential(*layers)
        self.xscale = math.sqrt(dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(x) * self.xscale


class RelPosEncoder(nn.Module):
    """wenet BaseEncoder (ConformerEncoder/TransformerEncoder) with espnet rel-pos attention; official key names.

    Keys: embed.out.{0,1}.*, encoders.N.*, after_norm.*. Positions are generated from the sequence length.
    """

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = InputLayer(cfg)
        self.encoders = nn.ModuleList(RelPosLayer(cfg) for _ in range(cfg.num_blocks))
        self.after_norm = nn.LayerNorm(cfg.output_size, eps=1e-5)

    def layers(self) -> list[RelPosLayer]:
        """The encoder blocks, typed."""
        return [cast(RelPosLayer, layer) for layer in self.encoders]

    def forward(self, xs: Tensor) -> Tensor:
        """xs (B,T,input_size) -> (B,T,output_size); causal iff cfg.causal."""
        return self.forward_kv(xs)[0]

    def forward_kv(self, xs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Full sequence; also returns the per-layer keys/values (NL,B,H,T,DK) a cache would hold."""
        x = self.embed(xs)
        length = x.shape[1]
        pe = relative_table(length, self.cfg.output_size, self.cfg.causal)
        index = _shift_index(length, self.cfg.causal)
        allowed = None
        if self.cfg.causal:
            steps = torch.arange(length)
            allowed = steps.view(1, -1) <= steps.view(-1, 1)
        ks, vs = [], []
        for layer in self.layers():
            x, k, v = layer(x, pe, index, allowed)
            ks.append(k)
            vs.append(v)
        return self.after_norm(x), torch.stack(ks), torch.stack(vs)

    def project_positions(self, pe: Tensor) -> Tensor:
        """pe (R,D) rows for distances 0..R-1 -> (NL,H,R,DK) per-layer linear_pos projections."""
        return torch.stack([layer.self_attn.project_pos(pe) for layer in self.layers()])

    def step(
        self, xs: Tensor, past_len: Tensor, past_k: list[Tensor], past_v: list[Tensor], pos: list[Tensor]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Cached causal step over new inputs xs (B,T,input_size) (see RelPosAttention.step).

        Returns (ys (B,T,D) after after_norm, new_k, new_v (NL,B,H,T,DK)).
        """
        x = self.embed(xs)
        geometry = step_geometry(past_len, past_k[0].shape[2], x.shape[1], self.layers()[0].self_attn.heads)
        ks, vs = [], []
        for i, layer in enumerate(self.layers()):
            x, k, v = layer.step(x, past_k[i], past_v[i], pos[i], geometry)
            ks.append(k)
            vs.append(v)
        return self.after_norm(x), torch.stack(ks), torch.stack(vs)
