"""Read a Fun-CosyVoice3 checkpoint's cosyvoice3.yaml and CosyVoice-BlankEN/config.json into typed model configs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from export.config import ConfigError, HiFTConfig, expect_class, hift_config, need, read_yaml
from export.qwen2_config import QWEN_CONFIG, QWEN_DIR, QwenConfig, read_qwen_config

YAML_NAME = "cosyvoice3.yaml"
# Fixed by the official classes, not by the yaml: CausalConditionalCFM draws 50 * 300 noise frames, the DiT's time
# embedding is sinusoidal over 256 values, CausalConvPositionEmbedding has kernel 31 in 16 groups.
NOISE_FRAMES = 50 * 300
TIME_FREQ_DIM = 256
CONV_POS_KERNEL = 31
CONV_POS_GROUPS = 16
STOP_TOKENS = 200  # CosyVoice3LM: speech_embedding and llm_decoder have speech_token_size + 200 rows, all of them stop


@dataclass(frozen=True)
class LLMConfig:
    llm_input_size: int
    speech_token_size: int
    qwen: QwenConfig
    top_p: float
    top_k: int
    win_size: int
    tau_r: float

    @property
    def vocab_out(self) -> int:
        """Decoder classes: speech tokens + 200 special ids (sos 6561, eos 6562, task 6563, fill 6564, ...)."""
        return self.speech_token_size + STOP_TOKENS


@dataclass(frozen=True)
class DiTConfig:
    dim: int
    depth: int
    heads: int
    dim_head: int
    ff_mult: int
    mel_dim: int
    mu_dim: int
    spk_dim: int
    static_chunk_size: int  # frames

    @property
    def inner_dim(self) -> int:
        return self.heads * self.dim_head


@dataclass(frozen=True)
class FlowConfig:
    input_size: int
    output_size: int
    spk_embed_dim: int
    vocab_size: int
    token_frame_rate: int
    token_mel_ratio: int
    pre_lookahead_len: int
    lookahead_channels: int
    dit: DiTConfig
    inference_cfg_rate: float
    t_scheduler: str


@dataclass(frozen=True)
class CosyVoice3Config:
    sample_rate: int
    llm: LLMConfig
    flow: FlowConfig
    hift: HiFTConfig
    conv_pre_look_right: int  # CausalHiFTGenerator: frames conv_pre reads past its output frame


def _llm(node: Any, qwen: QwenConfig) -> LLMConfig:
    node = expect_class(node, "CosyVoice3LM", "llm")
    sampling = node.get("sampling", {})
    size = int(need(node, "llm_input_size", "llm"))
    if size != qwen.hidden_size or int(need(node, "llm_output_size", "llm")) != qwen.hidden_size:
        raise ConfigError(f"llm: llm_input_size/llm_output_size must equal the Qwen2 hidden size {qwen.hidden_size}")
    return LLMConfig(
        llm_input_size=size,
        speech_token_size=int(need(node, "speech_token_size", "llm")),
        qwen=qwen,
        top_p=float(sampling.get("top_p", 0.8)),
        top_k=int(sampling.get("top_k", 25)),
        win_size=int(sampling.get("win_size", 10)),
        tau_r=float(sampling.get("tau_r", 0.1)),
    )


def _dit(node: Any) -> DiTConfig:
    where = "flow.decoder.estimator"
    est = expect_class(node, "DiT", where)
    if est.get("long_skip_connection", False):
        raise ConfigError(f"{where}: long_skip_connection is not supported")
    if int(est.get("num_decoding_left_chunks", 2)) >= 0:
        raise ConfigError(f"{where}: num_decoding_left_chunks must be < 0 (attention over every left chunk)")
    mel = int(est.get("mel_dim", 80))
    cfg = DiTConfig(
        dim=int(need(est, "dim", where)),
        depth=int(est.get("depth", 8)),
        heads=int(est.get("heads", 8)),
        dim_head=int(est.get("dim_head", 64)),
        ff_mult=int(est.get("ff_mult", 4)),
        mel_dim=mel,
        mu_dim=int(est.get("mu_dim") or mel),
        spk_dim=int(est.get("spk_dim") or 0),
        static_chunk_size=int(est.get("static_chunk_size", 50)),
    )
    if cfg.inner_dim != cfg.dim or cfg.dim % CONV_POS_GROUPS:
        raise ConfigError(f"{where}: heads x dim_head must equal dim, and dim must be a multiple of {CONV_POS_GROUPS}")
    if int(est.get("out_channels") or mel) != mel:
        raise ConfigError(f"{where}: out_channels must equal mel_dim")
    return cfg


def _flow(node: Any) -> FlowConfig:
    node = expect_class(node, "CausalMaskedDiffWithDiT", "flow")
    look = expect_class(need(node, "pre_lookahead_layer", "flow"), "PreLookaheadLayer", "flow.pre_lookahead_layer")
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
        lookahead_channels=int(need(look, "channels", "flow.pre_lookahead_layer")),
        dit=_dit(need(dec, "estimator", "flow.decoder")),
        inference_cfg_rate=float(cfm.get("inference_cfg_rate", 0.7)),
        t_scheduler=str(cfm.get("t_scheduler", "cosine")),
    )
    if int(look.get("pre_lookahead_len", 1)) != cfg.pre_lookahead_len or int(look.get("in_channels", 0)) != cfg.input_size:
        raise ConfigError("flow.pre_lookahead_layer: in_channels and pre_lookahead_len must be the flow's")
    if cfg.output_size != 80 or cfg.input_size != cfg.dit.mu_dim or cfg.dit.mel_dim != cfg.output_size:
        raise ConfigError("flow: output_size and the DiT's mel_dim must be 80 (the noise has 80 channels), input_size its mu_dim")
    if cfg.dit.spk_dim != cfg.output_size:
        raise ConfigError("flow: the DiT's spk_dim must equal output_size (the projected x-vector)")
    if cfg.t_scheduler != "cosine":
        raise ConfigError(f"flow: t_scheduler {cfg.t_scheduler!r} is not supported (only 'cosine')")
    return cfg


def load_config(model_dir: Path, qwen_config: Path | None = None) -> CosyVoice3Config:
    """Parse `model_dir/cosyvoice3.yaml` and the Qwen2 config (default `model_dir/CosyVoice-BlankEN/config.json`).

    Raises ConfigError naming the file and the key for anything our modules cannot express.
    """
    path = model_dir / YAML_NAME
    root = read_yaml(path)
    qwen = read_qwen_config(qwen_config or model_dir / QWEN_DIR / QWEN_CONFIG)
    try:
        sample_rate = int(root.get("sample_rate", 24000))
        hift = need(root, "hift", str(path))
        expect_class(hift, "CausalHiFTGenerator", "hift")
        return CosyVoice3Config(
            sample_rate=sample_rate,
            llm=_llm(need(root, "llm", str(path)), qwen),
            flow=_flow(need(root, "flow", str(path))),
            hift=hift_config(hift, sample_rate),
            conv_pre_look_right=int(hift.get("conv_pre_look_right", 4)),
        )
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: unmappable yaml: {type(e).__name__}: {e}") from e
