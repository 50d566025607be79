"""Where a graph's initializers lie in its weights file (`<graph>.weights`, export/external_data.py), and which
operators its nodes run: read from the ONNX file's protobuf encoding directly (the serving side has no `onnx`
package), only as far as the initializers' names, types, shapes and external-data records and the nodes' types."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# onnx.proto's field numbers: ModelProto.graph, GraphProto.node and .initializer, NodeProto.op_type, and TensorProto's
# fields read here
_MODEL_GRAPH, _GRAPH_NODE, _GRAPH_INITIALIZER, _NODE_OP_TYPE = 7, 1, 5, 4
_TENSOR_DIMS, _TENSOR_TYPE, _TENSOR_NAME, _TENSOR_EXTERNAL, _TENSOR_LOCATION = 1, 2, 8, 13, 14
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL
# TensorProto.DataType -> numpy (the types a weights file holds)
ONNX_TYPES: dict[int, type[np.generic]] = {
    1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64, 9: np.bool_,
    10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64,
}  # fmt: skip


@dataclass(frozen=True)
class ExternalTensor:
    """One initializer kept outside its graph: `length` bytes at `offset` of the file `location` (next to the graph)."""

    name: str
    dtype: type[np.generic]
    dims: tuple[int, ...]
    location: str
    offset: int
    length: int

    def nbytes(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def external_tensors(graph: Path) -> list[ExternalTensor]:
    """The initializers of the ONNX file `graph` whose data is external (in a type numpy has), in file order; raises
    ValueError for a file that is not a protobuf message."""
    with _not_onnx(graph):
        return [t for tensor in _graph_items(graph, _GRAPH_INITIALIZER) if (t := _external(tensor)) is not None]


def op_types(graph: Path) -> frozenset[str]:
    """The operator types of the ONNX file `graph`'s top-level nodes; raises ValueError for a file that is not a
    protobuf message."""
    with _not_onnx(graph):
        nodes = _graph_items(graph, _GRAPH_NODE)
        return frozenset(bytes(v).decode() for node in nodes for f, _, v in _fields(node) if f == _NODE_OP_TYPE)


def _graph_items(graph: Path, wanted: int) -> Iterator[memoryview]:
    """The GraphProto fields numbered `wanted` of the ONNX file `graph`, in file order."""
    for field, _, model_graph in _fields(memoryview(Path(graph).read_bytes())):
        if field == _MODEL_GRAPH:
            yield from (value for item, _, value in _fields(model_graph) if item == wanted)


@contextmanager
def _not_onnx(graph: Path) -> Iterator[None]:
    """A message cut short or a name that is not text, read as what it says of the file: a ValueError."""
    try:
        yield
    except (IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"{graph}: not an ONNX file ({e})") from e


def _external(tensor: memoryview) -> ExternalTensor | None:
    dims: list[int] = []
    dtype, name, location = 0, "", 0
    records: dict[str, str] = {}
    for field, wire, value in _fields(tensor):
        if field == _TENSOR_DIMS:
            dims.extend(_packed(value) if wire == 2 else [value])
        elif field == _TENSOR_TYPE:
            dtype = value
        elif field == _TENSOR_NAME:
            name = bytes(value).decode()
        elif field == _TENSOR_LOCATION:
            location = value
        elif field == _TENSOR_EXTERNAL:
            entry = {key: bytes(text).decode() for key, _, text in _fields(value)}
            records[entry.get(1, "")] = entry.get(2, "")
    if location != _EXTERNAL or dtype not in ONNX_TYPES or "location" not in records:
        return None
    return ExternalTensor(
        name,
        ONNX_TYPES[dtype],
        tuple(dims),
        records["location"],
        int(records.get("offset", "0")),
        int(records.get("length", "-1")),
    )


def _varint(data: memoryview, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _packed(data: memoryview) -> list[int]:
    values, i = [], 0
    while i < len(data):
        value, i = _varint(data, i)
        values.append(value)
    return values


def _fields(data: memoryview) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a protobuf message: an int for varints, a memoryview otherwise."""
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
            yield field, wire, value
        elif wire == 2:
            size, i = _varint(data, i)
            yield field, wire, data[i : i + size]
            i += size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            yield field, wire, data[i : i + size]
            i += size
        else:
            raise ValueError(f"wire type {wire}: not an ONNX file")
