"""CosyVoice-300M's exporter: modules from the checkpoint, graphs, speakers, tokenizer, manifest; atomic publish."""

from __future__ import annotations

import importlib.util
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from export import checkpoint, prompt_models
from export.bundle_writer import ExportOptions, ExportReport, exporter_info, graph_entries, log_errors, publish, staging_dir
from export.capabilities import VoicePlan, plan_voices
from export.config import CosyVoiceConfig, load_config
from export.cosyvoice1.graphs.flow import export_flow, verify_flow
from export.cosyvoice1.graphs.llm import export_llm, verify_llm
from export.cosyvoice1.modules.llm import TransformerLM
from export.cosyvoice1.native_twin import rewrite_full_estimator
from export.cosyvoice1.relpos_twin import rewrite_relpos_step
from export.graphs.hift import export_hift, verify_hift
from export.modules.flow import MaskedDiffWithXvec
from export.modules.hift import HiFTGenerator, normalize_hift_state_dict
from export.native_twin import Rewrite, write_native_twin
from export.onnx_io import ExportError
from export.quantize import step_deviation, write_int8_bundle, write_quantized_bundle
from service.bundle import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    SPEAKERS_NAME,
    Manifest,
    ModelBundle,
    ModelConstants,
    sha256_file,
    write_speakers,
)
from service.families.cosyvoice1.contract import FAMILY, PROMPT_GRAPHS, TOKENIZER_NAME

# sha256 of openai-whisper 20231117's assets/multilingual.tiktoken (the file the v1 config tokenizes with).
WHISPER_MULTILINGUAL_SHA256 = "b34b360dbb493e781e479794586d661700670d65564001f23024971d1f2fa126"
REPO_TINY_TOKENIZER = Path(__file__).resolve().parents[2] / "models" / "tiny" / TOKENIZER_NAME
# Graphs with a native twin in a quantized bundle, and how each is rewritten: the LLM step (its decoder layers as
# RelPosLayer nodes, its other int8 products as Int8MatMul), the flow estimator's transformer blocks (attending over
# the whole window).
NATIVE_REWRITES: dict[str, Rewrite] = {"llm_step": rewrite_relpos_step, "flow_estimator": rewrite_full_estimator}


@dataclass(frozen=True)
class Models:
    llm: TransformerLM
    flow: MaskedDiffWithXvec
    hift: HiFTGenerator


def is_cosyvoice1_dir(model_dir: Path) -> bool:
    """A checkpoint directory in the CosyVoice-300M layout (it has cosyvoice.yaml)."""
    return (model_dir / "cosyvoice.yaml").is_file()


def find_tokenizer(opts: ExportOptions) -> Path:
    """The whisper BPE file: --tokenizer, the model dir, an installed openai-whisper, or the committed tiny bundle."""
    candidates = [opts.tokenizer] if opts.tokenizer else []
    candidates.append(opts.model_dir / TOKENIZER_NAME)
    spec = importlib.util.find_spec("whisper")
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin).parent / "assets" / TOKENIZER_NAME)
    candidates.append(REPO_TINY_TOKENIZER)
    for path in candidates:
        if path is not None and path.is_file():
            if sha256_file(path) != WHISPER_MULTILINGUAL_SHA256:
                raise ExportError(f"{path}: not whisper's multilingual.tiktoken (sha256 differs)")
            return path
    raise ExportError(
        f"multilingual.tiktoken not found (looked in: {', '.join(str(c) for c in candidates if c)}); pass --tokenizer"
    )


def constants_from_config(cfg: CosyVoiceConfig) -> ModelConstants:
    """Every number the runtime needs, taken from the yaml (official defaults where the yaml is silent)."""
    dec = cfg.llm.llm
    return ModelConstants(
        sample_rate=cfg.sample_rate,
        token_rate_hz=cfg.flow.input_frame_rate,
        mel_hop_samples=math.prod(cfg.hift.upsample_rates) * cfg.hift.istft_hop_len,
        n_mels=cfg.flow.output_size,
        spk_embed_dim=cfg.llm.spk_embed_dim,
        text_vocab_size=cfg.llm.text_token_size,
        speech_token_size=cfg.llm.speech_token_size,
        eos_token=cfg.llm.speech_token_size,
        llm_num_layers=dec.num_blocks,
        llm_num_heads=dec.attention_heads,
        llm_head_dim=dec.output_size // dec.attention_heads,
        llm_model_dim=dec.output_size,
        top_p=cfg.llm.top_p,
        top_k=cfg.llm.top_k,
        win_size=cfg.llm.win_size,
        tau_r=cfg.llm.tau_r,
        cfg_rate=cfg.flow.inference_cfg_rate,
        t_scheduler=cfg.flow.t_scheduler,
        nb_harmonics=cfg.hift.nb_harmonics,
        sine_amp=cfg.hift.nsf_alpha,
        noise_std=cfg.hift.nsf_sigma,
        voiced_threshold_hz=cfg.hift.nsf_voiced_threshold,
        istft_n_fft=cfg.hift.istft_n_fft,
        istft_hop=cfg.hift.istft_hop_len,
        audio_limit=cfg.hift.audio_limit,
        upsample_rates=cfg.hift.upsample_rates,
        token_hop_len=2 * cfg.flow.input_frame_rate,
        token_max_hop_len=4 * cfg.flow.input_frame_rate,
    )


def build_models(cfg: CosyVoiceConfig, opts: ExportOptions) -> Models:
    """Construct the three modules; load the official weights strictly, or seed random ones."""
    torch.manual_seed(opts.seed)
    models = Models(TransformerLM(cfg.llm), MaskedDiffWithXvec(cfg.flow), HiFTGenerator(cfg.hift))
    if not opts.random_init:
        checkpoint.load_strict(models.llm, opts.model_dir / "llm.pt")
        checkpoint.load_strict(models.flow, opts.model_dir / "flow.pt")
        checkpoint.load_strict(models.hift, opts.model_dir / "hift.pt", normalize=normalize_hift_state_dict)
    for m in (models.llm, models.flow, models.hift):
        m.eval()
    models.hift.fold_weight_norm()
    return models


def _verify(models: Models, out_dir: Path) -> dict[str, float]:
    errors: dict[str, float] = {}
    steps: list[tuple[Callable[..., dict[str, float]], torch.nn.Module]] = [
        (verify_llm, models.llm),
        (verify_flow, models.flow),
        (verify_hift, models.hift),
    ]
    for fn, module in steps:
        errors.update(fn(module, out_dir))
    return errors


def _source_hashes(opts: ExportOptions, plan: VoicePlan) -> dict[str, str]:
    names = ["cosyvoice.yaml"] if opts.random_init else list(checkpoint.REQUIRED_FILES)
    if not opts.random_init and (opts.model_dir / checkpoint.SPEAKERS_FILE).is_file():
        names.append(checkpoint.SPEAKERS_FILE)
    return {n: sha256_file(opts.model_dir / n) for n in names} | plan.prompt_source_hashes()


def _write_bundle(cfg: CosyVoiceConfig, models: Models, opts: ExportOptions, plan: VoicePlan, tmp: Path) -> Manifest:
    graphs = export_llm(models.llm, tmp) + export_flow(models.flow, tmp) + export_hift(models.hift, tmp)
    write_speakers(tmp / SPEAKERS_NAME, plan.speakers)
    shutil.copyfile(find_tokenizer(opts), tmp / TOKENIZER_NAME)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        model=opts.model_name + ("-random-init" if opts.random_init else ""),
        precision="fp32",
        constants=constants_from_config(cfg),
        graphs=graph_entries(tmp, graphs) | prompt_models.copy_into(plan.prompt_models, tmp),
        source_files=_source_hashes(opts, plan),
        files={n: sha256_file(tmp / n) for n in (SPEAKERS_NAME, TOKENIZER_NAME)},
        exporter=exporter_info(opts),
        random_weights=opts.random_weights,
        test_model=opts.test_model,
        description=opts.description(),
        capabilities=plan.capabilities,
        family=FAMILY,
    )
    (tmp / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
    return manifest


def run_export(opts: ExportOptions, log: Callable[[str], None] = print) -> ExportReport:
    """Export (and optionally verify/quantize) a bundle; raises ExportError/ConfigError on failure."""
    start = time.perf_counter()
    missing = checkpoint.missing_files(opts.model_dir, opts.random_init)
    if missing:
        raise checkpoint.CheckpointError(f"{opts.model_dir}: missing checkpoint file(s): {', '.join(missing)}")
    cfg = load_config(opts.model_dir / "cosyvoice.yaml")
    find_tokenizer(opts)  # fail before the slow part
    plan = plan_voices(
        opts.model_dir,
        cfg.llm.spk_embed_dim,
        random_init=opts.random_init,
        seed=opts.seed,
        instruct=opts.instruct,
        with_prompt_models=opts.prompt_models,
        log=log,
        prompt_table=PROMPT_GRAPHS,
    )
    models = build_models(cfg, opts)
    report = ExportReport(out=opts.out)
    tmp = staging_dir(opts.out, "partial")
    try:
        tmp.mkdir()
        manifest = _write_bundle(cfg, models, opts, plan, tmp)
        if opts.verify:
            report.errors = _verify(models, tmp)
            log_errors(log, "fp32 ONNX vs torch", report.errors, opts.tolerance)
            bad = {k: v for k, v in report.errors.items() if not v <= opts.tolerance}
            if bad:
                raise ExportError(
                    f"verification failed: {', '.join(f'{k}={v:.2e}' for k, v in bad.items())} > {opts.tolerance:g}"
                )
        publish(tmp, opts.out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    report.sizes = {e.file: (opts.out / e.file).stat().st_size for e in manifest.graphs.values()}
    if opts.quantize == "int8":
        report.int8_out, report.int8_errors = _export_int8(models, opts, manifest, log)
    report.seconds = time.perf_counter() - start
    return report


def _export_int8(
    models: Models, opts: ExportOptions, manifest: Manifest, log: Callable[[str], None]
) -> tuple[Path, dict[str, float]]:
    out = opts.out.with_name(opts.out.name + "-int8")
    tmp = staging_dir(out, "partial")
    try:
        write_int8_bundle(opts.out, tmp, manifest)
        write_native_twin(tmp, NATIVE_REWRITES, log=lambda _: None)
        errors = _verify(models, tmp) if opts.verify else {}
        if errors:
            log_errors(log, "int8 ONNX vs fp32 torch (deviation, not a failure)", errors, None)
        publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out, errors


def write_int4(fp32_out: Path) -> tuple[Path, dict[str, float]]:
    """Write OUT-int4 next to the fp32 bundle `fp32_out` (atomically); returns its path and the decode step's deviation
    from the fp32 step."""
    manifest = ModelBundle.load(fp32_out).manifest
    out = fp32_out.with_name(fp32_out.name + "-int4")
    tmp = staging_dir(out, "partial")
    try:
        write_quantized_bundle(fp32_out, tmp, manifest, "int4")
        dev = step_deviation(fp32_out, tmp, manifest.constants)
        publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out, dev
