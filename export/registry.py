"""The exporters of the model families, by name: the one module of export/ that names every family.

`export_onnx.py` asks `for_checkpoint` which family an official checkpoint directory is; `native_twin.py`,
`loadtest/` and the tests ask `for_family` for a bundle's family. A new family adds its package and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from export import checkpoint
from export.bundle_writer import ExportOptions, ExportReport
from export.cosyvoice1 import bundle_writer as cosyvoice1
from export.cosyvoice2 import bundle_writer as cosyvoice2
from export.cosyvoice3 import bundle_writer as cosyvoice3
from export.native_twin import Rewrite
from export.onnx_io import ExportError


@dataclass(frozen=True)
class FamilyExporter:
    """How one family's official checkpoints become bundles."""

    family: str
    recognizes: Callable[[Path], bool]  # a checkpoint directory of this family
    model_name: Callable[[Path], str]  # the default model id for a checkpoint directory
    instruct: Callable[[Path], bool]  # whether a checkpoint directory declares instruct by default
    run_export: Callable[[ExportOptions], ExportReport]
    write_int4: Callable[[Path], tuple[Path, dict[str, float]]]  # OUT-int4 beside an fp32 bundle, and its deviation
    native_rewrites: Mapping[str, Rewrite]  # graph -> the rewrite that makes its native twin
    # graph -> an op its twin has had since its latest rewrite (a fused kernel; "If": the estimator's time table)
    fused_ops: Mapping[str, str] = field(default_factory=dict)


EXPORTERS: tuple[FamilyExporter, ...] = (
    FamilyExporter(
        cosyvoice2.FAMILY, cosyvoice2.is_cosyvoice2_dir, lambda _: cosyvoice2.MODEL_NAME, lambda _: False,
        cosyvoice2.run_export, cosyvoice2.write_int4, cosyvoice2.NATIVE_REWRITES,
        {"flow_estimator": "NormMish", "llm_step": "Qwen2Layer"},
    ),
    FamilyExporter(
        cosyvoice3.FAMILY, cosyvoice3.is_cosyvoice3_dir, lambda _: cosyvoice3.MODEL_NAME, lambda _: False,
        cosyvoice3.run_export, cosyvoice3.write_int4, cosyvoice3.NATIVE_REWRITES,
        {"flow_estimator": "If", "llm_step": "Qwen2Layer"},
    ),
    FamilyExporter(
        cosyvoice1.FAMILY, cosyvoice1.is_cosyvoice1_dir, checkpoint.model_name_for, checkpoint.is_instruct_dir,
        cosyvoice1.run_export, cosyvoice1.write_int4, cosyvoice1.NATIVE_REWRITES,
        {"llm_step": "RelPosLayer", "flow_estimator": "NormMish"},
    ),
)  # fmt: skip


def for_checkpoint(model_dir: Path) -> FamilyExporter:
    """The exporter of the family whose checkpoint layout `model_dir` has (its yaml); CosyVoice-300M when none says
    otherwise (its checks then name what is missing)."""
    return next((e for e in EXPORTERS if e.recognizes(model_dir)), EXPORTERS[-1])


def for_family(name: str) -> FamilyExporter:
    """The exporter of family `name` (ExportError naming the known ones otherwise)."""
    found = next((e for e in EXPORTERS if e.family == name), None)
    if found is None:
        raise ExportError(f"no exporter for model family {name!r} (known: {', '.join(e.family for e in EXPORTERS)})")
    return found
