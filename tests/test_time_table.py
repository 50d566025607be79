"""The estimator twins' time table (export/time_table.py): what a graph computes from its time input alone, looked up at
the solver's step times behind an `If`, computed by the original nodes at any other time, with the same numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from export.time_table import tabulate_time_inputs
from export.twin_graph import RewriteError
from service.bundle.solver import cosine_t_span, euler_times
from service.engine import native


def toy_estimator(rows_axis: bool = True) -> onnx.ModelProto:
    """x (B, 4) + a time embedding of t (B,) through a weight (sin, cos, matmul, SiLU): the shape of an estimator's
    time path; without `rows_axis` the time result is reduced over its rows (no row per time)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((2, 4)).astype(np.float32), "w")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    nodes = [
        helper.make_node("Unsqueeze", ["t", "axes"], ["t1"]),
        helper.make_node("Sin", ["t1"], ["s"]),
        helper.make_node("Cos", ["t1"], ["c"]),
        helper.make_node("Concat", ["s", "c"], ["sc"], axis=1),
        helper.make_node("MatMul", ["sc", "w"], ["h"]),
        helper.make_node("Sigmoid", ["h"], ["g"]),
        helper.make_node("Mul", ["h", "g"], ["emb"]),
    ]
    if not rows_axis:
        nodes.append(helper.make_node("ReduceSum", ["emb"], ["emb_all"], keepdims=0))
    nodes.append(helper.make_node("Add", ["x", "emb" if rows_axis else "emb_all"], ["y"]))
    graph = helper.make_graph(
        nodes, "toy",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4]),
            helper.make_tensor_value_info("t", TensorProto.FLOAT, ["B"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 4])], [w, axes],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def run(model: onnx.ModelProto, x: np.ndarray, t: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["y"], {"x": x, "t": t})[0])


def test_the_solver_and_the_table_share_the_step_times() -> None:
    times, steps = euler_times(10)
    t_span = cosine_t_span(10)
    assert times[0] == t_span[0] and np.allclose(times, t_span[:-1], atol=1e-6)
    assert np.isclose(times[-1] + steps[-1], t_span[-1], atol=1e-6)


def test_a_tabulated_graph_computes_the_same_numbers_at_every_time() -> None:
    model = toy_estimator()
    table = toy_estimator()
    times, _ = euler_times(10)
    assert tabulate_time_inputs(table, [float(t) for t in times], None) == 1
    onnx.checker.check_model(table)
    ops = [n.op_type for n in table.graph.node]
    assert "If" in ops and "MatMul" not in ops  # the time path lives in the If's fallback branch
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    for t in (
        np.full(3, times[0]),
        np.array([times[2], times[7], times[2]]),
        np.array([times[1], 0.123, times[4]]),
        np.full(3, 2.5),
    ):
        t32 = t.astype(np.float32)
        np.testing.assert_array_equal(run(table, x, t32), run(model, x, t32))


def test_the_table_is_what_the_graph_computes_not_what_it_would_at_the_span() -> None:
    """A time one bit off a step's is not in the table: the fallback computes it (a lookup never rounds)."""
    table = toy_estimator()
    times, _ = euler_times(10)
    tabulate_time_inputs(table, [float(t) for t in times], None)
    off = np.nextafter(times[5], np.float32(1.0)).reshape(1)
    x = np.zeros((1, 4), np.float32)
    np.testing.assert_array_equal(run(table, x, off), run(toy_estimator(), x, off))


def test_a_time_result_without_a_row_per_time_is_refused() -> None:
    with pytest.raises(RewriteError, match="no row per time"):
        tabulate_time_inputs(toy_estimator(rows_axis=False), [0.0, 0.5], None)


def test_a_graph_with_nothing_computed_from_time_alone_is_left_alone() -> None:
    model = toy_estimator()
    before = model.SerializeToString()
    assert tabulate_time_inputs(model, [0.0], None, time_input="x") == 0
    assert model.SerializeToString() == before


@pytest.mark.parametrize("bundle", ["models/tiny-cosyvoice2", "models/tiny-cosyvoice3"])
def test_the_committed_estimator_twins_look_their_time_up_and_compute_the_same(bundle: str) -> None:
    """The committed twins hold the table; with the solver's times and with another time they compute what the same
    twin computes with the table's If forced to its fallback."""
    if not native.LIBRARY_PATH.is_file():
        pytest.skip(native.probe().reason)
    root = Path(__file__).resolve().parents[1]
    model = onnx.load(str(root / bundle / "flow_estimator_native.onnx"))
    choose = next(n for n in model.graph.node if n.op_type == "If")
    forced = onnx.ModelProto()
    forced.CopyFrom(model)
    fallback = next(n for n in forced.graph.node if n.op_type == "If")
    fallback.input[0] = "time_table/never"
    forced.graph.initializer.append(numpy_helper.from_array(np.array(False), "time_table/never"))
    assert choose.input[0] == "time_table/tabulated"
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(native.LIBRARY_PATH))
    sessions = [ort.InferenceSession(m.SerializeToString(), options) for m in (model, forced)]
    rng = np.random.default_rng(3)
    feeds: dict[str, np.ndarray] = {}
    for i in sessions[0].get_inputs():
        if i.name in ("chunk", "start"):
            feeds[i.name] = np.array([8 if i.name == "chunk" else 5], np.int64)
            continue
        shape = [{"B": 1, "M": 6, "C": 5}.get(d, 1) if isinstance(d, str) else d for d in i.shape]
        if i.type == "tensor(int8)":  # a cache read as the engine keeps it (its scales are float inputs)
            feeds[i.name] = rng.integers(-127, 128, shape).astype(np.int8)
            continue
        dtype = np.float16 if i.type == "tensor(float16)" else np.float32
        feeds[i.name] = (rng.standard_normal(shape) * 0.5).astype(dtype)
    times, _ = euler_times(10)
    for t in (times[0], times[6], np.float32(0.37)):
        feeds["t"] = np.full(1, t, np.float32)
        got, want = (s.run(None, feeds) for s in sessions)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
