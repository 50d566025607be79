"""LLM export side: strict loading, torch parity with the official fixtures, ONNX graphs and their parity."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")

from export.config import LLMConfig, load_config  # noqa: E402
from export.cosyvoice1.graphs.llm import LLM_GRAPHS, export_llm, relative_pe, verify_llm  # noqa: E402
from export.cosyvoice1.modules.llm import TransformerLM  # noqa: E402
from export.modules.transformer import RelPosAttention, espnet_sinusoids, relative_table  # noqa: E402
from export.onnx_io import opset_of  # noqa: E402
from service.bundle import expand_io_names  # noqa: E402
from service.families.cosyvoice1.contract import GRAPH_IO  # noqa: E402

pytestmark = pytest.mark.export
CASES = (0, 1, 2)
LOGP_ATOL = 1e-4  # README: LLM log-probs


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_cfg(ref_dir: Path) -> LLMConfig:
    return load_config(ref_dir / "cosyvoice.yaml").llm


@pytest.fixture(scope="module")
def tiny_lm(ref_dir: Path, tiny_cfg: LLMConfig) -> TransformerLM:
    model = TransformerLM(tiny_cfg).eval()
    state = torch.load(ref_dir / "llm.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    return model


@pytest.fixture(scope="module")
def fixtures(ref_dir: Path) -> dict[str, np.ndarray]:
    with np.load(ref_dir / "llm.npz") as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def graph_dir(tiny_lm: TransformerLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llm_graphs")
    export_llm(tiny_lm, out)
    return out


def _case(fixtures: dict[str, np.ndarray], case: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        fixtures[f"case{case}_text_ids"].astype(np.int64),
        fixtures[f"case{case}_embedding"].astype(np.float32),
        fixtures[f"case{case}_speech_ids"].astype(np.int64),
    )


def _shapes(manifest: Path) -> dict[str, tuple[int, ...]]:
    entries = json.loads(manifest.read_text(encoding="utf-8"))["llm.pt"]
    return {key: tuple(shape) for key, (shape, _dtype) in entries.items()}


def test_strict_load_of_tiny_checkpoint_covers_every_key(ref_dir: Path, tiny_lm: TransformerLM) -> None:
    own = {k: tuple(v.shape) for k, v in tiny_lm.state_dict().items()}
    assert own == _shapes(ref_dir / "shapes.json")


def test_full_size_keys_and_shapes_match_the_released_manifest(full_size_shapes: Path, repo_root: Path) -> None:
    cfg = load_config(repo_root / "export" / "configs" / "cosyvoice-300m-sft.yaml").llm
    with torch.device("meta"):
        model = TransformerLM(cfg)
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    want = _shapes(full_size_shapes)
    assert own == want
    assert len(own) == 401
    assert sum(math.prod(s) for s in own.values()) == 310_718_465


@pytest.mark.parametrize("case", CASES)
def test_encode_matches_official_prefill_input(tiny_lm: TransformerLM, fixtures: dict[str, np.ndarray], case: int) -> None:
    ids, emb, _ = _case(fixtures, case)
    with torch.no_grad():
        ids_t = torch.from_numpy(ids)[None]
        text = tiny_lm.text_encoder_affine_layer(tiny_lm.text_encoder(tiny_lm.text_embedding(ids_t)))
        lm_input = tiny_lm.encode(ids_t, torch.from_numpy(emb)[None])
    np.testing.assert_allclose(text[0].numpy(), fixtures[f"case{case}_text_encoder_out"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(lm_input[0].numpy(), fixtures[f"case{case}_prefill_lm_input"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_cached_teacher_forcing_matches_official_logp(tiny_lm: TransformerLM, fixtures: dict[str, np.ndarray], case: int) -> None:
    ids, emb, speech = _case(fixtures, case)
    with torch.no_grad():
        logp = tiny_lm.teacher_force(torch.from_numpy(ids), torch.from_numpy(emb), torch.from_numpy(speech))
    np.testing.assert_allclose(logp.numpy(), fixtures[f"case{case}_logp"], rtol=0, atol=LOGP_ATOL)


@pytest.mark.parametrize("case", CASES)
def test_benchmark_baseline_decode_matches_official_logp(
    tiny_lm: TransformerLM, fixtures: dict[str, np.ndarray], case: int
) -> None:
    """The PyTorch baseline of `make bench` (bench_reference.official_step: positions re-projected and the cache
    concatenated at every step, as the official forward_chunk) computes the official log-probs."""
    from loadtest.bench_reference import official_step

    ids, emb, speech = _case(fixtures, case)
    layer = tiny_lm.llm.layers()[0].self_attn
    empty = [torch.zeros(1, layer.heads, 0, layer.d_k) for _ in tiny_lm.llm.layers()]
    with torch.no_grad():
        prefill = tiny_lm.encode(torch.from_numpy(ids)[None], torch.from_numpy(emb)[None])
        logp, cache_k, cache_v = official_step(tiny_lm, prefill, empty, list(empty))
        rows = [logp]
        for token in speech.tolist():
            logp, cache_k, cache_v = official_step(tiny_lm, tiny_lm.embed_tokens(torch.tensor([[token]])), cache_k, cache_v)
            rows.append(logp)
    np.testing.assert_allclose(torch.stack(rows).numpy(), fixtures[f"case{case}_logp"], rtol=0, atol=LOGP_ATOL)


@pytest.mark.parametrize("case", CASES)
def test_no_cache_pass_matches_official_logp_nocache(tiny_lm: TransformerLM, fixtures: dict[str, np.ndarray], case: int) -> None:
    ids, emb, speech = _case(fixtures, case)
    with torch.no_grad():
        lm_input = tiny_lm.encode(torch.from_numpy(ids)[None], torch.from_numpy(emb)[None])
        seq = torch.cat((lm_input, tiny_lm.embed_tokens(torch.from_numpy(speech)[None])), dim=1)
        logp = tiny_lm.score_all(seq)[0, lm_input.shape[1] - 1 :]
    np.testing.assert_allclose(logp.numpy(), fixtures[f"case{case}_logp_nocache"], rtol=0, atol=LOGP_ATOL)


def test_gather_rel_shift_equals_espnet_pad_and_view_shift() -> None:
    """Non-causal attention (flow encoder path) against the official pad/view rel_shift on a 2T-1 table."""
    gen = torch.Generator().manual_seed(3)
    attn = RelPosAttention(16, 2).eval()
    for p in attn.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.5
    length = 7
    x = torch.randn(2, length, 16, generator=gen)
    pe = relative_table(length, 16, causal=False)
    i = torch.arange(length).unsqueeze(1)
    index = (length - 1) - i + torch.arange(length).unsqueeze(0)
    with torch.no_grad():
        got = attn(x, pe, index, None)[0]
        q = attn.linear_q(x).view(2, length, 2, 8)
        k = attn.linear_k(x).view(2, length, 2, 8).transpose(1, 2)
        v = attn.linear_v(x).view(2, length, 2, 8).transpose(1, 2)
        p = attn.linear_pos(pe).view(1, -1, 2, 8).transpose(1, 2)
        ac = (q + attn.pos_bias_u).transpose(1, 2) @ k.transpose(-2, -1)
        bd = (q + attn.pos_bias_v).transpose(1, 2) @ p.transpose(-2, -1)
        padded = torch.cat((bd.new_zeros(2, 2, length, 1), bd), dim=-1).view(2, 2, 2 * length, length)
        bd = padded[:, :, 1:].reshape(bd.shape)[:, :, :, :length]
        ctx = torch.softmax((ac + bd) / math.sqrt(8), dim=-1) @ v
        want = attn.linear_out(ctx.transpose(1, 2).reshape(2, length, 16))
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-6)


def test_numpy_pe_rows_match_torch_sinusoids() -> None:
    for dim in (128, 1024):
        want = espnet_sinusoids(torch.arange(200), dim).numpy()
        got = relative_pe(200, dim)
        assert got.dtype == np.float32 and got.shape == (200, dim)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    exact = np.sin(np.float64(150) * np.exp(-2 * 3 * math.log(10000.0) / 128))
    assert abs(relative_pe(151, 128)[150, 6] - exact) < 1e-4


def test_onnx_graphs_match_torch(tiny_lm: TransformerLM, graph_dir: Path) -> None:
    errors = verify_llm(tiny_lm, graph_dir)
    assert set(errors) == set(LLM_GRAPHS)
    for name, err in errors.items():
        assert err <= 1e-4, f"{name}: max abs error {err}"


def test_graphs_are_opset13_with_contract_names_and_dynamic_axes(graph_dir: Path, tiny_cfg: LLMConfig) -> None:
    nl = tiny_cfg.llm.num_blocks
    dynamic = {"llm_encoder": {"text_ids": 2, "lm_input": 2}, "llm_pos": {"pe": 1, "pos": 1}, "llm_step": {"past_k_0": 2}}
    for name in LLM_GRAPHS:
        path = graph_dir / f"{name}.onnx"
        assert opset_of(path) == 13
        model = onnx.load(str(path))
        inputs, outputs = GRAPH_IO[name]
        assert [v.name for v in model.graph.input] == expand_io_names(inputs, nl)
        assert [v.name for v in model.graph.output] == expand_io_names(outputs, nl)
        values = {v.name: v for v in list(model.graph.input) + list(model.graph.output)}
        for tensor, count in dynamic.get(name, {}).items():
            dims = values[tensor].type.tensor_type.shape.dim
            assert sum(bool(d.dim_param) for d in dims) == count, tensor
        assert "Trilu" not in {n.op_type for n in model.graph.node}


def test_export_twice_gives_identical_bytes(tiny_lm: TransformerLM, graph_dir: Path, tmp_path: Path) -> None:
    export_llm(tiny_lm, tmp_path)
    for name in LLM_GRAPHS:
        assert (tmp_path / f"{name}.onnx").read_bytes() == (graph_dir / f"{name}.onnx").read_bytes(), name


def _sessions(graph_dir: Path) -> dict[str, ort.InferenceSession]:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return {n: ort.InferenceSession(str(graph_dir / f"{n}.onnx"), opts, providers=["CPUExecutionProvider"]) for n in LLM_GRAPHS}


def test_onnx_pipeline_with_batched_per_row_cache_reproduces_official_logp(
    graph_dir: Path, tiny_cfg: LLMConfig, fixtures: dict[str, np.ndarray]
) -> None:
    """Engine-style loop: prefill each case alone, then decode all three as one batch with different past_len."""
    s = _sessions(graph_dir)
    nl, heads = tiny_cfg.llm.num_blocks, tiny_cfg.llm.attention_heads
    d_k = tiny_cfg.llm.output_size // heads
    cases = [_case(fixtures, c) for c in CASES]
    steps = max(len(speech) for _, _, speech in cases)
    cols = max(len(ids) + 3 for ids, _, _ in cases) + steps
    pos = s["llm_pos"].run(None, {"pe": relative_pe(cols + 1, tiny_cfg.llm_output_size)})[0]
    feeds: dict[str, np.ndarray] = {f"pos_{i}": pos[i] for i in range(nl)}
    cache = {f"past_{kv}_{i}": np.zeros((len(cases), heads, cols, d_k), np.float32) for kv in "kv" for i in range(nl)}
    past_len = np.zeros(len(cases), np.int64)
    rows: list[list[np.ndarray]] = [[] for _ in cases]
    empty = np.zeros((1, heads, 0, d_k), np.float32)
    for b, (ids, emb, _) in enumerate(cases):
        lm_input = s["llm_encoder"].run(None, {"text_ids": ids[None], "embedding": emb[None]})[0]
        prefill = {"x": lm_input, "past_len": np.zeros(1, np.int64), **{n: empty for n in cache}}
        logp, new_k, new_v = s["llm_step"].run(None, {**feeds, **prefill})
        _write(cache, new_k, new_v, b, 0, 0)
        past_len[b] = lm_input.shape[1]
        rows[b].append(logp[0])
    for t in range(steps):
        tokens = np.array([[speech[t] if t < len(speech) else 0] for _, _, speech in cases], np.int64)
        x = s["llm_embed"].run(None, {"token": tokens})[0]
        logp, new_k, new_v = s["llm_step"].run(None, {**feeds, **cache, "x": x, "past_len": past_len})
        for b in range(len(cases)):
            _write(cache, new_k, new_v, b, b, int(past_len[b]))
            rows[b].append(logp[b])
        past_len += 1
    for b, (_, _, speech) in enumerate(cases):
        got = np.stack(rows[b][: len(speech) + 1])
        np.testing.assert_allclose(got, fixtures[f"case{b}_logp"], rtol=0, atol=LOGP_ATOL)


def _write(cache: dict[str, np.ndarray], new_k: np.ndarray, new_v: np.ndarray, row: int, src: int, start: int) -> None:
    """Write new_k/new_v (NL,B,H,T,DK) row `src` into columns start..start+T-1 of cache row `row`."""
    length = new_k.shape[3]
    for i in range(new_k.shape[0]):
        cache[f"past_k_{i}"][row, :, start : start + length] = new_k[i, src]
        cache[f"past_v_{i}"][row, :, start : start + length] = new_v[i, src]
