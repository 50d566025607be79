"""Native twins (service.bundle GROUP_NATIVE): a quantized CosyVoice2 flow estimator whose attention cores are one
`cosyvoice_lite.CachedAttention` node each, run by our kernel (service/engine/native).

`python -m export.native_twin BUNDLE` adds the twin to a bundle exported before it existed; the CosyVoice2 exporter
writes it into every quantized bundle. The rewrite matches the attention core our exporter emits for
`CachedAttention.chunk_step` (export/cosyvoice2/modules/estimator.py): from the new frames' q, k, v projections and
the float16 caches to the tensor fed to `to_out`. The scores, mask, softmax and value products in between become the
node; everything else (projections, new keys/values narrowed for the cache, norms, feed-forward) stays as it is.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from export.onnx_io import ExportError
from service.bundle import (
    FAMILY_V2,
    GROUP_NATIVE,
    MANIFEST_NAME,
    NATIVE_DOMAIN,
    NATIVE_GRAPHS,
    NATIVE_SUFFIX,
    ModelBundle,
    sha256_file,
)
from service.errors import BundleError

OP_NAME = "CachedAttention"
CHUNK_INPUT = "chunk"


class RewriteError(ExportError):
    """The graph does not hold the attention cores our exporter writes (nothing was changed on disk)."""


class _Graph:
    """Producer and consumer lookups over a graph's nodes."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.producer = {out: node for node in graph.node for out in node.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.initializers = {init.name: init for init in graph.initializer}

    def made_by(self, tensor: str, op_type: str) -> onnx.NodeProto:
        node = self.producer.get(tensor)
        if node is None or node.op_type != op_type:
            found = "a graph input or initializer" if node is None else node.op_type
            raise RewriteError(f"{tensor!r} comes from {found}, expected {op_type}")
        return node

    def only_consumer(self, tensor: str, op_type: str) -> onnx.NodeProto:
        users = self.consumers.get(tensor, [])
        if len(users) != 1 or users[0].op_type != op_type:
            raise RewriteError(f"{tensor!r} feeds {[u.op_type for u in users]}, expected one {op_type}")
        return users[0]

    def constant(self, tensor: str) -> np.ndarray:
        if tensor in self.initializers:
            return numpy_helper.to_array(self.initializers[tensor])
        node = self.made_by(tensor, "Constant")
        return numpy_helper.to_array(node.attribute[0].t)


def _heads_input(g: _Graph, transposed: str) -> str:
    """The (B,T,H*DK) tensor behind a per-head view: Transpose(Reshape(x)) -> x."""
    return g.made_by(g.made_by(transposed, "Transpose").input[0], "Reshape").input[0]


def _cache_input(g: _Graph, transposed: str) -> str:
    """The float16 cache input behind Transpose(Cast(past))."""
    return g.made_by(g.made_by(transposed, "Transpose").input[0], "Cast").input[0]


def _attention_core(g: _Graph, softmax: onnx.NodeProto) -> tuple[list[str], str, float]:
    """The inputs (q, k, v, past_k, past_v), output and score scale of the core around `softmax`."""
    masked = g.made_by(softmax.input[0], "Add")
    scaled = g.made_by(masked.input[0], "Mul")
    scores = g.made_by(scaled.input[0], "Concat")
    past_scores, new_scores = (g.made_by(name, "MatMul") for name in scores.input)
    q = _heads_input(g, past_scores.input[0])
    past_k = _cache_input(g, past_scores.input[1])
    k = _heads_input(g, new_scores.input[1])
    products = [g.only_consumer(s.output[0], "MatMul") for s in g.consumers.get(softmax.output[0], [])]
    if len(products) != 2:
        raise RewriteError(f"{softmax.name}: expected two value products after the softmax")
    from_cache = [p for p in products if _reads_cache(g, p.input[1])]
    if len(from_cache) != 1:
        raise RewriteError(f"{softmax.name}: expected one value product over the cache and one over the new frames")
    past_product = from_cache[0]
    new_product = next(p for p in products if p is not past_product)
    past_v = _cache_input(g, past_product.input[1])
    v = _heads_input(g, new_product.input[1])
    total = g.only_consumer(past_product.output[0], "Add")
    merged = g.only_consumer(g.only_consumer(total.output[0], "Transpose").output[0], "Reshape")
    scale = float(np.asarray(g.constant(scaled.input[1])).reshape(-1)[0])
    return [q, k, v, past_k, past_v], merged.output[0], scale


def _reads_cache(g: _Graph, tensor: str) -> bool:
    """Whether `tensor` is Transpose(Cast(a graph input)): a per-head view of a float16 cache."""
    transpose = g.producer.get(tensor)
    cast = g.producer.get(transpose.input[0]) if transpose is not None and transpose.op_type == "Transpose" else None
    return cast is not None and cast.op_type == "Cast" and cast.input[0] not in g.producer


def fuse_attention(model: onnx.ModelProto) -> int:
    """Replace every attention core of the estimator graph in `model` by one CachedAttention node (in place) and drop
    the nodes nothing reads any more; returns how many cores were replaced. RewriteError when a core does not match."""
    graph = model.graph
    g = _Graph(graph)
    caches = {i.name: i for i in graph.input}
    fused: dict[str, onnx.NodeProto] = {}  # a core's output tensor -> the node that now makes it
    for softmax in [n for n in graph.node if n.op_type == "Softmax"]:
        inputs, output, scale = _attention_core(g, softmax)
        if inputs[3] not in caches:
            raise RewriteError(f"{inputs[3]!r} is not a graph input")
        dims = caches[inputs[3]].type.tensor_type.shape.dim
        heads, head_dim = dims[2].dim_value, dims[3].dim_value
        if heads < 1 or head_dim < 1 or not np.isclose(scale, head_dim**-0.5, rtol=1e-6):
            raise RewriteError(f"{inputs[3]}: heads {heads}, head dim {head_dim}, score scale {scale}")
        fused[output] = helper.make_node(
            OP_NAME, [*inputs, CHUNK_INPUT], [output], name=f"attention_{inputs[3]}", domain=NATIVE_DOMAIN,
            heads=heads, scale=scale,
        )  # fmt: skip
    # each node takes the place of the one that made its output, after every producer of its inputs: still in order
    kept = [fused.get(n.output[0], n) if len(n.output) == 1 else n for n in graph.node]
    live = _live(kept, [o.name for o in graph.output])
    del graph.node[:]
    graph.node.extend(live)
    used = {name for node in live for name in node.input}
    keep_inits = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep_inits)
    if not any(op.domain == NATIVE_DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(NATIVE_DOMAIN, 1))
    return len(fused)


def _live(nodes: list[onnx.NodeProto], outputs: list[str]) -> list[onnx.NodeProto]:
    by_output = {out: node for node in nodes for out in node.output}
    seen: set[int] = set()
    stack = list(outputs)
    while stack:
        node = by_output.get(stack.pop())
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            stack.extend(name for name in node.input if name)
    return [n for n in nodes if id(n) in seen]


def write_native_twin(bundle_dir: Path, log: Callable[[str], None] = print) -> str | None:
    """Add the native twin of each NATIVE_GRAPHS graph to the quantized CosyVoice2 bundle in `bundle_dir` (file and
    manifest entry); returns the twin's graph name, or None when the bundle takes none (fp32: the official
    computation stays exact; v1: no cached attention). RewriteError when the graph does not match."""
    manifest = ModelBundle.load(bundle_dir).manifest
    if manifest.family != FAMILY_V2 or manifest.precision == "fp32":
        return None
    graphs = dict(manifest.graphs)
    written = None
    for name in NATIVE_GRAPHS:
        entry = graphs[name]
        model = onnx.load(str(bundle_dir / entry.file))
        count = fuse_attention(model)
        want = manifest.cosyvoice2.estimator_blocks if manifest.cosyvoice2 else count
        if count != want:
            raise RewriteError(f"{entry.file}: rewrote {count} attention cores, the estimator has {want}")
        onnx.checker.check_model(model)
        twin = bundle_dir / f"{name}{NATIVE_SUFFIX}.onnx"
        onnx.save(model, str(twin))
        graphs[name + NATIVE_SUFFIX] = replace(entry, file=twin.name, sha256=sha256_file(twin), group=GROUP_NATIVE)
        written = name + NATIVE_SUFFIX
        log(f"native twin: {twin.name} ({count} attention cores as {NATIVE_DOMAIN}.{OP_NAME})")
    (bundle_dir / MANIFEST_NAME).write_text(replace(manifest, graphs=graphs).to_json(), encoding="utf-8")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Add the native twin of the flow estimator to a quantized CosyVoice2 bundle.")
    parser.add_argument("bundle", type=Path)
    args = parser.parse_args(argv)
    try:
        bundle = ModelBundle.load(args.bundle)
        if any(name + NATIVE_SUFFIX in bundle.manifest.graphs for name in NATIVE_GRAPHS):
            print(f"{args.bundle}: already has its native twin")
            return 0
        if write_native_twin(args.bundle) is None:
            print(f"{args.bundle}: takes no native twin (fp32 or CosyVoice 1 bundle)")
        ModelBundle.load(args.bundle, verify_hashes=True)
    except (ExportError, BundleError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
