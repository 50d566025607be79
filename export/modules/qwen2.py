"""The Qwen2 speech LLM of the Qwen2-based families: the Qwen2 body, a speech embedding and decoder, official `llm.pt`
key names; each family adds how its prefill begins (`prompt`)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.qwen2_config import QwenConfig

# Finite fill for masked attention scores: exp() underflows to exactly 0 and a row can never become NaN.
MASKED_SCORE = -1e30
# The tied output head of the Qwen2 body: in llm.pt, never used by the TTS model (its own llm_decoder scores speech).
UNUSED_KEYS = ("llm.model.lm_head.weight",)


def drop_unused(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """llm.pt without the keys inference never reads (UNUSED_KEYS)."""
    return {k: v for k, v in state.items() if k not in UNUSED_KEYS}


def rope_inv_freq(cfg: QwenConfig) -> Tensor:
    """Rotary inverse frequencies (head_dim / 2,) float32, computed as transformers' default rope does."""
    dim = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))


def rope_tables(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin (B,1,T,DK) for absolute positions (B,T) int64: the halves repeated, as Qwen2RotaryEmbedding."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.view(1, 1, -1)
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    return emb.cos(), emb.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    """Qwen2RMSNorm: x * rsqrt(mean(x^2) + eps) * weight (float32 throughout here)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Attention(nn.Module):
    """Grouped-query attention with rotary positions; q/k/v biased, o_proj without bias."""

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self, x: Tensor, past_k: Tensor, past_v: Tensor, rope: tuple[Tensor, Tensor], bias: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x (B,T,D); past_k/past_v (B,KVH,C,DK); rope cos/sin (B,1,T,DK); bias (B,1,T,C+T) additive mask.

        Returns (out (B,T,D), k, v (B,KVH,T,DK) of the new positions, k after its rotation). The query heads of
        one group share their K/V head through a broadcast, not a copy of the cache.
        """
        batch, steps, _ = x.shape
        group = self.heads // self.kv_heads
        q = self.q_proj(x).view(batch, steps, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, steps, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, steps, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        # (B,H,T,DK) -> (B,KVH,G*T,DK): query head h reads kv head h // G, as transformers' repeat_kv
        q = q.reshape(batch, self.kv_heads, group * steps, self.head_dim)
        scale = 1.0 / math.sqrt(self.head_dim)
        scores = torch.cat((torch.matmul(q, past_k.transpose(-2, -1)), torch.matmul(q, k.transpose(-2, -1))), dim=-1)
        scores = scores.view(batch, self.kv_heads, group, steps, -1) * scale + bias.unsqueeze(1)
        attn = torch.softmax(scores, dim=-1).view(batch, self.kv_heads, group * steps, -1)
        n_past = past_k.shape[2]
        ctx = torch.matmul(attn[..., :n_past], past_v) + torch.matmul(attn[..., n_past:], v)
        ctx = ctx.view(batch, self.heads, steps, self.head_dim).transpose(1, 2).reshape(batch, steps, -1)
        return self.o_proj(ctx), k, v


class MLP(nn.Module):
    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: Tensor, past_k: Tensor, past_v: Tensor, rope: tuple[Tensor, Tensor], bias: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        att, k, v = self.self_attn(self.input_layernorm(x), past_k, past_v, rope, bias)
        x = x + att
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class Qwen2Model(nn.Module):
    """The Qwen2 body (`llm.model.model.*`): token embedding, decoder layers, final norm."""

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]


class _CausalLM(nn.Module):
    """`llm.model`: transformers' Qwen2ForCausalLM without its (unused, dropped at load) lm_head."""

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        self.model = Qwen2Model(cfg)


class _Encoder(nn.Module):
    """`llm`: the official Qwen2Encoder wrapper."""

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        self.model = _CausalLM(cfg)


def step_bias(past_len: Tensor, n_past: int, n_new: int) -> Tensor:
    """Additive mask (B,1,T,C+T): cache column j of row b is seen iff j < past_len[b]; new tokens causally."""
    cols = torch.arange(n_past).view(1, 1, -1)
    steps = torch.arange(n_new)
    valid_past = (cols < past_len.view(-1, 1, 1)).expand(-1, n_new, -1)
    causal = (steps.view(1, -1) <= steps.view(-1, 1)).unsqueeze(0).expand(past_len.shape[0], -1, -1)
    allowed = torch.cat((valid_past, causal), dim=-1).unsqueeze(1)
    return torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, MASKED_SCORE)


class Qwen2SpeechLM(nn.Module, ABC):
    """A Qwen2 body between speech-token embeddings and a speech-token decoder, with one cached step over new inputs.

    Keys: llm.model.model.* (Qwen2 body), llm_decoder, speech_embedding; `llm.model.lm_head.weight` is dropped at load
    (`drop_unused`). A family's subclass builds its own parts, then calls `_init_body`, and defines `prompt`.
    """

    def _init_body(self, qwen: QwenConfig, input_size: int, vocab_out: int, *, decoder_bias: bool) -> None:
        """The Qwen2 body, the decoder (`vocab_out` classes) and the speech embedding, in the official order."""
        self.qwen = qwen
        self.llm = _Encoder(qwen)
        self.llm_decoder = nn.Linear(qwen.hidden_size, vocab_out, bias=decoder_bias)
        self.speech_embedding = nn.Embedding(vocab_out, input_size)
        self.register_buffer("inv_freq", rope_inv_freq(qwen), persistent=False)

    @abstractmethod
    def prompt(self, text_ids: Tensor) -> Tensor:
        """text_ids (B,T) int64 -> (B,T+2,D) = [sos, embed_tokens(text), task] (speech tokens are appended after)."""

    @property
    def body(self) -> Qwen2Model:
        return self.llm.model.model

    def framed(self, text_ids: Tensor, table: Tensor, sos: int, task: int) -> Tensor:
        """[table[sos], embed_tokens(text_ids), table[task]] (B,T+2,D): the text between two rows of a family's table."""
        text = self.body.embed_tokens(text_ids)
        batch = text.shape[0]
        first = table[sos].view(1, 1, -1).expand(batch, 1, -1)
        last = table[task].view(1, 1, -1).expand(batch, 1, -1)
        return torch.cat((first, text, last), dim=1)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """Speech tokens (B,T) int64 (any decoder class) -> LLM inputs (B,T,D)."""
        return self.speech_embedding(tokens)

    def step(self, x: Tensor, past_len: Tensor, past_k: list[Tensor], past_v: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """One cached call over new inputs x (B,T,D): prefill (past 0) or decode (T = 1).

        past_len (B,) int64; past_k/past_v per layer (B,KVH,C,DK), columns >= past_len[b] ignored. New token t of row
        b is at position past_len[b]+t. Returns (logp (B,V) at the last new position, new_k, new_v (NL,B,KVH,T,DK)).
        """
        steps = x.shape[1]
        positions = past_len.view(-1, 1) + torch.arange(steps).view(1, -1)
        rope = rope_tables(positions, cast(Tensor, self.inv_freq))
        bias = step_bias(past_len, past_k[0].shape[2], steps)
        ks, vs = [], []
        for i, layer in enumerate(self.body.decoder_layers()):
            x, k, v = layer(x, past_k[i], past_v[i], rope, bias)
            ks.append(k)
            vs.append(v)
        hidden = self.body.norm(x[:, -1])
        return torch.log_softmax(self.llm_decoder(hidden), dim=-1), torch.stack(ks), torch.stack(vs)

    def empty_cache(self, batch: int = 1) -> list[Tensor]:
        q = self.qwen
        return [torch.zeros(batch, q.num_kv_heads, 0, q.head_dim) for _ in range(q.num_layers)]

    def teacher_force(self, lm_input: Tensor, speech_ids: Tensor) -> Tensor:
        """Prefill lm_input (L,D), then one cached step per forced token -> logp (N+1, V) (row i before token i)."""
        n_layers = self.qwen.num_layers
        logp, cache_k, cache_v = self.step(
            lm_input.unsqueeze(0), torch.zeros(1, dtype=torch.long), self.empty_cache(), self.empty_cache()
        )
        rows = [logp[0]]
        for token in speech_ids.tolist():
            x = self.embed_tokens(torch.tensor([[token]]))
            logp, new_k, new_v = self.step(
                x, torch.tensor([cache_k.shape[3]]), [cache_k[i] for i in range(n_layers)], [cache_v[i] for i in range(n_layers)]
            )
            cache_k = torch.cat((cache_k, new_k), dim=3)
            cache_v = torch.cat((cache_v, new_v), dim=3)
            rows.append(logp[0])
        return torch.stack(rows)
