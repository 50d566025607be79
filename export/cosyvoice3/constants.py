"""The manifest constants of a Fun-CosyVoice3 bundle, taken from its config (official values where the config is silent)."""

from __future__ import annotations

import math

from export.cosyvoice3.config import CONV_POS_KERNEL, NOISE_FRAMES, STOP_TOKENS, CosyVoice3Config
from export.cosyvoice3.modules.llm import EOS_OFFSET, SOS_OFFSET, TASK_OFFSET
from export.cosyvoice3.noise import SINE_SAMPLES
from service.bundle import ModelConstants
from service.families.cosyvoice3.contract import CosyVoice3Constants

# CosyVoice2Model.tts (inherited): first hop 25 tokens (+ the prompt's pad to a chunk boundary), then x2 per chunk up to
# 4 x 25; no vocoder overlap (the causal HiFT re-runs over the history in the official stream).
TOKEN_HOP = 25
HOP_SCALE = 2
F0_LOOK_AHEAD = 3  # CausalConvRNNF0Predictor's first conv: kernel 4, 3 frames to the right


def model_constants(cfg: CosyVoice3Config) -> ModelConstants:
    """ModelConstants of a CosyVoice3 bundle (eos_token = the first stop id; see CosyVoice3Constants)."""
    q, h = cfg.llm.qwen, cfg.hift
    return ModelConstants(
        sample_rate=cfg.sample_rate,
        token_rate_hz=cfg.flow.token_frame_rate,
        mel_hop_samples=math.prod(h.upsample_rates) * h.istft_hop_len,
        n_mels=cfg.flow.output_size,
        spk_embed_dim=cfg.flow.spk_embed_dim,
        text_vocab_size=q.vocab_size,
        speech_token_size=cfg.llm.speech_token_size,
        eos_token=cfg.llm.speech_token_size + SOS_OFFSET,
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
        mel_cache_len=0,
        stream_scale_factor=float(HOP_SCALE),
    )


def cosyvoice3_constants(cfg: CosyVoice3Config, noise_offset: int, noise_sha256: str) -> CosyVoice3Constants:
    """The special ids, the flow's chunk and cache geometry, the HiFT's look-ahead and its noise's mt19937 position."""
    flow, dit, size = cfg.flow, cfg.flow.dit, cfg.llm.speech_token_size
    return CosyVoice3Constants(
        eos=size + EOS_OFFSET,
        sos=size + SOS_OFFSET,
        task=size + TASK_OFFSET,
        stop_tokens=STOP_TOKENS,
        text_vocab_size=cfg.llm.qwen.vocab_size,
        chunk_tokens=dit.static_chunk_size // flow.token_mel_ratio,
        token_mel_ratio=flow.token_mel_ratio,
        pre_lookahead=flow.pre_lookahead_len,
        lookahead_channels=flow.lookahead_channels,
        estimator_blocks=dit.depth,
        estimator_heads=dit.heads,
        estimator_head_dim=dit.dim_head,
        estimator_dim=dit.dim,
        conv_pos_kernel=CONV_POS_KERNEL,
        noise_frames=NOISE_FRAMES,
        f0_look_ahead=F0_LOOK_AHEAD,
        conv_pre_look_ahead=cfg.conv_pre_look_right,
        hift_noise_seed=0,
        hift_noise_offset=noise_offset,
        hift_noise_samples=SINE_SAMPLES,
        hift_noise_sha256=noise_sha256,
    )
