"""A bundle's large graphs with their weights in files of their own (ONNX external data): ONNX Runtime maps such a file
into memory instead of copying the weights onto its heap, so a weight the requests never read (most rows of a text
embedding) costs no memory, two sessions of one graph share one copy, the pages are the page cache's (shared by the
replicas of a host, and given back under pressure), and opening a graph makes no second copy of it.

`python -m export.external_data BUNDLE` moves an existing bundle's weights out; every exporter does it before it
publishes a bundle (export.bundle_writer.publish)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import external_data_helper, numpy_helper

from service.bundle import GROUP_PROMPT, MANIFEST_NAME, ModelBundle, sha256_file
from service.errors import BundleError

GRAPH_BYTES = 16 << 20  # graphs at least this large get a weights file (the committed tiny bundles stay one file each)
TENSOR_BYTES = 4096  # initializers at least this large move out; smaller ones (shapes, scalars) stay in the graph
ALIGN = 4096  # every weight starts on a page: mapped, it is as aligned as the kernels' loads want (64 B)
WEIGHTS_SUFFIX = ".weights"
_RAW = {
    onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.INT8: np.int8, onnx.TensorProto.UINT8: np.uint8, onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.INT64: np.int64,
}  # fmt: skip  # element types whose bytes are written as they are (little-endian, no packing)


def weights_name(graph_file: str) -> str:
    """`llm_step.onnx` -> `llm_step.weights`."""
    return Path(graph_file).stem + WEIGHTS_SUFFIX


def load_inline(path: Path) -> onnx.ModelProto:
    """The graph at `path` with every weight inside the proto (read from its weights file, if it has one): what a
    rewrite edits and saves as one file again."""
    model = onnx.load(str(path))
    external_data_helper.convert_model_from_external_data(model)
    return model


def externalize_graph(path: Path) -> bool:
    """Rewrite the graph at `path` with its large initializers in `weights_name(path)`, each on a page boundary;
    False (nothing written) for a graph smaller than GRAPH_BYTES that has no weights file yet."""
    weights = path.with_name(weights_name(path.name))
    if path.stat().st_size < GRAPH_BYTES and not weights.exists():
        return False
    model = onnx.load(str(path))  # reads a weights file it already has
    staged = weights.with_name(weights.name + ".partial")
    with staged.open("wb") as out:
        for tensor in _initializers(model.graph):
            if tensor.data_type in _RAW and _nbytes(tensor) >= TENSOR_BYTES:
                _move_out(tensor, out, weights.name)
    graph_staged = path.with_name(path.name + ".partial")
    onnx.save_model(model, str(graph_staged))
    staged.replace(weights)
    graph_staged.replace(path)
    return True


def externalize_bundle(bundle_dir: Path) -> tuple[str, ...]:
    """Give every large exporter-written graph of the bundle a weights file and record it (name and sha256) in the
    manifest; the prompt models copied from the checkpoint stay as they came. Returns the graphs rewritten."""
    manifest = ModelBundle.load(bundle_dir).manifest
    graphs = dict(manifest.graphs)
    moved = []
    for name, entry in manifest.graphs.items():
        if entry.group == GROUP_PROMPT or not externalize_graph(bundle_dir / entry.file):
            continue
        weights = weights_name(entry.file)
        graphs[name] = replace(entry, sha256=sha256_file(bundle_dir / entry.file), weights=weights,
                               weights_sha256=sha256_file(bundle_dir / weights))  # fmt: skip
        moved.append(name)
    if moved:
        (bundle_dir / MANIFEST_NAME).write_text(replace(manifest, graphs=graphs).to_json(), encoding="utf-8")
    return tuple(moved)


def _initializers(graph: onnx.GraphProto) -> list[onnx.TensorProto]:
    """The graph's initializers and those of its subgraphs (If/Loop bodies)."""
    found = list(graph.initializer)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                found += _initializers(attr.g)
            found += [t for g in attr.graphs for t in _initializers(g)]
    return found


def _nbytes(tensor: onnx.TensorProto) -> int:
    return int(np.prod(tensor.dims, dtype=np.int64)) * np.dtype(_RAW[tensor.data_type]).itemsize


def _move_out(tensor: onnx.TensorProto, out: BinaryIO, location: str) -> None:
    """Append the tensor's bytes to `out` at the next page boundary and point the tensor at them."""
    data = numpy_helper.to_array(tensor).astype(_RAW[tensor.data_type], copy=False).tobytes()
    offset = -(-out.tell() // ALIGN) * ALIGN
    out.seek(offset)
    out.write(data)
    name, dims, dtype = tensor.name, list(tensor.dims), tensor.data_type
    tensor.Clear()
    tensor.name, tensor.data_type = name, dtype
    tensor.dims.extend(dims)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(len(data)))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Move a bundle's large graphs' weights into mapped weights files.")
    parser.add_argument("bundle", type=Path)
    args = parser.parse_args(argv)
    try:
        moved = externalize_bundle(args.bundle)
        ModelBundle.load(args.bundle, verify_hashes=True)
    except (BundleError, OSError, onnx.checker.ValidationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.bundle}: weights files for {', '.join(moved)}" if moved else f"{args.bundle}: nothing to move")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
