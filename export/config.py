"""Read the official cosyvoice.yaml (hyperpyyaml tags parsed with PyYAML) into typed model configs."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """The yaml cannot be mapped onto the architecture we export."""


@dataclass(frozen=True)
class EncoderConfig:
    """A wenet encoder (ConformerEncoder or TransformerEncoder) with rel-pos self-attention."""

    kind: str  # "conformer" | "transformer"
    input_size: int
    output_size: int
    attention_heads: int
    linear_units: int
    num_blocks: int
    input_layer: str  # "linear" | "linear_legacy"
    causal: bool  # static_chunk_size == 1 (LLM text encoder and LLM)

    @property
    def activation(self) -> str:
        """Conformer FFN uses swish (SiLU); the plain transformer uses ReLU."""
        return "silu" if self.kind == "conformer" else "relu"


@dataclass(frozen=True)
class LLMConfig:
    text_token_size: int
    speech_token_size: int
    text_encoder_input_size: int
    llm_input_size: int
    llm_output_size: int
    spk_embed_dim: int
    text_encoder: EncoderConfig
    llm: EncoderConfig
    top_p: float
    top_k: int
    win_size: int
    tau_r: float


@dataclass(frozen=True)
class EstimatorConfig:
    in_channels: int
    out_channels: int
    channels: tuple[int, ...]
    attention_head_dim: int
    n_blocks: int
    num_mid_blocks: int
    num_heads: int
    act_fn: str


@dataclass(frozen=True)
class FlowConfig:
    input_size: int
    output_size: int
    spk_embed_dim: int
    vocab_size: int
    input_frame_rate: int
    encoder: EncoderConfig
    lr_channels: int
    lr_sampling_ratios: tuple[int, ...]
    estimator: EstimatorConfig
    inference_cfg_rate: float
    t_scheduler: str
    solver: str


@dataclass(frozen=True)
class HiFTConfig:
    in_channels: int
    base_channels: int
    nb_harmonics: int
    sampling_rate: int
    nsf_alpha: float
    nsf_sigma: float
    nsf_voiced_threshold: float
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    istft_n_fft: int
    istft_hop_len: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    source_resblock_kernel_sizes: tuple[int, ...]
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    lrelu_slope: float
    audio_limit: float
    f0_in_channels: int
    f0_cond_channels: int


@dataclass(frozen=True)
class CosyVoiceConfig:
    sample_rate: int
    llm: LLMConfig
    flow: FlowConfig
    hift: HiFTConfig


class _Tagged(dict):  # type: ignore[type-arg]
    """A mapping that remembers its hyperpyyaml tag (e.g. `!new:cosyvoice.llm.llm.TransformerLM`)."""

    tag: str = ""


class _Loader(yaml.SafeLoader):
    """SafeLoader that accepts hyperpyyaml tags and resolves `!ref <name>` afterwards."""


def _construct_tagged(loader: _Loader, suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        out = _Tagged(loader.construct_mapping(node, deep=True))
    elif isinstance(node, yaml.SequenceNode):
        out = _Tagged(args=loader.construct_sequence(node, deep=True))
    else:
        out = _Tagged(value=loader.construct_scalar(node))  # type: ignore[arg-type]
    out.tag = suffix
    return out


_Loader.add_multi_constructor("!", _construct_tagged)


_REF = re.compile(r"<([A-Za-z_][A-Za-z0-9_]*)>")
_ARITHMETIC = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.USub)


def _arithmetic(expr: str) -> Any:
    """Value of an expression of numbers and + - * / // (what `!ref <a> * <b>` becomes once its refs are numbers)."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise ConfigError(f"!ref expression {expr!r} is not arithmetic") from e
    if not all(isinstance(node, _ARITHMETIC) for node in ast.walk(tree)):
        raise ConfigError(f"!ref expression {expr!r} is not arithmetic")
    return eval(compile(tree, "<ref>", "eval"), {"__builtins__": {}})  # noqa: S307 - numbers and operators only


def _resolve_ref(text: str, root: dict[str, Any]) -> Any:
    """`<name>` -> root[name] (resolved); `<a> * <b>` (hyperpyyaml's arithmetic form) -> the number."""
    names = _REF.findall(text)
    for name in names:
        if name not in root:
            raise ConfigError(f"!ref <{name}> points at nothing")
    if len(names) == 1 and text == f"<{names[0]}>":
        return _resolve_refs(root[names[0]], root)
    values = {name: _resolve_refs(root[name], root) for name in names}
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values.values()):
        raise ConfigError(f"!ref {text}: only numbers can be combined")
    return _arithmetic(_REF.sub(lambda m: repr(values[m.group(1)]), text))


def _resolve_refs(obj: Any, root: dict[str, Any]) -> Any:
    if isinstance(obj, _Tagged) and obj.tag == "ref":
        return _resolve_ref(str(obj.get("value", "")).strip(), root)
    if isinstance(obj, dict):
        items = {k: _resolve_refs(v, root) for k, v in obj.items()}
        if isinstance(obj, _Tagged):
            tagged = _Tagged(items)
            tagged.tag = obj.tag
            return tagged
        return items
    if isinstance(obj, list):
        return [_resolve_refs(v, root) for v in obj]
    return obj


def need(section: dict[str, Any], key: str, where: str) -> Any:
    if key not in section:
        raise ConfigError(f"{where}: missing key '{key}'")
    return section[key]


def expect_class(node: Any, suffix: str, where: str) -> dict[str, Any]:
    tag = getattr(node, "tag", "")
    if not isinstance(node, dict) or not tag.endswith(suffix):
        raise ConfigError(f"{where}: expected {suffix}, found {tag or type(node).__name__}")
    return node


def _encoder(node: Any, where: str, default_input: int | None = None) -> EncoderConfig:
    tag = getattr(node, "tag", "")
    if tag.endswith("ConformerEncoder"):
        kind = "conformer"
    elif tag.endswith("TransformerEncoder"):
        kind = "transformer"
    else:
        raise ConfigError(f"{where}: unsupported encoder class {tag or '?'}")
    for key, want in (("pos_enc_layer_type", "rel_pos_espnet"), ("selfattention_layer_type", "rel_selfattn")):
        if node.get(key, want) != want:
            raise ConfigError(f"{where}: {key}={node.get(key)!r} is not supported (only {want!r})")
    if node.get("use_cnn_module", False) or node.get("macaron_style", False):
        raise ConfigError(f"{where}: conformer CNN module / macaron style are not supported")
    input_size = node.get("input_size", default_input)
    if input_size is None:
        raise ConfigError(f"{where}: missing key 'input_size'")
    return EncoderConfig(
        kind=kind,
        input_size=int(input_size),
        output_size=int(node.get("output_size", 256)),
        attention_heads=int(node.get("attention_heads", 4)),
        linear_units=int(node.get("linear_units", 2048)),
        num_blocks=int(node.get("num_blocks", 6)),
        input_layer=str(node.get("input_layer", "conv2d")),
        causal=int(node.get("static_chunk_size", 0)) == 1,
    )


def _llm(node: Any) -> LLMConfig:
    node = expect_class(node, "TransformerLM", "llm")
    sampling = node.get("sampling", {})
    tei = int(need(node, "text_encoder_input_size", "llm"))
    return LLMConfig(
        text_token_size=int(need(node, "text_token_size", "llm")),
        speech_token_size=int(need(node, "speech_token_size", "llm")),
        text_encoder_input_size=tei,
        llm_input_size=int(need(node, "llm_input_size", "llm")),
        llm_output_size=int(need(node, "llm_output_size", "llm")),
        spk_embed_dim=int(node.get("spk_embed_dim", 192)),
        text_encoder=_encoder(need(node, "text_encoder", "llm"), "llm.text_encoder", tei),
        llm=_encoder(need(node, "llm", "llm"), "llm.llm", int(node["llm_input_size"])),
        top_p=float(sampling.get("top_p", 0.8)),
        top_k=int(sampling.get("top_k", 25)),
        win_size=int(sampling.get("win_size", 10)),
        tau_r=float(sampling.get("tau_r", 0.1)),
    )


def _flow(node: Any) -> FlowConfig:
    node = expect_class(node, "MaskedDiffWithXvec", "flow")
    lr = expect_class(need(node, "length_regulator", "flow"), "InterpolateRegulator", "flow.length_regulator")
    dec = expect_class(need(node, "decoder", "flow"), "ConditionalCFM", "flow.decoder")
    est = expect_class(need(dec, "estimator", "flow.decoder"), "ConditionalDecoder", "flow.decoder.estimator")
    cfm = dec.get("cfm_params", {})
    cfm = cfm.get("content", cfm)
    return FlowConfig(
        input_size=int(need(node, "input_size", "flow")),
        output_size=int(need(node, "output_size", "flow")),
        spk_embed_dim=int(node.get("spk_embed_dim", 192)),
        vocab_size=int(need(node, "vocab_size", "flow")),
        input_frame_rate=int(node.get("input_frame_rate", 50)),
        encoder=_encoder(need(node, "encoder", "flow"), "flow.encoder"),
        lr_channels=int(lr.get("channels", 80)),
        lr_sampling_ratios=tuple(int(x) for x in lr.get("sampling_ratios", [1, 1, 1, 1])),
        estimator=EstimatorConfig(
            in_channels=int(need(est, "in_channels", "flow.decoder.estimator")),
            out_channels=int(need(est, "out_channels", "flow.decoder.estimator")),
            channels=tuple(int(x) for x in est.get("channels", [256, 256])),
            attention_head_dim=int(est.get("attention_head_dim", 64)),
            n_blocks=int(est.get("n_blocks", 1)),
            num_mid_blocks=int(est.get("num_mid_blocks", 2)),
            num_heads=int(est.get("num_heads", 4)),
            act_fn=str(est.get("act_fn", "snake")),
        ),
        inference_cfg_rate=float(cfm.get("inference_cfg_rate", 0.7)),
        t_scheduler=str(cfm.get("t_scheduler", "cosine")),
        solver=str(cfm.get("solver", "euler")),
    )


def hift_config(node: Any, sample_rate: int) -> HiFTConfig:
    node = expect_class(node, "HiFTGenerator", "hift")
    f0 = expect_class(need(node, "f0_predictor", "hift"), "ConvRNNF0Predictor", "hift.f0_predictor")
    istft = node.get("istft_params", {"n_fft": 16, "hop_len": 4})
    return HiFTConfig(
        in_channels=int(node.get("in_channels", 80)),
        base_channels=int(node.get("base_channels", 512)),
        nb_harmonics=int(node.get("nb_harmonics", 8)),
        sampling_rate=int(node.get("sampling_rate", sample_rate)),
        nsf_alpha=float(node.get("nsf_alpha", 0.1)),
        nsf_sigma=float(node.get("nsf_sigma", 0.003)),
        nsf_voiced_threshold=float(node.get("nsf_voiced_threshold", 10)),
        upsample_rates=tuple(int(x) for x in node.get("upsample_rates", [8, 8])),
        upsample_kernel_sizes=tuple(int(x) for x in node.get("upsample_kernel_sizes", [16, 16])),
        istft_n_fft=int(istft["n_fft"]),
        istft_hop_len=int(istft["hop_len"]),
        resblock_kernel_sizes=tuple(int(x) for x in node.get("resblock_kernel_sizes", [3, 7, 11])),
        resblock_dilation_sizes=tuple(tuple(int(y) for y in x) for x in node.get("resblock_dilation_sizes", [[1, 3, 5]] * 3)),
        source_resblock_kernel_sizes=tuple(int(x) for x in node.get("source_resblock_kernel_sizes", [7, 11])),
        source_resblock_dilation_sizes=tuple(
            tuple(int(y) for y in x) for x in node.get("source_resblock_dilation_sizes", [[1, 3, 5]] * 2)
        ),
        lrelu_slope=float(node.get("lrelu_slope", 0.1)),
        audio_limit=float(node.get("audio_limit", 0.99)),
        f0_in_channels=int(f0.get("in_channels", 80)),
        f0_cond_channels=int(f0.get("cond_channels", 512)),
    )


def read_yaml(path: Path) -> dict[str, Any]:
    """An official hyperpyyaml file as nested mappings (class tags kept in `.tag`, `!ref`s resolved)."""
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # noqa: S506 - SafeLoader subclass
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read yaml: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level is not a mapping")
    try:
        resolved: dict[str, Any] = _resolve_refs(raw, raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
    return resolved


def load_config(path: str | Path) -> CosyVoiceConfig:
    """Parse `cosyvoice.yaml`; raises ConfigError with a message naming the file and the key."""
    path = Path(path)
    root = read_yaml(path)
    try:
        sample_rate = int(root.get("sample_rate", 22050))
        return CosyVoiceConfig(
            sample_rate=sample_rate,
            llm=_llm(need(root, "llm", str(path))),
            flow=_flow(need(root, "flow", str(path))),
            hift=hift_config(need(root, "hift", str(path)), sample_rate),
        )
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: unmappable yaml: {type(e).__name__}: {e}") from e
