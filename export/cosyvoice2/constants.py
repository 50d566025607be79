"""The manifest constants of a CosyVoice2 bundle, taken from its config (official values where the config is silent)."""

from __future__ import annotations

import math

from export.cosyvoice2.config import ENCODER_WIDTH, NOISE_FRAMES, UP_BLOCKS, CosyVoice2Config
from export.cosyvoice2.modules.estimator import CausalConditionalDecoder
from service.bundle import ModelConstants
from service.families.cosyvoice2.contract import CosyVoice2Constants

# CosyVoice2Model's streaming schedule (cli/model.py): first hop 25 tokens (+ the prompt's pad to a chunk boundary),
# then x2 per chunk up to 4 x 25; the vocoder keeps 8 mel frames (and 8 x 480 source samples) between chunks.
TOKEN_HOP = 25
HOP_SCALE = 2
MEL_CACHE_FRAMES = 8


def model_constants(cfg: CosyVoice2Config) -> ModelConstants:
    """ModelConstants of a CosyVoice2 bundle (llm_num_heads = K/V heads; see CosyVoice2Constants)."""
    q, h = cfg.llm.qwen, cfg.hift
    return ModelConstants(
        sample_rate=cfg.sample_rate,
        token_rate_hz=cfg.flow.token_frame_rate,
        mel_hop_samples=math.prod(h.upsample_rates) * h.istft_hop_len,
        n_mels=cfg.flow.output_size,
        spk_embed_dim=cfg.flow.spk_embed_dim,
        text_vocab_size=q.vocab_size,
        speech_token_size=cfg.llm.speech_token_size,
        eos_token=cfg.llm.speech_token_size,
        llm_num_layers=q.num_layers,
        llm_num_heads=q.num_kv_heads,
        llm_head_dim=q.head_dim,
        llm_model_dim=q.hidden_size,
        top_p=cfg.llm.top_p,
        top_k=cfg.llm.top_k,
        win_size=cfg.llm.win_size,
        tau_r=cfg.llm.tau_r,
        cfg_rate=cfg.flow.inference_cfg_rate,
        t_scheduler=cfg.flow.t_scheduler,
        nb_harmonics=h.nb_harmonics,
        sine_amp=h.nsf_alpha,
        noise_std=h.nsf_sigma,
        voiced_threshold_hz=h.nsf_voiced_threshold,
        istft_n_fft=h.istft_n_fft,
        istft_hop=h.istft_hop_len,
        audio_limit=h.audio_limit,
        upsample_rates=h.upsample_rates,
        token_hop_len=TOKEN_HOP,
        token_max_hop_len=4 * TOKEN_HOP,
        token_overlap_len=0,
        mel_cache_len=MEL_CACHE_FRAMES,
        stream_scale_factor=float(HOP_SCALE),
    )


def cosyvoice2_constants(cfg: CosyVoice2Config) -> CosyVoice2Constants:
    """The chunk and cache geometry of the flow graphs."""
    enc, est = cfg.flow.encoder, cfg.flow.estimator
    tails = sum(CausalConditionalDecoder.tail_channels_of(est))
    return CosyVoice2Constants(
        text_vocab_size=cfg.llm.qwen.vocab_size,
        chunk_tokens=enc.chunk_size,
        token_mel_ratio=cfg.flow.token_mel_ratio,
        pre_lookahead=cfg.flow.pre_lookahead_len,
        encoder_blocks=enc.num_blocks,
        up_blocks=UP_BLOCKS,
        encoder_heads=enc.attention_heads,
        encoder_head_dim=enc.head_dim,
        encoder_dim=ENCODER_WIDTH,
        estimator_blocks=est.transformer_blocks,
        estimator_heads=est.num_heads,
        estimator_head_dim=est.attention_head_dim,
        estimator_tail_channels=tails,
        noise_frames=NOISE_FRAMES,
    )
