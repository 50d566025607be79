"""What an estimator computes from its time input alone, tabulated at the solver's step times (a native twin's).

A flow estimator turns the time t of an Euler step into modulations through weights of its own: Fun-CosyVoice3's DiT
maps it to six AdaLN vectors per block (22 products of 1024 x 6144, 138 MB of int8 weights for one row of output),
the U-Net estimators to one time vector per ResNet block. A streamed chunk runs each guidance row as its own call, so
that part streamed its weights from memory twice per step for values that depend on t alone; in a DiT call of 25 new
frames it was about a sixth of the call.

The solver feeds the same n times to every call (service.bundle.solver.euler_times), so the twin holds their results:
one `If` on whether every row's t is one of them; then each result is a row gathered from its table, else the
original nodes compute it (any other time: another step count, a caller of the graph alone). The tables are what
those very nodes computed at export (ONNX Runtime with our kernels, whose variants agree bit for bit), so a tabulated
call gives the numbers an untabulated one would on the host that exported it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export.twin_graph import RewriteError

TABLE_PREFIX = "time_table"


def _time_region(graph: onnx.GraphProto, time_input: str) -> tuple[list[int], list[str]]:
    """The indices of the nodes whose inputs are the time input, constants or other such nodes' outputs (in graph
    order), and the outputs of theirs read by any other node or by the graph."""
    nodes = list(graph.node)
    constants = {t.name for t in graph.initializer} - {i.name for i in graph.input}
    constants.update(o for n in nodes if n.op_type == "Constant" for o in n.output)
    derived = {time_input}
    region: list[int] = []
    for index, node in enumerate(nodes):
        inputs = [i for i in node.input if i]
        if (
            node.op_type != "Constant"
            and any(i in derived for i in inputs)
            and all(i in derived or i in constants for i in inputs)
        ):
            region.append(index)
            derived.update(node.output)
    inside = set(region)
    read_outside = {i for k, n in enumerate(nodes) if k not in inside for i in n.input} | {o.name for o in graph.output}
    frontier = [o for k in region for o in nodes[k].output if o in read_outside]
    return region, frontier


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    return copy


def _evaluate(
    model: onnx.ModelProto,
    region: list[onnx.NodeProto],
    frontier: list[str],
    time_input: str,
    times: np.ndarray,
    library: str | None,
) -> list[np.ndarray]:
    """The region's frontier values at `times` (a batch of len(times) rows), by ONNX Runtime."""
    import onnxruntime as ort

    used = {i for n in region for i in n.input}
    inits = [t for t in model.graph.initializer if t.name in used]
    consts = [n for n in model.graph.node if n.op_type == "Constant" and n.output[0] in used]
    graph = helper.make_graph(
        consts + region, "time_region",
        [helper.make_tensor_value_info(time_input, TensorProto.FLOAT, [len(times)])],
        [helper.make_empty_tensor_value_info(name) for name in frontier], inits,
    )  # fmt: skip
    sub = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    if library is not None:
        options.register_custom_ops_library(library)
    session = ort.InferenceSession(sub.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return [np.asarray(v) for v in session.run(frontier, {time_input: times.astype(np.float32)})]


def tabulate_time_inputs(model: onnx.ModelProto, times: Sequence[float], library: str | None, time_input: str = "t") -> int:
    """Tabulate, in place, what `model` computes from `time_input` alone at `times` (the solver's step times, float32),
    behind an `If` that falls back to the original nodes for any other time; `library`: our kernels for ONNX Runtime
    when the region holds any. Returns the number of tabulated tensors (0: nothing depends on t alone, and the model is
    unchanged). RewriteError when a result has no leading batch axis (a row per time) to gather."""
    graph = model.graph
    indices, frontier = _time_region(graph, time_input)
    if not frontier:
        return 0
    all_nodes = list(graph.node)
    region = [all_nodes[k] for k in indices]
    grid = np.asarray(times, dtype=np.float32)
    values = _evaluate(model, region, frontier, time_input, grid, library)
    for name, value in zip(frontier, values, strict=True):
        if value.ndim == 0 or value.shape[0] != len(grid):
            raise RewriteError(f"{name!r} computed from {time_input!r} alone has shape {value.shape}: no row per time")
    # a result computed row by row must not depend on its batch: the first time alone gives the same bits
    alone = _evaluate(model, region, frontier, time_input, grid[:1], library)
    for name, value, first_row in zip(frontier, values, alone, strict=True):
        if not np.array_equal(first_row[0], value[0]):
            raise RewriteError(f"{name!r} computed from {time_input!r} alone depends on the batch it is computed in")
    p = TABLE_PREFIX
    tables = [numpy_helper.from_array(np.ascontiguousarray(v), f"{p}/{name}") for name, v in zip(frontier, values, strict=True)]
    grid_init = numpy_helper.from_array(grid.reshape(1, -1), f"{p}/times")
    axes = numpy_helper.from_array(np.array([1], dtype=np.int64), f"{p}/axes")
    zero = numpy_helper.from_array(np.array(0.0, dtype=np.float32), f"{p}/zero")
    lookup = [
        helper.make_node("Unsqueeze", [time_input, axes.name], [f"{p}/t_column"]),
        helper.make_node("Sub", [f"{p}/t_column", grid_init.name], [f"{p}/delta"]),
        helper.make_node("Abs", [f"{p}/delta"], [f"{p}/distance"]),
        helper.make_node("ArgMin", [f"{p}/distance"], [f"{p}/row"], axis=1, keepdims=0),
        helper.make_node("ReduceMin", [f"{p}/distance"], [f"{p}/nearest"], axes=[1], keepdims=0),
        helper.make_node("ReduceMax", [f"{p}/nearest"], [f"{p}/farthest"], keepdims=0),
        helper.make_node("Equal", [f"{p}/farthest", zero.name], [f"{p}/tabulated"]),
    ]
    typed = [helper.make_tensor_value_info(f"{name}{{}}", helper.np_dtype_to_tensor_dtype(v.dtype), None)
             for name, v in zip(frontier, values, strict=True)]  # fmt: skip
    gathers = [
        helper.make_node("Gather", [t.name, f"{p}/row"], [f"{name}/gathered"], axis=0)
        for name, t in zip(frontier, tables, strict=True)
    ]
    gathered = helper.make_graph(
        gathers, "tabulated", [], [onnx.ValueInfoProto(name=v.name.format("/gathered"), type=v.type) for v in typed]
    )
    renamed = {name: f"{name}/computed" for name in frontier}
    computed_nodes = []
    for node in region:
        copy = _copy(node)
        for i, out in enumerate(copy.output):
            if out in renamed:
                copy.output[i] = renamed[out]
        for i, inp in enumerate(copy.input):
            if inp in renamed:
                copy.input[i] = renamed[inp]
        computed_nodes.append(copy)
    computed = helper.make_graph(
        computed_nodes, "computed", [], [onnx.ValueInfoProto(name=v.name.format("/computed"), type=v.type) for v in typed]
    )
    choose = helper.make_node("If", [f"{p}/tabulated"], list(frontier), then_branch=gathered, else_branch=computed)
    # the If and the constants its branches read from the graph go where the first tabulated node was
    used = {i for n in region for i in n.input}
    moved = {k for k, n in enumerate(all_nodes) if n.op_type == "Constant" and n.output[0] in used}
    inside = set(indices) | moved
    first = min(inside)
    placed = [all_nodes[k] for k in sorted(moved)] + lookup + [choose]
    before = [all_nodes[k] for k in range(first) if k not in inside]
    after = [all_nodes[k] for k in range(first, len(all_nodes)) if k not in inside]
    nodes = [_copy(n) for n in (*before, *placed, *after)]
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend([*tables, grid_init, axes, zero])
    return len(frontier)
