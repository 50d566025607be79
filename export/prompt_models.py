"""The bundle's prompt group: the checkpoint's CAM++ and S3 tokenizer ONNX files, checked, then copied verbatim."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import onnx

from export.onnx_io import ExportError
from service.bundle import GROUP_PROMPT, GraphEntry, sha256_file

# Graph name -> (file name, input names, output names): a family contract's PROMPT_GRAPHS.
PromptTable = dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]]


@dataclass(frozen=True)
class PromptModel:
    """One prompt model found in the checkpoint directory, with the manifest entry its copy will have."""

    name: str  # graph name: "campplus" or "speech_tokenizer"
    source: Path
    entry: GraphEntry


def present(model_dir: Path, table: PromptTable) -> dict[str, Path]:
    """Graph name -> path of the prompt model files (of the family's `table`) that exist in `model_dir`."""
    paths = {name: model_dir / file for name, (file, _, _) in table.items()}
    return {name: path for name, path in paths.items() if path.is_file()}


def graph_io(path: Path) -> tuple[tuple[str, ...], tuple[str, ...], int]:
    """Input names (initializers excluded: old IR versions list them as inputs), output names, default-domain opset."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises several types for files that are not ONNX
        raise ExportError(f"{path}: cannot read as an ONNX model ({type(e).__name__}: {e})") from e
    weights = {i.name for i in model.graph.initializer}
    inputs = tuple(i.name for i in model.graph.input if i.name not in weights)
    outputs = tuple(o.name for o in model.graph.output)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    return inputs, outputs, opset


def inspect(name: str, path: Path, table: PromptTable) -> PromptModel:
    """Check a prompt model's input/output names against `table`; ExportError naming both sides if they differ."""
    file, want_in, want_out = table[name]
    inputs, outputs, opset = graph_io(path)
    if set(inputs) != set(want_in) or set(outputs) != set(want_out):
        raise ExportError(
            f"{path}: inputs {list(inputs)} / outputs {list(outputs)}, expected {list(want_in)} / {list(want_out)} "
            f"(not the official {file}?)"
        )
    # names are bound by feed name, so the table's order is recorded whatever order the file lists them in
    entry = GraphEntry(file, sha256_file(path), "fp32", want_in, want_out, opset, group=GROUP_PROMPT)
    return PromptModel(name, path, entry)


def find(model_dir: Path, table: PromptTable) -> dict[str, PromptModel]:
    """Both prompt models of `model_dir` checked, or {} when it has neither; ExportError when only one is there."""
    found = present(model_dir, table)
    if found and len(found) < len(table):
        have = ", ".join(p.name for p in found.values())
        lack = ", ".join(file for name, (file, _, _) in table.items() if name not in found)
        raise ExportError(
            f"{model_dir}: has {have} but not {lack}; prompt analysis needs both "
            "(add the missing file, or pass --no-prompt-models to export without voice cloning)"
        )
    return {name: inspect(name, path, table) for name, path in found.items()}


def copy_into(models: dict[str, PromptModel], out_dir: Path) -> dict[str, GraphEntry]:
    """Copy the prompt models into `out_dir` byte for byte; returns their manifest entries (hash of the copy checked)."""
    entries = {}
    for name, model in models.items():
        dst = out_dir / model.entry.file
        shutil.copyfile(model.source, dst)
        if sha256_file(dst) != model.entry.sha256:
            raise ExportError(f"{model.source}: changed while it was being copied into the bundle")
        entries[name] = model.entry
    return entries
