"""What the native-twin rewrites share: the names of our operators, the error they raise, lookups over a graph's
nodes, and putting fused nodes in place (topological order kept, dead nodes and initializers dropped)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from export.onnx_io import ExportError
from service.bundle import NATIVE_DOMAIN

# Our operators (service/engine/native, domain NATIVE_DOMAIN), by the node type a twin writes.
OP_NAME = "CachedAttention"
INT8_OP_NAME = "Int8MatMul"
BLOCK_OP_NAME = "EstimatorBlock"
QWEN2_OP_NAME = "Qwen2Layer"
RELPOS_OP_NAME = "RelPosLayer"  # a CosyVoice-300M decoder layer (export/cosyvoice1/relpos_twin.py)
CONV_OP_NAME = "BF16Conv1d"  # a vocoder's convolution with bf16 products
NORM_MISH_OP_NAME = "NormMish"  # an estimator ResNet block's norm and Mish (export/fuse_resnet.py)


class RewriteError(ExportError):
    """The graph does not hold the attention cores our exporter writes (nothing was changed on disk)."""


class Graph:
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
        node = self.producer.get(tensor)
        if node is not None and node.op_type == "Identity":  # the exporter's alias of a shared initializer
            return self.constant(node.input[0])
        node = self.made_by(tensor, "Constant")
        return numpy_helper.to_array(node.attribute[0].t)

    def other_input(self, node: onnx.NodeProto, known: str) -> str:
        """The input of two-input `node` that is not `known`."""
        if len(node.input) != 2 or known not in node.input:
            raise RewriteError(f"{node.name}: expected two inputs, one of them {known!r}")
        return node.input[1] if node.input[0] == known else node.input[0]

    def made_by_either(self, node: onnx.NodeProto, op_type: str) -> tuple[onnx.NodeProto, str]:
        """The node of `op_type` making one of `node`'s two inputs, and the other input."""
        for name in node.input:
            maker = self.producer.get(name)
            if maker is not None and maker.op_type == op_type:
                return maker, self.other_input(node, name)
        raise RewriteError(f"{node.name}: no input comes from {op_type}")


def attr(node: onnx.NodeProto, name: str) -> object:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


def replace_nodes(model: onnx.ModelProto, fused: dict[str, onnx.NodeProto]) -> None:
    """Put each new node where the node making its output was, drop what nothing reads any more, keep the order
    topological (`install`) and declare our domain."""
    graph = model.graph
    kept = [fused.get(n.output[0], n) if len(n.output) == 1 else n for n in graph.node]
    install(graph, live_nodes(kept, [o.name for o in graph.output]))
    if not any(op.domain == NATIVE_DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(NATIVE_DOMAIN, 1))


def install(graph: onnx.GraphProto, live: list[onnx.NodeProto]) -> None:
    """Make `live` the graph's nodes, in its order except where a node reads what a later one makes (a fused node with
    several outputs stands where its last output was made, after nodes that read its first ones): such a node moves to
    just after its inputs exist. Drop the initializers none of them reads."""
    known = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    ordered: list[onnx.NodeProto] = []
    waiting: list[onnx.NodeProto] = []
    for node in live:
        if not all(name in known for name in node.input):
            waiting.append(node)
            continue
        ordered.append(node)
        known.update(node.output)
        while waiting and (ready := [n for n in waiting if all(name in known for name in n.input)]):
            for n in ready:
                ordered.append(n)
                known.update(n.output)
            moved = {id(n) for n in ready}
            waiting = [n for n in waiting if id(n) not in moved]
    if waiting:
        raise RewriteError(f"{waiting[0].name}: its inputs are never made (a cycle in the rewritten graph)")
    del graph.node[:]
    graph.node.extend(ordered)
    used = {name for node in ordered for name in node.input}
    keep_inits = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep_inits)


def live_nodes(nodes: list[onnx.NodeProto], outputs: list[str]) -> list[onnx.NodeProto]:
    by_output = {out: node for node in nodes for out in node.output}
    seen: set[int] = set()
    stack = list(outputs)
    while stack:
        node = by_output.get(stack.pop())
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            stack.extend(name for name in node.input if name)
    return [n for n in nodes if id(n) in seen]
