"""Model constants a bundle's manifest carries (v1 and CosyVoice2), and the relative positions they imply."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def relative_pe(rows: int, dim: int) -> np.ndarray:
    """Positional rows of the bundle contract: espnet sinusoids (rows, dim) float32 for relative distances 0..rows-1.

    Row r: `pe[r, 2j] = sin(r * w_j)`, `pe[r, 2j+1] = cos(r * w_j)`, `w_j = exp(2j * -(ln(10000)/dim))`; angles are
    float32 products as in torch. The exp is taken in float64 and rounded to float32: that equals torch's float32 exp
    on all but 2-3 of 512 frequencies (numpy's float32 exp differs on ~200), so pe stays within 4e-6 of torch for
    r < 100 and 3e-5 for r < 1000. The exporter (llm_pos inputs) and the engine build rows with this one function.
    """
    if dim % 2:
        raise ValueError(f"positional dimension must be even, got {dim}")
    exponent = np.arange(0, dim, 2, dtype=np.float32) * np.float32(-(math.log(10000.0) / dim))
    w = np.exp(exponent.astype(np.float64)).astype(np.float32)
    angle = np.arange(rows, dtype=np.float32)[:, None] * w[None, :]
    pe = np.empty((rows, dim), dtype=np.float32)
    pe[:, 0::2] = np.sin(angle)
    pe[:, 1::2] = np.cos(angle)
    return pe


@dataclass(frozen=True)
class ModelConstants:
    """Every model fact the runtime needs; sizes come from the checkpoint's cosyvoice.yaml."""

    sample_rate: int = 22050
    token_rate_hz: int = 50
    mel_hop_samples: int = 256
    n_mels: int = 80
    spk_embed_dim: int = 192
    text_vocab_size: int = 51866
    speech_token_size: int = 4096
    eos_token: int = 4096
    # LLM decoder geometry (for the KV cache)
    llm_num_layers: int = 14
    llm_num_heads: int = 16
    llm_head_dim: int = 64
    llm_model_dim: int = 1024
    # sampling (ras_sampling)
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0
    # flow matching
    n_timesteps: int = 10
    cfg_rate: float = 0.7
    t_scheduler: str = "cosine"
    temperature: float = 1.0
    # HiFT
    nb_harmonics: int = 8
    sine_amp: float = 0.1
    noise_std: float = 0.003
    voiced_threshold_hz: float = 10.0
    istft_n_fft: int = 16
    istft_hop: int = 4
    audio_limit: float = 0.99
    upsample_rates: tuple[int, ...] = (8, 8)
    # v1 streaming orchestration
    token_hop_len: int = 100
    token_max_hop_len: int = 200
    token_overlap_len: int = 20
    mel_cache_len: int = 20
    stream_scale_factor: float = 1.0

    @property
    def mel_overlap_len(self) -> int:
        """Mel frames produced by `token_overlap_len` tokens (34 for the official config)."""
        return self.tokens_to_mel_frames(self.token_overlap_len)

    @property
    def source_cache_len(self) -> int:
        """Samples of HiFT source kept between chunks (mel_cache_len * samples per mel frame)."""
        return self.mel_cache_len * self.mel_hop_samples

    def tokens_to_mel_frames(self, n_tokens: int) -> int:
        """Official conversion `int(n / token_rate * sample_rate / hop)` (floors)."""
        return int(n_tokens / self.token_rate_hz * self.sample_rate / self.mel_hop_samples)


@dataclass(frozen=True)
class CosyVoice2Constants:
    """CosyVoice2 facts beyond ModelConstants: stop tokens, the flow's chunk geometry and its cache shapes.

    In a CosyVoice2 manifest ModelConstants reads: llm_num_heads = the LLM's K/V heads (grouped-query attention),
    token_hop_len / token_max_hop_len / stream_scale_factor = the streaming hop schedule (25, 100, 2), mel_cache_len
    = the vocoder's mel overlap (8 frames), token_overlap_len = 0 (no flow overlap: the flow keeps caches).
    """

    stop_tokens: int = 3  # speech_token_size + 0..2 all end the utterance
    text_vocab_size: int = 151936
    chunk_tokens: int = 25  # static_chunk_size: attention chunk of the encoder (x token_mel_ratio for the estimator)
    token_mel_ratio: int = 2
    pre_lookahead: int = 3  # tokens of look-ahead the encoder reads past a chunk
    encoder_blocks: int = 6
    up_blocks: int = 4
    encoder_heads: int = 8
    encoder_head_dim: int = 64
    encoder_dim: int = 512
    conv_tail: int = 2  # left context kept by every causal convolution
    estimator_blocks: int = 56
    estimator_heads: int = 8
    estimator_head_dim: int = 64
    estimator_tail_channels: int = 8256  # sum of the estimator's causal-conv input channels (the `tails` input)
    noise_frames: int = 15000

    def graph_counts(self) -> dict[str, int]:
        """Template counts of V2_GRAPH_IO besides `{i}`."""
        return {"e": self.encoder_blocks, "u": self.up_blocks, "b": self.estimator_blocks}
