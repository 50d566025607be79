"""What the graph modules of the families share: names from a bundle contract, a verification session, max error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
from torch import Tensor

from service.bundle import expand_io_names
from service.bundle.family import GraphIO


def graph_names(graph_io: GraphIO, graph: str, num_layers: int, counts: dict[str, int]) -> tuple[list[str], list[str]]:
    """Expanded input and output names of `graph` in a family's `graph_io` (`counts`: its templates besides `{i}`)."""
    inputs, outputs = graph_io[graph]
    return expand_io_names(inputs, num_layers, counts), expand_io_names(outputs, num_layers, counts)


def session(path: Path) -> ort.InferenceSession:
    """A one-thread CPU session for verification."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def run(sess: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """sess.run with float inputs cast to the type the graph declares (an int8 twin takes float16 K/V caches)."""
    types = {i.name: _ORT_TYPES.get(i.type) for i in sess.get_inputs()}
    cast = {n: a.astype(types[n]) if types.get(n) is not None and a.dtype.kind == "f" else a for n, a in feeds.items()}
    return list(sess.run(None, cast))


def max_error(got: list[np.ndarray], want: list[Tensor]) -> float:
    """Largest difference over pairs of arrays, each divided by max(1, the array's peak |value|).

    Outputs of unit scale (log-probs, mel, velocity) are compared in absolute terms; the caches a chunk call
    returns (conv tails of embeddings scaled by sqrt(512), peaks near 100) in terms of their own scale.
    """
    err = 0.0
    for g, w in zip(got, want, strict=True):
        ref = w.detach().numpy()
        if g.shape != ref.shape:
            raise ValueError(f"ONNX output shape {g.shape} != torch {ref.shape}")
        if g.size:
            scale = max(1.0, float(np.abs(ref).max()))
            err = max(err, float(np.abs(g.astype(np.float32) - ref).max()) / scale)
    return err
