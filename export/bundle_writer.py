"""What every family's bundle writer shares: export options and report, the manifest's exporter and graph entries,
and the atomic publish of a staged bundle directory."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import torch

from export import checkpoint
from export.external_data import externalize_bundle
from export.native_twin import Rewrite, write_native_twin
from export.onnx_io import OPSET, ExportedGraph, ExportError
from export.quantize import Scheme, write_quantized_bundle
from service.bundle import GraphEntry, Manifest, sha256_file

EXPORTER_VERSION = "1"


@dataclass(frozen=True)
class ExportOptions:
    model_dir: Path
    out: Path
    random_init: bool = False
    seed: int = 0
    verify: bool = False
    tolerance: float = 1e-4
    quantize: str | None = None  # None or "int8"
    tokenizer: Path | None = None
    model_name: str = checkpoint.DEFAULT_MODEL_NAME
    test_model: bool = False  # a miniature random-weight checkpoint (models/tiny): marked so in the manifest
    instruct: bool = False  # declare the instruct capability (CosyVoice-300M-Instruct)
    prompt_models: bool = True  # copy campplus.onnx + speech_tokenizer_v1.onnx when the checkpoint has them

    @property
    def random_weights(self) -> bool:
        return self.random_init or self.test_model

    def description(self) -> str:
        if self.test_model:
            return "Miniature model with random weights in the official layout, for tests and CI; its audio is noise."
        if self.random_init:
            return "Full-size architecture with seeded random weights, for benchmarks; its audio is noise."
        return f"{self.model_name} exported from the official checkpoint."


@dataclass
class ExportReport:
    out: Path
    seconds: float = 0.0
    errors: dict[str, float] = field(default_factory=dict)
    int8_out: Path | None = None
    int8_errors: dict[str, float] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)


def graph_entries(out_dir: Path, graphs: list[ExportedGraph]) -> dict[str, GraphEntry]:
    entries = {}
    for g in graphs:
        model = onnx.load(str(out_dir / g.file), load_external_data=False)
        opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        if opset != OPSET:
            raise ExportError(f"{g.file}: opset {opset} is not {OPSET}")
        entries[g.name] = GraphEntry(g.file, sha256_file(out_dir / g.file), "fp32", g.inputs, g.outputs, opset)
    return entries


def exporter_info(opts: ExportOptions, version: str = EXPORTER_VERSION) -> dict[str, str]:
    """The manifest's `exporter` record: what wrote the bundle (a family's exporter passes its own `version`)."""
    return {
        "exporter_version": version,
        "torch": torch.__version__.split("+")[0],
        "onnx": onnx.__version__,
        "opset": str(OPSET),
        "random_init": str(opts.random_init).lower(),
        "seed": str(opts.seed),
    }


def publish(tmp: Path, out: Path) -> None:
    """Move a finished bundle into place, its large graphs' weights in files of their own (export.external_data); an
    existing bundle at `out` is replaced only once the new one is whole."""
    externalize_bundle(tmp)
    backup = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(backup)
    tmp.rename(out)
    if backup.exists():
        shutil.rmtree(backup)


def staging_dir(out: Path, tag: str) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{tag}-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    return tmp


def log_errors(log: Callable[[str], None], title: str, errors: dict[str, float], tol: float | None) -> None:
    log(f"{title}: max abs error per graph")
    for name, err in sorted(errors.items()):
        flag = "" if tol is None else ("  ok" if err <= tol else "  FAIL")
        log(f"  {name:<28} {err:.3e}{flag}")
    sys.stdout.flush()


@dataclass(frozen=True)
class TwinPlan:
    """How a family's quantized bundle is written from its fp32 one (export.quantize.write_quantized_bundle's
    arguments): graph -> precision, graphs with int8 MatMuls, int8 tables, float16 K/V inputs and outputs, float twins."""

    precisions: dict[str, str]
    matmul_graphs: tuple[str, ...]
    table_graphs: tuple[str, ...]
    half_kv_graphs: tuple[str, ...]
    half_output_graphs: tuple[str, ...] = ()
    float_twin_graphs: tuple[str, ...] = ()


def write_twin(
    fp32_out: Path,
    manifest: Manifest,
    scheme: Scheme,
    plan: TwinPlan,
    rewrites: dict[str, Rewrite],
    check: Callable[[Path], dict[str, float]],
) -> tuple[Path, dict[str, float]]:
    """Write OUT-`scheme` from the fp32 bundle with `plan` and its native twins (`rewrites`), staged and published only
    when written and checked; returns its path and what `check` said of the staged bundle."""
    out = fp32_out.with_name(f"{fp32_out.name}-{scheme}")
    tmp = staging_dir(out, "partial")
    try:
        write_quantized_bundle(
            fp32_out, tmp, manifest, scheme, plan=plan.precisions, matmul_graphs=plan.matmul_graphs,
            table_graphs=plan.table_graphs, half_kv_graphs=plan.half_kv_graphs, half_output_graphs=plan.half_output_graphs,
            float_twin_graphs=plan.float_twin_graphs,
        )  # fmt: skip
        write_native_twin(tmp, rewrites, log=lambda _: None)
        result = check(tmp)
        publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out, result
