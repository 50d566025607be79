"""The model constants every bundle's manifest carries (a family's own constants are in its manifest section)."""

from __future__ import annotations

from dataclasses import dataclass


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
