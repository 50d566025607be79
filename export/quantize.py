"""Weight quantization of a finished fp32 bundle: dynamic INT8 MatMuls, int8 lookup tables, 4-bit decode-step MatMuls."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from export.external_data import load_inline, weights_name
from service.bundle import FLOAT_SUFFIX, GROUP_CORE, GROUP_FLOAT, MANIFEST_NAME, Manifest, ModelConstants, sha256_file
from service.families.cosyvoice1.contract import relative_pe

Scheme = Literal["int8", "int4"]

# Graphs whose weight MatMuls are quantized. HiFT and the length regulator stay fp32: they are small or
# convolution-bound, and the vocoder is the most precision-sensitive stage. The flow encoder (6 conformer
# blocks, 87 MB fp32) runs once per chunk; INT8 takes 100 MB off the resident set and halves its time.
INT8_GRAPHS = ("llm_encoder", "llm_step", "flow_encoder", "flow_estimator")
# The 4-bit scheme only changes the decode step: it is read once per token, so its weight bytes set the
# batch-1 speed. The encoder and the estimator run GEMM-shaped (many rows), where MatMulNBits does not
# beat dynamic INT8 on this CPU, so they keep INT8.
INT4_GRAPHS = ("llm_step",)
# Quantized graphs that also get a float twin (float_twin): OpenVINO runs the estimator in bf16 1.5x faster than ORT
# runs the int8 graph, but only on a graph that computes in floating point (on the int8 graph it is slower than ORT).
FLOAT_TWIN_GRAPHS = ("flow_estimator",)
FLOAT_TWIN_PRECISION = "int8-weights"  # int8 weights widened at run time, float compute
INT4_BLOCK_SIZE = 128  # fewer scales than 32 and faster here (docs/benchmarks.md)
INT4_ACCURACY_LEVEL = 4  # int8 activations x int4 weights on VNNI; levels 0/1 compute in fp32 (2x slower)
# Graphs whose lookup tables (text 51866 x 512, speech 4096 x 1024 and 4096 x 512: 130 MB fp32) are kept as
# int8 rows with one scale per row: a lookup reads a few rows, so this costs no time and saves ~100 MB.
EMBEDDING_GRAPHS = ("llm_encoder", "llm_embed", "flow_encoder")
# Smaller Gather tables stay fp32. Low enough that the tiny test bundles take the int8-rows path for every table the
# full-size export converts (a tiny CosyVoice2 speech embedding is 6564 x 32 = 210k values).
MIN_TABLE_VALUES = 1 << 16


def quantize_graph(src: Path, dst: Path) -> None:
    """Per-tensor dynamic INT8 (u8 activations x s8 weights) for MatMuls with constant weights.

    Weights use 7 bits (`reduce_range`): on CPUs without VNNI (AVX2 only) ONNX Runtime's u8 x s8 kernel adds
    pairs of products in saturating 16-bit lanes, and full-range weights overflow them; measured on an
    AVX2-only host, the tiny bundle's decode-step log-probs moved by 0.74 with 8-bit weights against 0.25
    for 4-bit ones. VNNI hosts lose half a bit of weight precision and no speed.
    """
    with _root_level(logging.ERROR):  # the quantizer logs a harmless pre-processing hint on the root logger
        quantize_dynamic(
            str(src),
            str(dst),
            op_types_to_quantize=["MatMul"],
            weight_type=QuantType.QInt8,
            per_channel=False,
            reduce_range=True,
            extra_options={"MatMulConstBOnly": True},
        )


@contextmanager
def _root_level(level: int) -> Iterator[None]:
    """The root logger at `level` for the block, then as it was (the caller's logging is not ours to change)."""
    root = logging.getLogger()
    before = root.level
    root.setLevel(level)
    try:
        yield
    finally:
        root.setLevel(before)


def quantize_graph_4bit(src: Path, dst: Path, block_size: int = INT4_BLOCK_SIZE) -> None:
    """Symmetric blockwise 4-bit weights (MatMulNBits, round-to-nearest) for MatMuls with constant weights.

    Needs the `onnx-ir` package (ORT's quantizer imports it). Attention MatMuls (two activations) stay fp32.
    """
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    quantizer = MatMulNBitsQuantizer(
        load_inline(src),
        bits=4,
        block_size=block_size,
        is_symmetric=True,
        accuracy_level=INT4_ACCURACY_LEVEL,
        op_types_to_quantize=("MatMul",),
    )
    quantizer.process()
    quantizer.model.save_model_to_file(str(dst), False)


def _int8_table(model: onnx.ModelProto, node: onnx.NodeProto, table: np.ndarray) -> list[onnx.NodeProto]:
    """Replace Gather(table, ids) by Gather(int8 rows) * Gather(row scales); returns the nodes to insert."""
    name, ids, out = node.input[0], node.input[1], node.output[0]
    peak = np.abs(table).max(axis=1, keepdims=True)
    scale = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
    rows = np.clip(np.rint(table / scale), -127, 127).astype(np.int8)
    q, s = f"{name}.rows_int8", f"{name}.row_scale"  # names no quantizer or exporter produces
    model.graph.initializer.extend([numpy_helper.from_array(rows, q), numpy_helper.from_array(scale, s)])
    return [
        helper.make_node("Gather", [q, ids], [f"{out}.rows_int8"], axis=0),
        helper.make_node("Cast", [f"{out}.rows_int8"], [f"{out}.rows"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Gather", [s, ids], [f"{out}.row_scale"], axis=0),
        helper.make_node("Mul", [f"{out}.rows", f"{out}.row_scale"], [out]),
    ]


def quantize_embeddings(path: Path, min_values: int = MIN_TABLE_VALUES) -> list[str]:
    """Rewrite `path` so its large fp32 lookup tables (2-D initializers read only by Gather on axis 0) are int8 rows.

    Symmetric per row: row = int8 * (max|row| / 127). Returns the names of the tables it converted.
    """
    model = load_inline(path)
    graph = model.graph
    tables = {i.name: i for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 2}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    nodes, done = [], []
    for node in graph.node:
        name = node.input[0] if node.op_type == "Gather" and node.input else ""
        axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
        if name in tables and axis == 0 and len(readers[name]) == 1 and np.prod(tables[name].dims) >= min_values:
            nodes.extend(_int8_table(model, node, numpy_helper.to_array(tables[name])))
            graph.initializer.remove(tables[name])
            done.append(name)
        else:
            nodes.append(node)
    if done:
        del graph.node[:]
        graph.node.extend(nodes)
        onnx.checker.check_model(model)
        onnx.save(model, str(path))
    return done


# The decode step of a quantized bundle takes its K/V cache in float16: the engine keeps half the bytes per
# position (8 streams of 220 positions: 117 MB instead of 235 MB) and the graph widens each layer's cache to
# float32 as it reads it. Measured full-size int8: +1 ms per step at batch 1 (9.2 -> 10.1 ms), none at batch 8
# (27.4 -> 26.1 ms at 250 positions), log-prob deviation 2-6e-3 (the int8 weights' own is about 3e-2).
HALF_KV_GRAPH = "llm_step"
KV_INPUT_PREFIXES = ("past_k_", "past_v_")


def half_kv_cache(path: Path) -> int:
    """Rewrite the decode graph at `path` to take its past_k_i/past_v_i inputs in float16 (a Cast to float32 right
    after each input; nothing else changes). Returns the number of inputs rewritten."""
    return _half_edges(path, "input", lambda name: name.startswith(KV_INPUT_PREFIXES))


# A graph whose new keys/values the engine appends to a float16 cache gets them in float16 from the graph: ONNX
# Runtime's Cast narrows 2.9 M values (the full-size estimator, 2 rows x 50 frames) in 0.34 ms, numpy's astype in
# 7.3 ms, and that conversion ran on the request's thread after every estimator call (measured on this host).
HALF_KV_OUTPUTS = ("new_k", "new_v")


def half_kv_outputs(path: Path, names: tuple[str, ...] = HALF_KV_OUTPUTS) -> int:
    """Rewrite the graph at `path` so that its float32 outputs `names` come out as float16 (a Cast before each; the
    values are those the engine would store after narrowing them itself). Returns the number of outputs rewritten."""
    return _half_edges(path, "output", lambda name: name in names)


def _half_edges(path: Path, edge: Literal["input", "output"], chosen: Callable[[str], bool]) -> int:
    """Make the graph's float32 inputs (or outputs) that `chosen` names float16 at the edge: the graph's nodes go on
    reading (writing) `<name>_fp32`, a Cast between it and the edge. Returns the number of edges rewritten."""
    model = load_inline(path)
    graph = model.graph
    casts: list[onnx.NodeProto] = []
    for value in graph.input if edge == "input" else graph.output:
        if not chosen(value.name):
            continue
        if value.type.tensor_type.elem_type != onnx.TensorProto.FLOAT:
            raise ValueError(f"{path.name}: {value.name} is not a float32 {edge}")
        wide = f"{value.name}_fp32"
        for node in graph.node:
            node.input[:] = [wide if name == value.name else name for name in node.input]
            node.output[:] = [wide if name == value.name else name for name in node.output]
        value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
        if edge == "input":
            casts.append(helper.make_node("Cast", [value.name], [wide], name=f"widen_{value.name}", to=onnx.TensorProto.FLOAT))
        else:
            casts.append(helper.make_node("Cast", [wide], [value.name], name=f"narrow_{value.name}", to=onnx.TensorProto.FLOAT16))
    nodes = casts + list(graph.node) if edge == "input" else list(graph.node) + casts
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return len(casts)


def kv_cache_dtype(path: Path) -> str:
    """ "float16" or "float32": the element type of a decode graph's K/V cache inputs."""
    model = onnx.load(str(path), load_external_data=False)
    kinds = {v.type.tensor_type.elem_type for v in model.graph.input if v.name.startswith(KV_INPUT_PREFIXES)}
    return "float16" if kinds == {onnx.TensorProto.FLOAT16} else "float32"


def precision_plan(scheme: Scheme) -> dict[str, str]:
    """Graph name -> precision it gets under `scheme` (graphs not listed are copied as fp32)."""
    plan = dict.fromkeys((*INT8_GRAPHS, *EMBEDDING_GRAPHS), "int8")
    if scheme == "int4":
        plan.update(dict.fromkeys(INT4_GRAPHS, "int4"))
    return plan


def write_quantized_bundle(
    src_dir: Path,
    dst_dir: Path,
    manifest: Manifest,
    scheme: Scheme,
    *,
    plan: dict[str, str] | None = None,
    matmul_graphs: tuple[str, ...] = INT8_GRAPHS,
    table_graphs: tuple[str, ...] = EMBEDDING_GRAPHS,
    half_kv_graphs: tuple[str, ...] = (HALF_KV_GRAPH,),
    half_output_graphs: tuple[str, ...] = (),
    float_twin_graphs: tuple[str, ...] = FLOAT_TWIN_GRAPHS,
) -> Manifest:
    """Copy the fp32 bundle in `src_dir` to `dst_dir` with its weights quantized by `scheme`; returns the new manifest.

    Only core graphs are quantized (and the decode step takes a float16 K/V cache, `half_kv_cache`); the prompt
    group, capabilities and other files are carried over unchanged. The keyword arguments name another family's
    graphs (defaults: the v1 bundle's): graph -> precision, graphs with INT8 MatMuls, with int8 lookup tables, with
    float16 K/V cache inputs, with float16 new K/V outputs (`half_kv_outputs`), and with a float twin.
    """
    dst_dir.mkdir(parents=True, exist_ok=False)
    plan = precision_plan(scheme) if plan is None else plan
    graphs = {name: replace(entry, weights="", weights_sha256="") for name, entry in manifest.graphs.items()}
    for name, entry in manifest.graphs.items():
        src, dst = src_dir / entry.file, dst_dir / entry.file
        precision = plan.get(name) if entry.group == GROUP_CORE else None  # the prompt models are copied as they are
        if precision == "int4":
            quantize_graph_4bit(src, dst)
        elif precision is not None and name in matmul_graphs:
            quantize_graph(src, dst)
        elif (src_dir / weights_name(entry.file)).exists():  # one file again (publishing moves large weights out)
            onnx.save(load_inline(src), str(dst))
            graphs[name] = replace(graphs[name], sha256=sha256_file(dst))
        else:
            shutil.copy2(src, dst)
        if precision is not None and name in table_graphs:
            quantize_embeddings(dst)
        if precision is not None and name in half_kv_graphs:
            half_kv_cache(dst)
        if precision is not None and name in half_output_graphs:
            half_kv_outputs(dst)
        if precision is not None:
            graphs[name] = replace(graphs[name], sha256=sha256_file(dst), precision=precision)
        if precision is not None and name in float_twin_graphs:
            twin = dst_dir / f"{name}{FLOAT_SUFFIX}.onnx"
            float_twin(src, twin)
            graphs[name + FLOAT_SUFFIX] = replace(
                graphs[name], file=twin.name, sha256=sha256_file(twin), precision=FLOAT_TWIN_PRECISION, group=GROUP_FLOAT
            )
    for name in manifest.files:
        shutil.copy2(src_dir / name, dst_dir / name)
    new = replace(manifest, graphs=graphs, precision=scheme, model=f"{manifest.model}-{scheme}")
    (dst_dir / MANIFEST_NAME).write_text(new.to_json(), encoding="utf-8")
    return new


def float_twin(src: Path, dst: Path, min_values: int = 1024) -> int:
    """Write the float twin of a graph (service.bundle GROUP_FLOAT) from its fp32 form: it computes in floating point,
    but stores each MatMul weight (2-D, used only as a MatMul's right operand) as int8 with one float32 scale per
    output column, read through DequantizeLinear (symmetric, zero point 0), and every other float32 initializer of
    `min_values` or more values as float16 behind a Cast. OpenVINO keeps such weights compressed and widens them in
    its matmul kernels: the full-size estimator's twin is 99 MB (fp32: 329 MB), compiles to 0.35 GB resident instead
    of 0.79 GB for fp16-stored weights, runs 5-8 % faster than them in bf16, and deviates from fp32 by 3.6-3.9 %
    relative RMS (fp16-stored: 3.3-3.7 %). Returns how many initializers were compressed."""
    model = load_inline(src)
    graph = model.graph
    uses: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for k, name in enumerate(node.input):
            uses.setdefault(name, []).append((node, k))
    added, nodes, compressed = [], [], set()
    for init in graph.initializer:
        if init.data_type != onnx.TensorProto.FLOAT or int(np.prod(init.dims)) < min_values:
            continue
        w = numpy_helper.to_array(init)
        used = uses.get(init.name, [])
        if w.ndim == 2 and used and all(n.op_type == "MatMul" and k == 1 for n, k in used):
            scale = np.abs(w).max(axis=0) / np.float32(127.0)
            scale[scale == 0] = 1.0
            q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
            added += [
                numpy_helper.from_array(q, init.name + "_int8"),
                numpy_helper.from_array(scale.astype(np.float32), init.name + "_scale"),
            ]
            nodes.append(helper.make_node("DequantizeLinear", [init.name + "_int8", init.name + "_scale"], [init.name], axis=1))
        else:
            added.append(numpy_helper.from_array(w.astype(np.float16), init.name + "_fp16"))
            nodes.append(helper.make_node("Cast", [init.name + "_fp16"], [init.name], to=onnx.TensorProto.FLOAT))
        compressed.add(init.name)
    kept = [i for i in graph.initializer if i.name not in compressed]
    del graph.initializer[:]
    graph.initializer.extend([*kept, *added])
    original = list(graph.node)
    del graph.node[:]
    graph.node.extend([*nodes, *original])
    onnx.checker.check_model(model)
    onnx.save(model, str(dst))
    return len(compressed)


def write_int8_bundle(src_dir: Path, dst_dir: Path, manifest: Manifest) -> Manifest:
    """Copy the fp32 bundle in `src_dir` to `dst_dir`, quantizing INT8_GRAPHS; returns the new manifest."""
    return write_quantized_bundle(src_dir, dst_dir, manifest, "int8")


def _step_session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def _decode_logp(step: ort.InferenceSession, x: np.ndarray, pos: np.ndarray, c: ModelConstants) -> np.ndarray:
    """Prefill x[:, :prefill] then one decode step per remaining row of x; log-prob rows (steps + 1, V)."""
    nl = c.llm_num_layers
    empty = np.zeros((1, c.llm_num_heads, 0, c.llm_head_dim), dtype=np.float32)
    k_cache, v_cache = [empty] * nl, [empty] * nl
    pos_feeds = {f"pos_{i}": pos[i] for i in range(nl)}
    rows = []
    prefill = x.shape[1] // 2
    chunks = [x[:, :prefill]] + [x[:, t : t + 1] for t in range(prefill, x.shape[1])]
    kv = np.float16 if any(i.type == "tensor(float16)" for i in step.get_inputs()) else np.float32
    for chunk in chunks:
        feeds = {"x": chunk, "past_len": np.array([k_cache[0].shape[2]], dtype=np.int64)} | pos_feeds
        feeds |= {f"past_k_{i}": k_cache[i].astype(kv) for i in range(nl)}
        feeds |= {f"past_v_{i}": v_cache[i].astype(kv) for i in range(nl)}
        logp, new_k, new_v = step.run(["logp", "new_k", "new_v"], feeds)
        k_cache = [np.concatenate([k_cache[i], new_k[i]], axis=2) for i in range(nl)]
        v_cache = [np.concatenate([v_cache[i], new_v[i]], axis=2) for i in range(nl)]
        rows.append(logp[0])
    return np.stack(rows)


def step_deviation(
    fp32_dir: Path, quant_dir: Path, constants: ModelConstants, *, tokens: int = 24, seed: int = 0
) -> dict[str, float]:
    """How far a quantized `llm_step` is from the fp32 one on the same inputs (a prefill, then `tokens` decode steps).

    Inputs are the fp32 bundle's embeddings of random speech tokens. Returns the max and mean absolute
    log-prob error and the share of steps whose most likely token is unchanged.
    """
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, constants.speech_token_size, (1, 2 * tokens))
    (x,) = _step_session(fp32_dir / "llm_embed.onnx").run(["x"], {"token": ids})
    pe = relative_pe(2 * tokens + 1, constants.llm_model_dim)
    (pos,) = _step_session(fp32_dir / "llm_pos.onnx").run(["pos"], {"pe": pe})
    want = _decode_logp(_step_session(fp32_dir / "llm_step.onnx"), x, pos, constants)
    got = _decode_logp(_step_session(quant_dir / "llm_step.onnx"), x, pos, constants)
    err = np.abs(got - want)
    return {
        "logp_max_abs": float(err.max()),
        "logp_mean_abs": float(err.mean()),
        "top1_agreement": float(np.mean(got.argmax(-1) == want.argmax(-1))),
    }
