"""One way to write an ONNX graph: opset 13, TorchScript exporter, opset asserted, checker run."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch

OPSET = 13


class ExportError(RuntimeError):
    """A graph could not be exported or failed its structural checks."""


@dataclass(frozen=True)
class ExportedGraph:
    """What an exporter returns for each graph it wrote."""

    name: str
    file: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def export_graph(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    path: Path,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamic_axes: dict[str, dict[int, str]],
) -> ExportedGraph:
    """Trace `module(*args)` to `path` at opset 13 with the given names and dynamic axes.

    Asserts the written opset (the dynamo exporter silently writes 18), that every declared
    dynamic axis is symbolic in the saved graph, and runs `onnx.checker`.
    """
    module.eval()
    buf = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(
            module,
            args,
            buf,  # type: ignore[arg-type]  # torch accepts file-like objects
            input_names=list(input_names),
            output_names=list(output_names),
            dynamic_axes=dynamic_axes,
            opset_version=OPSET,
            do_constant_folding=True,
            dynamo=False,
        )
    model = onnx.load_from_string(buf.getvalue())
    opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    if opsets.get("ai.onnx") != OPSET:
        raise ExportError(f"{path.name}: exported opset {opsets} is not {OPSET}")
    _check_dynamic_axes(model, dynamic_axes, path.name)
    _strip_doc_strings(model)
    onnx.checker.check_model(model, full_check=False)
    path.write_bytes(model.SerializeToString())
    return ExportedGraph(path.stem, path.name, tuple(input_names), tuple(output_names))


def _check_dynamic_axes(model: onnx.ModelProto, dynamic_axes: dict[str, dict[int, str]], name: str) -> None:
    values = {v.name: v for v in list(model.graph.input) + list(model.graph.output)}
    for tensor, axes in dynamic_axes.items():
        if tensor not in values:
            raise ExportError(f"{name}: declared dynamic tensor '{tensor}' is not a graph input/output")
        dims = values[tensor].type.tensor_type.shape.dim
        for axis in axes:
            if axis >= len(dims) or not dims[axis].dim_param:
                raise ExportError(f"{name}: axis {axis} of '{tensor}' is not dynamic in the exported graph")


def _strip_doc_strings(model: onnx.ModelProto) -> None:
    """Drop source-location doc strings so the bytes do not depend on where the code lives."""
    model.producer_version = ""
    for node in model.graph.node:
        node.doc_string = ""


def opset_of(path: Path) -> int:
    """Default-domain opset of an ONNX file."""
    model = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
