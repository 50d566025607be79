"""Functional stand-ins for campplus.onnx and speech_tokenizer_v2.onnx: the released signatures, tiny random weights.

campplus.onnx (CAM++, the same file in every CosyVoice release): `input` float32 [B, T, 80] (mean-subtracted Kaldi
fbank) -> `output` float32 [B, 192]. speech_tokenizer_v2.onnx (S3 tokenizer v2, 25 tokens/s, FSQ codebook 3^8 = 6561):
`feats` float32 [B, 128, T] (whisper log-mel, 100 frames/s) and `feats_length` int32 [B] -> `indices` int64 [B, T2],
T2 = ((T - 1) // 2 + 1 - 1) // 2 + 1 (two stride-2 convolutions). Outputs depend on the inputs, so prompt analysis runs
end to end; they are not the real models. Built node by node at opset 13 (default domain only), checked by onnx.checker.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 13
IR_VERSION = 7  # what opset 13 needs; onnxruntime builds of this project read it
FSQ_LEVELS = 3
FSQ_DIMS = 8
FSQ_SCALE = 0.9990000128746033  # the S3 tokenizer v2's FSQ scale before rounding
# Exposed so the fixture harness can report how close each token was to a rounding boundary (stand-in only).
FSQ_PRE_ROUND = "fsq_scaled"


def _weights(rng: np.random.RandomState, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    return (rng.uniform(-1.0, 1.0, shape) / np.sqrt(fan_in)).astype(np.float32)


def _model(
    nodes: list[onnx.NodeProto], inputs: list, outputs: list, weights: dict[str, np.ndarray], name: str
) -> onnx.ModelProto:
    init = [numpy_helper.from_array(value, key) for key, value in weights.items()]
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=init)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="cv2_reference.standins")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def campplus(seed: int) -> onnx.ModelProto:
    """[B, T, 80] -> two k3 convolutions with ReLU, mean and std pooling over time, linear 256 -> 192."""
    rng = np.random.RandomState(seed)
    w = {
        "c1_w": _weights(rng, (64, 80, 3), 240),
        "c1_b": _weights(rng, (64,), 240),
        "c2_w": _weights(rng, (128, 64, 3), 192),
        "c2_b": _weights(rng, (128,), 192),
        "fc_w": _weights(rng, (256, 192), 256),
        "fc_b": _weights(rng, (192,), 256),
        "eps": np.array([1e-5], dtype=np.float32),
    }
    nodes = [
        helper.make_node("Transpose", ["input"], ["x_t"], perm=[0, 2, 1]),
        helper.make_node("Conv", ["x_t", "c1_w", "c1_b"], ["c1"], pads=[1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "c2_w", "c2_b"], ["c2"], pads=[1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("ReduceMean", ["r2"], ["mean"], axes=[2], keepdims=0),
        helper.make_node("ReduceMean", ["r2"], ["mean_k"], axes=[2], keepdims=1),
        helper.make_node("Sub", ["r2", "mean_k"], ["centred"]),
        helper.make_node("Mul", ["centred", "centred"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["var"], axes=[2], keepdims=0),
        helper.make_node("Add", ["var", "eps"], ["var_eps"]),
        helper.make_node("Sqrt", ["var_eps"], ["std"]),
        helper.make_node("Concat", ["mean", "std"], ["stats"], axis=1),
        helper.make_node("MatMul", ["stats", "fc_w"], ["fc"]),
        helper.make_node("Add", ["fc", "fc_b"], ["output"]),
    ]
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["B", "T", 80])]
    outputs = [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", 192])]
    return _model(nodes, inputs, outputs, w, "campplus_standin")


def speech_tokenizer_v2(seed: int) -> onnx.ModelProto:
    """Frames at or beyond feats_length zeroed; two k3 stride-2 convolutions with tanh; FSQ as in the S3 tokenizer v2.

    FSQ: project to 8 dims, tanh, scale by 0.999, round (half to even), + 1 -> digits in {0, 1, 2}; index = sum of
    digit_d * 3^d, so codes cover 0..6560 like the real tokenizer.
    """
    rng = np.random.RandomState(seed)
    w = {
        "c1_w": _weights(rng, (64, 128, 3), 384) * 4,
        "c1_b": _weights(rng, (64,), 384),
        "c2_w": _weights(rng, (32, 64, 3), 192) * 4,
        "c2_b": _weights(rng, (32,), 192),
        "proj_w": _weights(rng, (32, FSQ_DIMS), 32) * 4,
        "proj_b": _weights(rng, (FSQ_DIMS,), 32),
        "frame_index": np.zeros((1,), dtype=np.int64),
        "one": np.ones((1,), dtype=np.float32),
        "fsq_scale": np.array([FSQ_SCALE], dtype=np.float32),
        "powers": (FSQ_LEVELS ** np.arange(FSQ_DIMS)).astype(np.float32),
        "axis_t": np.array([2], dtype=np.int64),
        "zero_i": np.array([0], dtype=np.int64),
        "one_i": np.array([1], dtype=np.int64),
    }
    nodes = [
        # mask = arange(T) < feats_length[:, None], broadcast over the 128 mel bins
        helper.make_node("Shape", ["feats"], ["feats_shape"]),
        helper.make_node("Gather", ["feats_shape", "axis_t"], ["t_len_1"], axis=0),
        helper.make_node("Squeeze", ["t_len_1", "zero_i"], ["t_len"]),
        helper.make_node("Squeeze", ["frame_index", "zero_i"], ["frame_index_s"]),
        helper.make_node("Squeeze", ["one_i", "zero_i"], ["one_i_s"]),
        helper.make_node("Range", ["frame_index_s", "t_len", "one_i_s"], ["frames"]),
        helper.make_node("Cast", ["feats_length"], ["length64"], to=TensorProto.INT64),
        helper.make_node("Unsqueeze", ["length64", "one_i"], ["length_col"]),
        helper.make_node("Less", ["frames", "length_col"], ["valid"]),
        helper.make_node("Cast", ["valid"], ["valid_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["valid_f", "one_i"], ["valid_b"]),
        helper.make_node("Mul", ["feats", "valid_b"], ["masked"]),
        helper.make_node("Conv", ["masked", "c1_w", "c1_b"], ["c1"], pads=[1, 1], strides=[2]),
        helper.make_node("Tanh", ["c1"], ["t1"]),
        helper.make_node("Conv", ["t1", "c2_w", "c2_b"], ["c2"], pads=[1, 1], strides=[2]),
        helper.make_node("Tanh", ["c2"], ["t2"]),
        helper.make_node("Transpose", ["t2"], ["h"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["h", "proj_w"], ["proj"]),
        helper.make_node("Add", ["proj", "proj_b"], ["proj_b_out"]),
        helper.make_node("Tanh", ["proj_b_out"], ["proj_tanh"]),
        helper.make_node("Mul", ["proj_tanh", "fsq_scale"], [FSQ_PRE_ROUND]),
        helper.make_node("Round", [FSQ_PRE_ROUND], ["rounded"]),
        helper.make_node("Add", ["rounded", "one"], ["digits"]),
        helper.make_node("Mul", ["digits", "powers"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted", "axis_t"], ["code_f"], keepdims=0),
        helper.make_node("Cast", ["code_f"], ["indices"], to=TensorProto.INT64),
    ]
    inputs = [
        helper.make_tensor_value_info("feats", TensorProto.FLOAT, ["B", 128, "T"]),
        helper.make_tensor_value_info("feats_length", TensorProto.INT32, ["B"]),
    ]
    outputs = [helper.make_tensor_value_info("indices", TensorProto.INT64, ["B", "T2"])]
    return _model(nodes, inputs, outputs, w, "speech_tokenizer_v2_standin")


def write_standins(out_dir: Path, seed: int) -> None:
    """campplus.onnx and speech_tokenizer_v2.onnx into `out_dir`."""
    onnx.save(campplus(seed + 11), str(out_dir / "campplus.onnx"))
    onnx.save(speech_tokenizer_v2(seed + 22), str(out_dir / "speech_tokenizer_v2.onnx"))
