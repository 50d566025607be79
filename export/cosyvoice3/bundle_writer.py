"""Build a Fun-CosyVoice3 bundle: modules from the checkpoint, graphs with explicit caches, tokenizer, noise, manifest."""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from tokenizers import Tokenizer

from export import checkpoint
from export.bundle_writer import (
    ExportOptions,
    ExportReport,
    TwinPlan,
    exporter_info,
    graph_entries,
    log_errors,
    publish,
    staging_dir,
    write_twin,
)
from export.capabilities import VoicePlan, plan_voices
from export.cosyvoice3 import tokenizer as cv3_tokenizer
from export.cosyvoice3.config import YAML_NAME, CosyVoice3Config, load_config
from export.cosyvoice3.constants import cosyvoice3_constants, model_constants
from export.cosyvoice3.dit_twin import DIT_INPUTS, DIT_OP_NAME, fuse_dit_blocks
from export.cosyvoice3.graphs.flow import export_flow, verify_flow
from export.cosyvoice3.modules.flow import CausalMaskedDiffWithDiT
from export.cosyvoice3.modules.hift import CausalHiFT
from export.cosyvoice3.modules.llm import CosyVoice3LM
from export.cosyvoice3.noise import sine_noise_recipe
from export.graphs.hift import export_hift, verify_hift
from export.graphs.qwen2 import export_llm, step_deviation, verify_llm
from export.modules.flow import write_flow_noise
from export.modules.hift import normalize_hift_state_dict
from export.modules.qwen2 import drop_unused
from export.native_twin import Rewrite, rewrite_cached_estimator, rewrite_qwen2_step
from export.onnx_io import ExportError
from export.prompt_models import copy_into
from export.qwen2_config import QWEN_CONFIG, QWEN_DIR
from export.qwen_tokenizer import find_source, source_files, write_tokenizer
from service.bundle import FORMAT_VERSION, MANIFEST_NAME, SPEAKERS_NAME, Manifest, ModelBundle, sha256_file, write_speakers
from service.families.cosyvoice3.contract import FAMILY, GRAPH_IO, NOISE_NAME, PROMPT_GRAPHS, TOKENIZER_NAME, constants_of

EXPORTER_VERSION = "1"
MODEL_NAME = "Fun-CosyVoice3-0.5B"
WEIGHT_FILES = ("llm.pt", "flow.pt", "hift.pt")
# int8 twin: weight MatMuls of the decode step, the look-ahead layer and the DiT; the large lookup tables (Qwen text
# embedding 151936 x 896, speech embedding, flow token embedding) as int8 rows; float16 K/V caches for the decode step
# and the DiT (half the bytes the engine keeps per position and per frame), the DiT's new keys/values leave it so.
INT8_PLAN = {"llm_step": "int8", "flow_encoder": "int8", "flow_estimator": "int8", "llm_prompt": "int8", "llm_embed": "int8"}
INT8_TWIN = TwinPlan(
    INT8_PLAN,
    matmul_graphs=("llm_step", "flow_encoder", "flow_estimator"),
    table_graphs=("llm_prompt", "llm_embed", "flow_encoder"),
    half_kv_graphs=("llm_step", "flow_estimator"),
    half_output_graphs=("flow_estimator",),
)
# --quantize int4: the int8 twin with a 4-bit decode step (MatMulNBits, block 128, int8 compute).
INT4_TWIN = dataclasses.replace(INT8_TWIN, precisions={**INT8_PLAN, "llm_step": "int4"})


def _estimator_rewrite(model: onnx.ModelProto, manifest: Manifest) -> tuple[int, str]:
    blocks = constants_of(manifest).estimator_blocks
    return rewrite_cached_estimator(blocks, fuse_dit_blocks, DIT_OP_NAME, DIT_INPUTS)(model, manifest)


# Graphs with a native twin in a quantized bundle: the DiT's blocks (the kit's estimator block with AdaLN-zero
# modulation, export/cosyvoice3/dit_twin.py), the Qwen2 step's int8 products and decoder layers.
NATIVE_REWRITES: dict[str, Rewrite] = {"flow_estimator": _estimator_rewrite, "llm_step": rewrite_qwen2_step}


def is_cosyvoice3_dir(model_dir: Path) -> bool:
    """A checkpoint directory in the Fun-CosyVoice3 layout (it has cosyvoice3.yaml)."""
    return (model_dir / YAML_NAME).is_file()


@dataclass(frozen=True)
class Models:
    llm: CosyVoice3LM
    flow: CausalMaskedDiffWithDiT
    hift: CausalHiFT


def missing_files(model_dir: Path, random_init: bool) -> list[str]:
    """Required checkpoint files absent from `model_dir` (the yaml and the Qwen2 config for --random-init)."""
    needed = [YAML_NAME, f"{QWEN_DIR}/{QWEN_CONFIG}"] + ([] if random_init else list(WEIGHT_FILES))
    return [f for f in needed if not (model_dir / f).is_file()]


def build_models(cfg: CosyVoice3Config, opts: ExportOptions) -> Models:
    """Construct the three modules; load the official weights strictly, or seed random ones."""
    torch.manual_seed(opts.seed)
    models = Models(CosyVoice3LM(cfg.llm), CausalMaskedDiffWithDiT(cfg.flow), CausalHiFT(cfg.hift, cfg.conv_pre_look_right))
    if not opts.random_init:
        checkpoint.load_strict(models.llm, opts.model_dir / "llm.pt", normalize=drop_unused)
        checkpoint.load_strict(models.flow, opts.model_dir / "flow.pt")
        checkpoint.load_strict(models.hift, opts.model_dir / "hift.pt", normalize=normalize_hift_state_dict)
    for m in (models.llm, models.flow, models.hift):
        m.eval()
    models.hift.fold_weight_norm()
    return models


def _verify(models: Models, out_dir: Path) -> dict[str, float]:
    return verify_llm(models.llm, out_dir) | verify_flow(models.flow, out_dir) | verify_hift(models.hift, out_dir)  # type: ignore[arg-type]


def _source_hashes(opts: ExportOptions, plan: VoicePlan, tokenizer: Path) -> dict[str, str]:
    names = [YAML_NAME, f"{QWEN_DIR}/{QWEN_CONFIG}"] + ([] if opts.random_init else list(WEIGHT_FILES))
    hashes = {n: sha256_file(opts.model_dir / n) for n in names}
    for path in source_files(tokenizer):
        hashes[f"tokenizer:{path.name}"] = sha256_file(path)
    return hashes | plan.prompt_source_hashes()


@dataclass(frozen=True)
class _Inputs:
    """What the export reads besides the weights: config, voices, text tokenizer (built) and where it came from."""

    cfg: CosyVoice3Config
    plan: VoicePlan
    tokenizer: Tokenizer
    tokenizer_source: Path


def _write_bundle(inputs: _Inputs, models: Models, opts: ExportOptions, tmp: Path, log: Callable[[str], None]) -> Manifest:
    cfg, plan = inputs.cfg, inputs.plan
    offset, digest = sine_noise_recipe(cfg)
    log(f"HiFT noise: mt19937 from draw {offset} reproduces SineGen2.sine_waves (sha256 {digest[:12]}...)")
    extra = cosyvoice3_constants(cfg, offset, digest)
    graphs = export_llm(models.llm, tmp, GRAPH_IO) + export_flow(models.flow, tmp, extra) + export_hift(models.hift, tmp)  # type: ignore[arg-type]
    write_speakers(tmp / SPEAKERS_NAME, plan.speakers)
    write_tokenizer(inputs.tokenizer, tmp / TOKENIZER_NAME)
    write_flow_noise(tmp / NOISE_NAME)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        model=opts.model_name + ("-random-init" if opts.random_init else ""),
        precision="fp32",
        constants=model_constants(cfg),
        graphs=graph_entries(tmp, graphs) | copy_into(plan.prompt_models, tmp),
        source_files=_source_hashes(opts, plan, inputs.tokenizer_source),
        files={n: sha256_file(tmp / n) for n in (SPEAKERS_NAME, TOKENIZER_NAME, NOISE_NAME)},
        exporter=exporter_info(opts, EXPORTER_VERSION),
        random_weights=opts.random_weights,
        test_model=opts.test_model,
        description=opts.description(),
        capabilities=plan.capabilities,
        family=FAMILY,
        family_section=dataclasses.asdict(extra),
    )
    (tmp / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
    return manifest


def _plan(opts: ExportOptions, cfg: CosyVoice3Config, log: Callable[[str], None]) -> VoicePlan:
    """Prompt voices only (Fun-CosyVoice3 ships no spk2info.pt): a checkpoint without prompt models cannot be served,
    except a --random-init benchmark bundle, which takes seeded random built-in speakers as CosyVoice2's does."""
    if opts.instruct:
        raise ExportError("--instruct is CosyVoice-300M-Instruct's mode; a CosyVoice3 bundle offers instruct2 (prompt voices)")
    plan = plan_voices(
        opts.model_dir, cfg.flow.spk_embed_dim, random_init=opts.random_init, seed=opts.seed,
        with_prompt_models=opts.prompt_models, log=log, prompt_table=PROMPT_GRAPHS,
    )  # fmt: skip
    return VoicePlan(plan.speakers, plan.prompt_models, False, instruct2=True)


def run_export(opts: ExportOptions, log: Callable[[str], None] = print) -> ExportReport:
    """Export (and optionally verify/quantize) a Fun-CosyVoice3 bundle; raises ExportError/ConfigError on failure."""
    start = time.perf_counter()
    missing = missing_files(opts.model_dir, opts.random_init)
    if missing:
        raise checkpoint.CheckpointError(f"{opts.model_dir}: missing checkpoint file(s): {', '.join(missing)}")
    cfg = load_config(opts.model_dir)
    source = find_source(opts.tokenizer, opts.model_dir / QWEN_DIR, random_init=opts.random_init)
    tokenizer = cv3_tokenizer.build_tokenizer(source)  # fails before the slow part
    inputs = _Inputs(cfg, _plan(opts, cfg, log), tokenizer, source)
    models = build_models(cfg, opts)
    report = ExportReport(out=opts.out)
    tmp = staging_dir(opts.out, "partial")
    try:
        tmp.mkdir()
        manifest = _write_bundle(inputs, models, opts, tmp, log)
        if opts.verify:
            report.errors = _verify(models, tmp)
            log_errors(log, "fp32 ONNX vs torch", report.errors, opts.tolerance)
            bad = {k: v for k, v in report.errors.items() if not v <= opts.tolerance}
            if bad:
                listed = ", ".join(f"{k}={v:.2e}" for k, v in bad.items())
                raise ExportError(f"verification failed: {listed} > {opts.tolerance:g}")
        publish(tmp, opts.out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    report.sizes = {e.file: (opts.out / e.file).stat().st_size for e in manifest.graphs.values()}
    if opts.quantize == "int8":
        report.int8_out, report.int8_errors = _export_int8(models, opts, manifest, log)
    elif opts.quantize is not None:
        raise ExportError(f"--quantize {opts.quantize} is not offered for CosyVoice3 bundles (int8 is)")
    report.seconds = time.perf_counter() - start
    return report


def write_int4(fp32_out: Path) -> tuple[Path, dict[str, float]]:
    """Write OUT-int4 next to the fp32 bundle `fp32_out`; returns its path and the decode step's deviation."""
    manifest = ModelBundle.load(fp32_out).manifest
    return write_twin(
        fp32_out, manifest, "int4", INT4_TWIN, NATIVE_REWRITES,
        lambda tmp: step_deviation(fp32_out / "llm_step.onnx", tmp / "llm_step.onnx"),
    )  # fmt: skip


def _export_int8(
    models: Models, opts: ExportOptions, manifest: Manifest, log: Callable[[str], None]
) -> tuple[Path, dict[str, float]]:
    def check(tmp: Path) -> dict[str, float]:
        errors = _verify(models, tmp) if opts.verify else {}
        if errors:
            log_errors(log, "int8 ONNX vs fp32 torch (deviation, not a failure)", errors, None)
        return errors

    return write_twin(opts.out, manifest, "int8", INT8_TWIN, NATIVE_REWRITES, check)
