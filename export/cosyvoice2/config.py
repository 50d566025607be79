"""Read a CosyVoice2 checkpoint's cosyvoice2.yaml and CosyVoice-BlankEN/config.json into typed model configs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from export.config import ConfigError, HiFTConfig, expect_class, hift_config, need, read_yaml
from export.qwen2_config import QWEN_CONFIG, QWEN_DIR, QwenConfig, read_qwen_config

YAML_NAME = "cosyvoice2.yaml"
# Fixed by the official classes, not by the yaml: UpsampleConformerEncoder builds 4 up-sampled conformer blocks,
# a stride-2 Upsample1D and a PreLookaheadLayer of 512 channels; CausalConditionalCFM draws 50 * 300 noise frames.
UP_BLOCKS = 4
UP_STRIDE = 2
ENCODER_WIDTH = 512
NOISE_FRAMES = 50 * 300
LOOK_AHEAD = 3  # UpsampleConformerEncoder's PreLookaheadLayer is built with pre_lookahead_len=3 whatever the yaml says


@dataclass(frozen=True)
class LLMConfig:
    llm_input_size: int
    llm_output_size: int
    speech_token_size: int
    qwen: QwenConfig
    top_p: float
    top_k: int
    win_size: int
    tau_r: float

    @property
    def vocab_out(self) -> int:
        """Decoder classes: speech tokens + EOS + two more stop tokens (official Qwen2LM)."""
        return self.speech_token_size + 3


@dataclass(frozen=True)
class EncoderConfig:
    """UpsampleConformerEncoder (rel-pos espnet attention, no conv module, no macaron)."""

    input_size: int
    output_size: int
    attention_heads: int
    linear_units: int
    num_blocks: int
    chunk_size: int  # static_chunk_size in tokens (x UP_STRIDE for the up-sampled blocks)

    @property
    def head_dim(self) -> int:
        return self.output_size // self.attention_heads


@dataclass(frozen=True)
class EstimatorConfig:
    """CausalConditionalDecoder (one U-Net level: causal convs, no down/up-sampling)."""

    in_channels: int
    out_channels: int
    channels: int
    attention_head_dim: int
    n_blocks: int
    num_mid_blocks: int
    num_heads: int
    static_chunk_size: int  # frames

    @property
    def transformer_blocks(self) -> int:
        return self.n_blocks * (2 + self.num_mid_blocks)

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.attention_head_dim


@dataclass(frozen=True)
class FlowConfig:
    input_size: int
    output_size: int
    spk_embed_dim: int
    vocab_size: int
    token_frame_rate: int
    token_mel_ratio: int
    pre_lookahead_len: int
    encoder: EncoderConfig
    estimator: EstimatorConfig
    inference_cfg_rate: float
    t_scheduler: str


@dataclass(frozen=True)
class CosyVoice2Config:
    sample_rate: int
    llm: LLMConfig
    flow: FlowConfig
    hift: HiFTConfig


def _llm(node: Any, qwen: QwenConfig) -> LLMConfig:
    node = expect_class(node, "Qwen2LM", "llm")
    sampling = node.get("sampling", {})
    cfg = LLMConfig(
        llm_input_size=int(need(node, "llm_input_size", "llm")),
        llm_output_size=int(need(node, "llm_output_size", "llm")),
        speech_token_size=int(need(node, "speech_token_size", "llm")),
        qwen=qwen,
        top_p=float(sampling.get("top_p", 0.8)),
        top_k=int(sampling.get("top_k", 25)),
        win_size=int(sampling.get("win_size", 10)),
        tau_r=float(sampling.get("tau_r", 0.1)),
    )
    if cfg.llm_input_size != qwen.hidden_size or cfg.llm_output_size != qwen.hidden_size:
        raise ConfigError(f"llm: llm_input_size/llm_output_size must equal the Qwen2 hidden size {qwen.hidden_size}")
    return cfg


def _encoder(node: Any) -> EncoderConfig:
    node = expect_class(node, "UpsampleConformerEncoder", "flow.encoder")
    for key, want in (
        ("pos_enc_layer_type", "rel_pos_espnet"),
        ("selfattention_layer_type", "rel_selfattn"),
        ("input_layer", "linear"),
    ):
        if node.get(key, want) != want:
            raise ConfigError(f"flow.encoder: {key}={node.get(key)!r} is not supported (only {want!r})")
    if node.get("use_cnn_module", True) or node.get("macaron_style", True) or not node.get("normalize_before", True):
        raise ConfigError("flow.encoder: only use_cnn_module=False, macaron_style=False, normalize_before=True are supported")
    cfg = EncoderConfig(
        input_size=int(need(node, "input_size", "flow.encoder")),
        output_size=int(node.get("output_size", 256)),
        attention_heads=int(node.get("attention_heads", 4)),
        linear_units=int(node.get("linear_units", 2048)),
        num_blocks=int(node.get("num_blocks", 6)),
        chunk_size=int(node.get("static_chunk_size", 0)),
    )
    if cfg.output_size != ENCODER_WIDTH or cfg.input_size != ENCODER_WIDTH:
        raise ConfigError(f"flow.encoder: input_size and output_size must be {ENCODER_WIDTH} (the official layers are fixed)")
    if cfg.chunk_size < 1:
        raise ConfigError("flow.encoder: static_chunk_size must be >= 1 (the streaming chunk in tokens)")
    return cfg


def _estimator(node: Any) -> EstimatorConfig:
    where = "flow.decoder.estimator"
    est = expect_class(node, "CausalConditionalDecoder", where)
    channels = [int(x) for x in est.get("channels", [256, 256])]
    if len(channels) != 1:
        raise ConfigError(f"{where}: channels {channels} has {len(channels)} levels; only one (no down/up-sampling) is supported")
    if est.get("act_fn", "snake") != "gelu":
        raise ConfigError(f"{where}: act_fn {est.get('act_fn')!r} is not supported (only 'gelu')")
    if int(est.get("num_decoding_left_chunks", 2)) >= 0:
        raise ConfigError(f"{where}: num_decoding_left_chunks must be < 0 (attention over every left chunk)")
    return EstimatorConfig(
        in_channels=int(need(est, "in_channels", where)),
        out_channels=int(need(est, "out_channels", where)),
        channels=channels[0],
        attention_head_dim=int(est.get("attention_head_dim", 64)),
        n_blocks=int(est.get("n_blocks", 1)),
        num_mid_blocks=int(est.get("num_mid_blocks", 2)),
        num_heads=int(est.get("num_heads", 4)),
        static_chunk_size=int(est.get("static_chunk_size", 50)),
    )


def _flow(node: Any) -> FlowConfig:
    node = expect_class(node, "CausalMaskedDiffWithXvec", "flow")
    dec = expect_class(need(node, "decoder", "flow"), "CausalConditionalCFM", "flow.decoder")
    cfm = dec.get("cfm_params", {})
    cfm = cfm.get("content", cfm)
    cfg = FlowConfig(
        input_size=int(need(node, "input_size", "flow")),
        output_size=int(need(node, "output_size", "flow")),
        spk_embed_dim=int(node.get("spk_embed_dim", 192)),
        vocab_size=int(need(node, "vocab_size", "flow")),
        token_frame_rate=int(node.get("input_frame_rate", 25)),
        token_mel_ratio=int(node.get("token_mel_ratio", 2)),
        pre_lookahead_len=int(node.get("pre_lookahead_len", 3)),
        encoder=_encoder(need(node, "encoder", "flow")),
        estimator=_estimator(need(dec, "estimator", "flow.decoder")),
        inference_cfg_rate=float(cfm.get("inference_cfg_rate", 0.7)),
        t_scheduler=str(cfm.get("t_scheduler", "cosine")),
    )
    if cfg.pre_lookahead_len != LOOK_AHEAD:
        raise ConfigError(f"flow: pre_lookahead_len {cfg.pre_lookahead_len} must be {LOOK_AHEAD} (the look-ahead layer's)")
    if cfg.token_mel_ratio != UP_STRIDE:
        raise ConfigError(f"flow: token_mel_ratio {cfg.token_mel_ratio} must equal the encoder's up-sampling stride {UP_STRIDE}")
    if cfg.output_size != 80 or cfg.estimator.out_channels != cfg.output_size:
        raise ConfigError("flow: output_size and the estimator's out_channels must be 80 (the official noise has 80 channels)")
    if cfg.estimator.static_chunk_size != cfg.encoder.chunk_size * cfg.token_mel_ratio:
        raise ConfigError("flow: the estimator's static_chunk_size must be the encoder's chunk_size x token_mel_ratio")
    if cfg.t_scheduler != "cosine":
        raise ConfigError(f"flow: t_scheduler {cfg.t_scheduler!r} is not supported (only 'cosine')")
    return cfg


def load_config(model_dir: Path, qwen_config: Path | None = None) -> CosyVoice2Config:
    """Parse `model_dir/cosyvoice2.yaml` and the Qwen2 config (default `model_dir/CosyVoice-BlankEN/config.json`).

    Raises ConfigError naming the file and the key for anything our modules cannot express.
    """
    path = model_dir / YAML_NAME
    root = read_yaml(path)
    qwen = read_qwen_config(qwen_config or model_dir / QWEN_DIR / QWEN_CONFIG)
    try:
        sample_rate = int(root.get("sample_rate", 24000))
        return CosyVoice2Config(
            sample_rate=sample_rate,
            llm=_llm(need(root, "llm", str(path)), qwen),
            flow=_flow(need(root, "flow", str(path))),
            hift=hift_config(need(root, "hift", str(path)), sample_rate),
        )
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: unmappable yaml: {type(e).__name__}: {e}") from e
