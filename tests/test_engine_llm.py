"""LLM runner: KV-cache layout and growth, position table, batched decode, teacher forcing parity with llm.npz."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from service.bundle import ModelBundle, ModelConstants
from service.engine.kvcache import KVCache
from service.engine.options import RuntimeOptions
from service.engine.sessions import make_session_options, open_sessions
from service.errors import BundleError, InvalidInputError
from service.families.cosyvoice1.contract import relative_pe as espnet_pe
from service.families.cosyvoice1.llm import LLM_GRAPHS, CosyVoice1LLM
from service.families.cosyvoice1.positions import GROWTH_ROWS, PositionTable

# ---------------------------------------------------------------------------------------------
# KV cache layout


def _kv(nl: int, h: int, length: int, dk: int, base: float) -> np.ndarray:
    return (base + np.arange(nl * h * length * dk, dtype=np.float32)).reshape(nl, h, length, dk)


def test_add_row_places_prefill_and_keeps_rest_zero() -> None:
    cache = KVCache(2, 3, 4, capacity=8)
    k, v = _kv(2, 3, 5, 4, 1.0), _kv(2, 3, 5, 4, 1000.0)
    assert cache.add_row(k, v) == 0
    assert cache.lengths[0] == 5 and cache.n_rows == 1
    got_k, got_v = cache.row_view(0)
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)
    assert not cache.k[1][0, :, 5:].any()  # unused columns are zeros, never garbage


def test_feeds_are_contiguous_views_of_the_buffers() -> None:
    cache = KVCache(2, 3, 4, rows=4, capacity=8)
    cache.add_row(_kv(2, 3, 5, 4, 0.0), _kv(2, 3, 5, 4, 0.0))
    cache.add_row(_kv(2, 3, 2, 4, 0.0), _kv(2, 3, 2, 4, 0.0))
    feeds = cache.feeds()
    assert feeds["past_len"].tolist() == [5, 2] and feeds["past_len"].dtype == np.int64
    for i in range(2):
        past = feeds[f"past_k_{i}"]
        assert past.shape == (2, 3, 8, 4) and past.flags.c_contiguous
        assert np.shares_memory(past, cache.k[i])


def test_append_writes_one_column_per_row_at_its_own_length() -> None:
    cache = KVCache(1, 2, 3, capacity=8)
    cache.add_row(np.zeros((1, 2, 4, 3), np.float32), np.zeros((1, 2, 4, 3), np.float32))
    cache.add_row(np.zeros((1, 2, 1, 3), np.float32), np.zeros((1, 2, 1, 3), np.float32))
    new_k = np.stack([np.full((2, 3), 7.0), np.full((2, 3), 9.0)])[None].astype(np.float32)
    cache.append(new_k, -new_k)
    assert cache.lengths[:2].tolist() == [5, 2]
    assert (cache.k[0][0, :, 4] == 7).all() and (cache.k[0][1, :, 1] == 9).all()
    assert (cache.v[0][1, :, 1] == -9).all()
    assert not cache.k[0][0, :, 5:].any() and not cache.k[0][1, :, 2:].any()


def test_capacity_doubles_and_preserves_contents() -> None:
    cache = KVCache(1, 1, 2, capacity=4)
    first = _kv(1, 1, 3, 2, 1.0)
    cache.add_row(first, first)
    assert cache.capacity == 4
    for step in range(6):  # lengths 3 -> 9: 4 -> 8 -> 16
        col = np.full((1, 1, 1, 2), 100.0 + step, np.float32)
        cache.append(col, col)
    assert cache.capacity == 16 and cache.lengths[0] == 9
    k, _ = cache.row_view(0)
    np.testing.assert_array_equal(k[0, 0, :3], first[0, 0])
    np.testing.assert_array_equal(k[0, 0, 3:, 0], 100.0 + np.arange(6))


def test_rows_grow_and_remove_moves_the_last_row_into_the_gap() -> None:
    cache = KVCache(1, 1, 1, rows=1, capacity=4)
    for length in (1, 2, 3):
        x = np.full((1, 1, length, 1), float(length), np.float32)
        cache.add_row(x, x)
    assert cache.row_capacity == 4 and cache.n_rows == 3
    assert cache.remove_row(0) == 2  # row 2 (length 3) moved into row 0
    assert cache.n_rows == 2 and cache.lengths[:2].tolist() == [3, 2]
    np.testing.assert_array_equal(cache.row_view(0)[0].ravel(), [3, 3, 3])
    assert cache.remove_row(1) is None  # removing the last row moves nothing
    with pytest.raises(IndexError):
        cache.remove_row(1)


def test_shape_mismatches_are_rejected() -> None:
    cache = KVCache(2, 2, 2)
    with pytest.raises(ValueError):
        cache.add_row(np.zeros((1, 2, 3, 2), np.float32), np.zeros((1, 2, 3, 2), np.float32))
    with pytest.raises(ValueError):
        cache.append(np.zeros((2, 1, 2, 2), np.float32), np.zeros((2, 1, 2, 2), np.float32))


# ---------------------------------------------------------------------------------------------
# Session options


def test_session_options_follow_runtime_options() -> None:
    import onnxruntime as ort

    opts = RuntimeOptions(
        intra_op_threads=3,
        inter_op_threads=2,
        execution_mode="parallel",
        graph_optimization="basic",
        enable_cpu_mem_arena=False,
        allow_spinning=False,
    )
    so = make_session_options(opts)
    assert (so.intra_op_num_threads, so.inter_op_num_threads) == (3, 2)
    assert so.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert so.enable_cpu_mem_arena is False
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    default = make_session_options(RuntimeOptions())
    assert default.intra_op_num_threads == 2 and default.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL


@pytest.mark.parametrize("bad", [{"intra_op_threads": 0}, {"execution_mode": "eager"}, {"graph_optimization": "max"}])
def test_runtime_options_reject_bad_values(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RuntimeOptions(**bad)  # type: ignore[arg-type]


def test_thread_budget_rule() -> None:
    assert RuntimeOptions(intra_op_threads=2).max_workers(8) == 4
    assert RuntimeOptions(intra_op_threads=4).max_workers(2) == 1


def test_open_sessions_reports_an_unreadable_graph(tiny_bundle: Path, tmp_path: Path) -> None:
    for f in tiny_bundle.iterdir():
        (tmp_path / f.name).symlink_to(f)
    bundle = ModelBundle.load(tmp_path)
    (tmp_path / "llm_pos.onnx").unlink()
    (tmp_path / "llm_pos.onnx").write_bytes(b"not an onnx graph")
    with pytest.raises(BundleError, match=r"llm_pos\.onnx"):
        open_sessions(bundle, names=["llm_pos"])
    with pytest.raises(BundleError, match="no graph"):
        open_sessions(bundle, names=["llm_prefill"])
    assert set(open_sessions(bundle, names=["llm_embed"])) == {"llm_embed"}


# ---------------------------------------------------------------------------------------------
# Positional table


def test_espnet_pe_hand_values() -> None:
    pe = espnet_pe(3, 4)
    assert pe.dtype == np.float32 and pe.shape == (3, 4)
    np.testing.assert_array_equal(pe[0], [0, 1, 0, 1])
    # w_0 = 1, w_1 = exp(-2 ln(1e4) / 4) = 0.01
    np.testing.assert_allclose(pe[1], [np.sin(1), np.cos(1), np.sin(0.01), np.cos(0.01)], atol=1e-7)
    np.testing.assert_allclose(pe[2], [np.sin(2), np.cos(2), np.sin(0.02), np.cos(0.02)], atol=1e-7)


def test_espnet_pe_matches_float32_angles_at_long_range() -> None:
    dim, rows = 128, 6000
    pe = espnet_pe(rows, dim)
    exponent = np.arange(0, dim, 2, dtype=np.float32) * np.float32(-np.log(10000.0) / dim)
    w = np.exp(exponent.astype(np.float64)).astype(np.float32)  # correctly rounded float32 frequencies
    angle = (np.arange(rows, dtype=np.float32)[:, None] * w[None]).astype(np.float64)  # float32-rounded
    np.testing.assert_allclose(pe[:, 0::2], np.sin(angle), atol=2e-6)
    np.testing.assert_allclose(pe[:, 1::2], np.cos(angle), atol=2e-6)


def test_position_table_projects_each_row_once_and_grows_in_steps() -> None:
    """Growth projects only the new distances, to the next multiple of GROWTH_ROWS, and keeps the old rows as they
    were: the grown table equals one projected whole."""
    calls: list[tuple[int, float]] = []

    def project(pe: np.ndarray) -> np.ndarray:
        calls.append((pe.shape[0], float(pe[0, 1])))  # rows, and cos of the first row's distance (1.0 at distance 0)
        return np.broadcast_to(pe[None, None, :, :2], (3, 2, pe.shape[0], 2)).copy()

    table = PositionTable(project, 8, rows=4)
    assert [n for n, _ in calls] == [4]
    assert table.table(4).shape == (3, 2, 4, 2) and len(calls) == 1
    feeds = table.feeds(9)
    assert table.rows == GROWTH_ROWS and [n for n, _ in calls] == [4, GROWTH_ROWS - 4]
    assert calls[1][1] == pytest.approx(float(np.cos(4.0)))  # the new rows start at distance 4
    assert set(feeds) == {"pos_0", "pos_1", "pos_2"} and feeds["pos_1"].shape == (2, 64, 2)
    np.testing.assert_array_equal(table.table(1)[2, 0], espnet_pe(GROWTH_ROWS, 8)[:, :2])
    table.table(GROWTH_ROWS + 1)
    assert table.rows == 2 * GROWTH_ROWS and [n for n, _ in calls][2:] == [GROWTH_ROWS]
    np.testing.assert_array_equal(table.table(1)[0, 1], espnet_pe(2 * GROWTH_ROWS, 8)[:, :2])


def test_whole_table_feeds_are_views_of_the_table() -> None:
    """A step twin that reads only the distances in use gets every layer's whole table, without copies."""

    def project(pe: np.ndarray) -> np.ndarray:
        return np.broadcast_to(pe[None, None, :, :2], (3, 2, pe.shape[0], 2)).copy()

    table = PositionTable(project, 8, rows=512, windowed=False)
    for needed in (1, 65, 512):
        feeds = table.feeds(needed)
        assert all(f.shape == (2, 512, 2) and f.flags.c_contiguous for f in feeds.values())
        assert all(np.shares_memory(f, table.table(needed)) for f in feeds.values())
    assert table.feeds(600)["pos_0"].shape == (2, 512 + GROWTH_ROWS, 2)


def test_a_table_held_in_float16_feeds_and_grows_in_float16() -> None:
    """A step twin whose position inputs are float16 (halve_positions): the table is kept in float16 (half its bytes),
    its feeds are float16 views, and rows it grows by are projected in float32 and stored in float16."""

    def project(pe: np.ndarray) -> np.ndarray:
        return np.broadcast_to(pe[None, None, :, :2], (3, 2, pe.shape[0], 2)).copy()

    table = PositionTable(project, 8, rows=512, windowed=False)
    wide = table.table(512).copy()
    table.hold_as(np.float16)
    assert table.dtype == np.float16 and table.table(1).dtype == np.float16
    np.testing.assert_array_equal(table.table(1), wide.astype(np.float16))
    feeds = table.feeds(600)
    assert all(f.dtype == np.float16 and f.shape == (2, 512 + GROWTH_ROWS, 2) for f in feeds.values())
    np.testing.assert_array_equal(feeds["pos_1"], espnet_pe(512 + GROWTH_ROWS, 8)[:, :2].astype(np.float16)[None].repeat(2, 0))


def test_position_feeds_are_the_first_rows_in_steps_of_64() -> None:
    """The graph gets contiguous copies of the rows in use (rounded up to 64), not the whole table."""
    calls: list[int] = []

    def project(pe: np.ndarray) -> np.ndarray:
        calls.append(pe.shape[0])
        return np.broadcast_to(pe[None, None, :, :2], (3, 2, pe.shape[0], 2)).copy()

    table = PositionTable(project, 8, rows=512)
    for needed, rows in ((1, 64), (64, 64), (65, 128), (300, 320), (512, 512)):
        feeds = table.feeds(needed)
        assert feeds["pos_0"].shape == (2, rows, 2) and all(f.flags.c_contiguous for f in feeds.values())
        np.testing.assert_array_equal(feeds["pos_2"], table.table(needed)[2, :, :rows])
    assert np.shares_memory(table.feeds(65)["pos_0"], table.feeds(70)["pos_0"])  # copied once, then reused
    assert table.feeds(700)["pos_1"].shape == (2, 704, 2) and table.rows == 768 and calls == [512, 256]


def test_position_table_growth_is_built_once_under_concurrency() -> None:
    calls: list[int] = []
    gate = threading.Barrier(4)

    def project(pe: np.ndarray) -> np.ndarray:
        calls.append(pe.shape[0])
        return np.zeros((1, 1, pe.shape[0], 1), np.float32)

    table = PositionTable(project, 4, rows=2)

    def grow() -> None:
        gate.wait()
        table.table(100)

    threads = [threading.Thread(target=grow) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [2, GROWTH_ROWS - 2]


# ---------------------------------------------------------------------------------------------
# A numpy stand-in for the four graphs: small, deterministic, and sensitive to every input the
# runner controls (row order, per-row past_len, cache contents up to past_len, pos rows).

FAKE = ModelConstants(
    spk_embed_dim=3, speech_token_size=6, eos_token=6, llm_num_layers=2, llm_num_heads=2, llm_head_dim=2, llm_model_dim=4
)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(axis=-1, keepdims=True))).astype(np.float32)


class _Fn:
    def __init__(self, fn) -> None:  # type: ignore[no-untyped-def]
        self.fn = fn

    def run(self, names: Sequence[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.fn(**feeds)


def _logits(ctx: np.ndarray) -> np.ndarray:
    v = FAKE.speech_token_size + 1
    z = 2.5 * np.sin(ctx[:, None] * (1.0 + np.arange(v))[None, :])
    z[:, -1] -= 1.0  # EOS slightly less likely
    return _log_softmax(z)


def _fake_encoder(text_ids: np.ndarray, embedding: np.ndarray) -> list[np.ndarray]:
    t = text_ids.shape[1]
    base = np.concatenate([[0.1], [embedding.sum() * 0.01], text_ids[0] * 0.001, [0.2]]).astype(np.float32)
    return [np.repeat(base[None, :, None], FAKE.llm_model_dim, axis=2).reshape(1, t + 3, -1)]


def _fake_embed(token: np.ndarray) -> list[np.ndarray]:
    return [np.repeat((0.05 * token)[..., None], FAKE.llm_model_dim, axis=-1).astype(np.float32)]


def _fake_pos(pe: np.ndarray) -> list[np.ndarray]:
    c = FAKE
    return [np.stack([pe.reshape(pe.shape[0], c.llm_num_heads, c.llm_head_dim).transpose(1, 0, 2) * (i + 1) for i in range(2)])]


def _fake_step(x: np.ndarray, past_len: np.ndarray, **kw: np.ndarray) -> list[np.ndarray]:
    """Reads exactly what a real step may read: past columns < past_len[b] and pos rows < past_len[b] + T."""
    c = FAKE
    b, t = x.shape[:2]
    ctx = x[:, :, 0].sum(axis=1).astype(np.float64)
    for r in range(b):
        n = int(past_len[r])
        for i in range(c.llm_num_layers):
            assert kw[f"past_k_{i}"].shape[2] >= n and kw[f"pos_{i}"].shape[1] >= n + t
            ctx[r] += kw[f"past_k_{i}"][r, :, :n].sum() * 0.01 + kw[f"past_v_{i}"][r, :, :n].sum() * 0.003
            ctx[r] += kw[f"pos_{i}"][:, n + t - 1].sum()
    new = np.broadcast_to(x[None, :, None, :, :1], (c.llm_num_layers, b, c.llm_num_heads, t, c.llm_head_dim))
    return [_logits(ctx), new.astype(np.float32).copy(), (new + 0.01).astype(np.float32).copy()]


def fake_sessions() -> dict[str, _Fn]:
    fns = {"llm_encoder": _fake_encoder, "llm_embed": _fake_embed, "llm_pos": _fake_pos, "llm_step": _fake_step}
    return {name: _Fn(fn) for name, fn in fns.items()}


@pytest.fixture(scope="module")
def tiny_runner(tiny_bundle: Path) -> CosyVoice1LLM:
    bundle = ModelBundle.load(tiny_bundle)
    sessions = open_sessions(bundle, RuntimeOptions(intra_op_threads=1), names=LLM_GRAPHS)
    return CosyVoice1LLM(sessions, bundle.constants)


@pytest.fixture(params=["fake", "tiny"])
def runner(request: pytest.FixtureRequest) -> CosyVoice1LLM:
    if request.param == "fake":
        return CosyVoice1LLM(fake_sessions(), FAKE, position_rows=4)
    return request.getfixturevalue("tiny_runner")


def _inputs(runner: CosyVoice1LLM, n_text: int, seed: int) -> tuple[list[int], np.ndarray]:
    g = np.random.default_rng(seed)
    ids = g.integers(0, 50000, size=n_text).tolist()
    emb = g.standard_normal(runner.constants.spk_embed_dim).astype(np.float32)
    return ids, emb


# ---------------------------------------------------------------------------------------------
# Runner behaviour (fake graphs and, when exported, the tiny bundle)


def test_same_seed_same_tokens(runner: CosyVoice1LLM) -> None:
    ids, emb = _inputs(runner, 6, 1)
    a = list(runner.generate(ids, emb, np.random.default_rng(5), max_tokens=40))
    b = list(runner.generate(ids, emb, np.random.default_rng(5), max_tokens=40))
    c = list(runner.generate(ids, emb, np.random.default_rng(6), max_tokens=40))
    assert a == b and a != c
    assert all(0 <= t < runner.constants.speech_token_size for t in a)


def test_min_and_max_tokens_bound_the_output(runner: CosyVoice1LLM) -> None:
    ids, emb = _inputs(runner, 3, 2)
    exact = list(runner.generate(ids, emb, np.random.default_rng(0), min_tokens=25, max_tokens=25))
    assert len(exact) == 25
    default = list(runner.generate(ids, emb, np.random.default_rng(0)))
    assert 2 * 3 <= len(default) <= 20 * 3
    assert list(runner.generate(ids, emb, np.random.default_rng(0), max_tokens=0)) == []


def test_cancel_stops_generation(runner: CosyVoice1LLM) -> None:
    ids, emb = _inputs(runner, 4, 3)
    cancel = threading.Event()
    got = []
    for tok in runner.generate(ids, emb, np.random.default_rng(0), min_tokens=60, max_tokens=60, cancel=cancel):
        got.append(tok)
        if len(got) == 5:
            cancel.set()
    assert len(got) == 5


def test_batched_steps_equal_single_rows(runner: CosyVoice1LLM) -> None:
    """Three rows of different lengths share decode calls, finish at different steps, and one joins late."""
    cases = [(_inputs(runner, n, 10 + n), n_speech) for n, n_speech in ((7, 12), (3, 5), (11, 9))]
    speech = [
        np.random.default_rng(i).integers(0, runner.constants.speech_token_size, n).tolist() for i, (_, n) in enumerate(cases)
    ]
    single = [runner.teacher_force(ids, emb, s) for ((ids, emb), _), s in zip(cases, speech, strict=True)]

    batch = runner.new_batch()
    reqs = [runner.start_forced(ids, emb, s) for ((ids, emb), _), s in zip(cases, speech, strict=True)]
    batch.add(reqs[0])
    batch.add(reqs[1])
    runner.step(batch)
    runner.step(batch)
    batch.add(reqs[2])  # joins with a different past_len
    finished_order = []
    while len(batch):
        finished_order += [reqs.index(r) for r in runner.step(batch)]
    assert finished_order == [1, 2, 0]
    for req, want in zip(reqs, single, strict=True):
        got = np.stack(req.record or [])
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_sampled_batch_equals_single_generation(runner: CosyVoice1LLM) -> None:
    inputs = [_inputs(runner, n, 20 + n) for n in (4, 9, 2)]
    single = [list(runner.generate(ids, emb, np.random.default_rng(k), max_tokens=30)) for k, (ids, emb) in enumerate(inputs)]
    batch = runner.new_batch()
    reqs = [runner.start(ids, emb, np.random.default_rng(k), max_tokens=30) for k, (ids, emb) in enumerate(inputs)]
    for r in reqs:
        batch.add(r)
    while len(batch):
        runner.step(batch)
    assert [r.tokens for r in reqs] == single


def test_abandoned_request_leaves_the_batch(runner: CosyVoice1LLM) -> None:
    ids, emb = _inputs(runner, 5, 4)
    batch = runner.new_batch()
    a = runner.start(ids, emb, np.random.default_rng(0), min_tokens=20, max_tokens=20)
    b = runner.start(ids, emb, np.random.default_rng(0), min_tokens=20, max_tokens=20)
    batch.add(a)
    batch.add(b)
    runner.step(batch)
    batch.remove(a)
    assert batch.requests == [b] and b.row == 0 and a.row == -1
    while len(batch):
        runner.step(batch)
    assert b.tokens == list(runner.generate(ids, emb, np.random.default_rng(0), min_tokens=20, max_tokens=20))


def test_invalid_inputs_raise_typed_errors(runner: CosyVoice1LLM) -> None:
    ids, emb = _inputs(runner, 3, 0)
    with pytest.raises(InvalidInputError):
        list(runner.generate([], emb, np.random.default_rng(0)))
    with pytest.raises(InvalidInputError):
        list(runner.generate(ids, emb[:-1], np.random.default_rng(0)))
    with pytest.raises(InvalidInputError):
        runner.teacher_force(ids, emb, [runner.constants.speech_token_size])


# ---------------------------------------------------------------------------------------------
# Parity with the official code (tiny bundle)


def _cases(npz: np.lib.npyio.NpzFile) -> list[int]:
    return sorted(int(k[4:].split("_")[0]) for k in npz.files if k.startswith("case") and k.endswith("_logp"))


def test_teacher_force_reproduces_official_log_probs(tiny_runner: CosyVoice1LLM, ref_dir: Path) -> None:
    ref = np.load(ref_dir / "llm.npz")
    cases = _cases(ref)
    assert cases == [0, 1, 2]
    for c in cases:
        got = tiny_runner.teacher_force(ref[f"case{c}_text_ids"], ref[f"case{c}_embedding"], ref[f"case{c}_speech_ids"])
        want = ref[f"case{c}_logp"]
        assert got.shape == want.shape
        err = float(np.abs(got - want).max())
        assert err < 1e-4, f"case {c}: max abs error {err:.3g}"


def test_encoder_reproduces_official_prefill_input(tiny_runner: CosyVoice1LLM, ref_dir: Path) -> None:
    ref = np.load(ref_dir / "llm.npz")
    for c in _cases(ref):
        got = tiny_runner.encode(ref[f"case{c}_text_ids"], ref[f"case{c}_embedding"])
        np.testing.assert_allclose(got, ref[f"case{c}_prefill_lm_input"], atol=1e-4, rtol=0)
