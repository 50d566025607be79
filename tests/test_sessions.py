"""Per-stage ONNX Runtime configuration: threads, memory patterns, pre-packing, transient graphs, and the settings wiring."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from service.bundle import ModelBundle
from service.engine.host import lower_thread_priority
from service.engine.options import PREPACKED_GRAPHS, RuntimeOptions, graph_stage
from service.engine.sessions import ShrinkingSession, TransientSession, make_session_options, open_sessions, prefill
from service.errors import BundleError
from service.families.cosyvoice1.contract import GRAPH_NAMES, PROMPT_GRAPH_NAMES
from service.families.cosyvoice1.engine import Synthesizer
from service.families.cosyvoice1.llm import TRANSIENT_GRAPHS, CosyVoice1LLM
from service.runtime import runtime_options
from service.settings import Settings

REPO = Path(__file__).resolve().parents[1]


def test_stages_get_their_own_thread_counts() -> None:
    opts = RuntimeOptions(intra_op_threads=2, llm_threads=1, acoustic_threads=3)
    assert make_session_options(opts, "llm_step").intra_op_num_threads == 1
    assert make_session_options(opts, "flow_estimator").intra_op_num_threads == 3
    assert make_session_options(opts, "hift_decode").intra_op_num_threads == 3
    assert make_session_options(RuntimeOptions(intra_op_threads=2), "llm_step").intra_op_num_threads == 2
    assert [graph_stage(g) for g in ("llm_encoder", "flow_lr", "hift_f0")] == ["llm", "acoustic", "acoustic"]


def test_memory_patterns_and_prepacking_follow_the_graph() -> None:
    opts = RuntimeOptions()
    assert make_session_options(opts, "llm_step").enable_mem_pattern
    assert not make_session_options(opts, "flow_estimator").enable_mem_pattern  # a new length every chunk
    for graph in ("llm_step", "flow_estimator", "llm_encoder", "flow_encoder"):
        disabled = make_session_options(opts, graph).get_session_config_entry("session.disable_prepacking") == "1"
        assert disabled == (graph not in PREPACKED_GRAPHS)
    assert make_session_options(opts).get_session_config_entry("session.intra_op.allow_spinning") == "0"


@pytest.mark.parametrize(
    "bad", [{"llm_threads": 0}, {"acoustic_threads": 0}, {"max_batch": -1}, {"acoustic_slots": -1}, {"acoustic_nice": 20}]
)
def test_runtime_options_reject_bad_stage_values(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        RuntimeOptions(**bad)  # type: ignore[arg-type]


def test_position_graph_is_transient_and_builds_the_same_table(tiny_bundle: Path) -> None:
    bundle = ModelBundle.load(tiny_bundle)
    opts = RuntimeOptions(intra_op_threads=1)
    names = ("llm_encoder", "llm_embed", "llm_pos", "llm_step")
    resident = CosyVoice1LLM(open_sessions(bundle, opts, names), bundle.constants, position_rows=32)
    transient_sessions = open_sessions(bundle, opts, names, transient=TRANSIENT_GRAPHS)
    assert isinstance(transient_sessions["llm_pos"], TransientSession)
    lazy = CosyVoice1LLM(transient_sessions, bundle.constants, position_rows=32)
    np.testing.assert_array_equal(lazy.positions.table(32), resident.positions.table(32))
    np.testing.assert_array_equal(lazy.positions.table(100), resident.positions.table(100))  # regrown on demand


def test_acoustic_sessions_give_back_their_arena_and_compute_the_same(tiny_bundle: Path) -> None:
    bundle = ModelBundle.load(tiny_bundle)
    names = ["flow_lr", "llm_embed"]
    shrinking = open_sessions(bundle, RuntimeOptions(intra_op_threads=1), names)
    plain = open_sessions(bundle, RuntimeOptions(intra_op_threads=1, shrink_acoustic_arenas=False), names)
    assert isinstance(shrinking["flow_lr"], ShrinkingSession) and not isinstance(shrinking["llm_embed"], ShrinkingSession)
    assert not isinstance(plain["flow_lr"], ShrinkingSession)
    x = np.random.default_rng(0).standard_normal((1, bundle.constants.n_mels, 40)).astype(np.float32)
    for _ in range(2):  # the second call runs on a shrunk arena
        np.testing.assert_array_equal(shrinking["flow_lr"].run(["mu"], {"x": x})[0], plain["flow_lr"].run(["mu"], {"x": x})[0])


def test_settings_reach_the_runtime_options() -> None:
    s = Settings(  # type: ignore[call-arg]
        _env_file=None,
        intra_op_threads=2,
        llm_threads=1,
        acoustic_threads=2,
        max_batch=3,
        acoustic_slots=2,
        acoustic_nice=5,
        ort_spinning=True,
    )
    opts = runtime_options(s)
    assert (opts.threads_for("llm"), opts.threads_for("acoustic")) == (1, 2)
    assert (opts.max_batch, opts.acoustic_slots, opts.acoustic_nice, opts.allow_spinning) == (3, 2, 5, True)


def test_load_builds_the_scheduling_the_options_ask_for(tiny_bundle: Path) -> None:
    plain = Synthesizer.load(tiny_bundle, RuntimeOptions(intra_op_threads=1, max_batch=0, acoustic_slots=0))
    assert plain.scheduler is None and plain.gate is None
    batched = Synthesizer.load(tiny_bundle, RuntimeOptions(intra_op_threads=1, max_batch=5, acoustic_slots=2))
    try:
        assert batched.scheduler is not None and batched.scheduler.max_batch == 5
        assert batched.gate is not None and batched.gate.slots == 2
    finally:
        batched.close()


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="per-thread niceness is Linux only")
def test_lower_thread_priority_affects_only_the_calling_thread() -> None:
    seen: dict[str, int] = {}

    def worker() -> None:
        lower_thread_priority(7)
        lower_thread_priority(3)  # never raises the priority back
        seen["worker"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["worker"] == max(7, before)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_default_opens_only_the_core_graphs(tiny_bundle: Path) -> None:
    sessions = open_sessions(ModelBundle.load(tiny_bundle), RuntimeOptions(intra_op_threads=1))
    assert set(sessions) == set(GRAPH_NAMES)


def test_prompt_models_open_by_name_and_run(tiny_bundle: Path) -> None:
    bundle = ModelBundle.load(tiny_bundle)
    sessions = open_sessions(bundle, RuntimeOptions(intra_op_threads=1), names=PROMPT_GRAPH_NAMES)
    assert set(sessions) == {"campplus", "speech_tokenizer"}
    (emb,) = sessions["campplus"].run(["output"], {"input": np.zeros((1, 50, 80), np.float32)})
    assert emb.shape == (1, bundle.constants.spk_embed_dim) and emb.dtype == np.float32
    feeds = {"feats": np.zeros((1, 128, 41), np.float32), "feats_length": np.array([41], np.int32)}
    (tokens,) = sessions["speech_tokenizer"].run(["indices"], feeds)
    assert tokens.shape == (1, 1, 21) and tokens.dtype == np.int64  # T_tok = (T - 1) // 2 + 1
    assert np.all((tokens >= 0) & (tokens < bundle.constants.speech_token_size))


def test_prompt_models_get_the_same_session_options(tiny_bundle: Path) -> None:
    opts = RuntimeOptions(intra_op_threads=2, acoustic_threads=1, shrink_acoustic_arenas=False)
    sessions = open_sessions(ModelBundle.load(tiny_bundle), opts, names=["campplus"])
    options = sessions["campplus"].get_session_options()
    assert options.intra_op_num_threads == make_session_options(opts, "campplus").intra_op_num_threads == 1


def test_prompt_models_of_a_bundle_without_them(tiny_bundle: Path, tmp_path: Path) -> None:
    root = tmp_path / "b"
    shutil.copytree(tiny_bundle, root)
    data = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    data["capabilities"]["prompt_analysis"] = False
    for name in PROMPT_GRAPH_NAMES:
        del data["graphs"][name]
    (root / "manifest.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(BundleError, match="manifest has no graph 'campplus'"):
        open_sessions(ModelBundle.load(root), RuntimeOptions(intra_op_threads=1), names=["campplus"])


def test_prompt_model_file_with_other_names_is_refused_when_opened(tiny_bundle: Path, tmp_path: Path) -> None:
    root = tmp_path / "b"
    shutil.copytree(tiny_bundle, root)
    shutil.copyfile(root / "campplus.onnx", root / "speech_tokenizer_v1.onnx")  # swapped file, hashes not checked
    with pytest.raises(BundleError, match=r"speech_tokenizer_v1\.onnx: inputs \['input'\]"):
        open_sessions(ModelBundle.load(root), RuntimeOptions(intra_op_threads=1), names=["speech_tokenizer"])


def test_onnxruntime_telemetry_is_off_unless_asked_for(tmp_path: Path) -> None:
    """ORT 1.31 starts its telemetry at import (a device id under ~/.cache, a ProcessInfo event, a warning where
    HOME is read-only): importing the engine in a fresh interpreter, without ORT_DISABLE_TELEMETRY set, does none."""
    env = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"}
    env |= {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / ".cache")}
    probe = "import service.engine.sessions, os; print(os.environ.get('ORT_DISABLE_TELEMETRY'))"
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")] == [], "onnxruntime wrote its device id"
    assert "telemetry" not in done.stderr and done.stdout.strip() == "1", (done.stdout, done.stderr)


class _RecordingSession:
    """Records the run options of each call (what ShrinkingSession passes on)."""

    def __init__(self) -> None:
        self.options: list[object] = []

    def run(self, names: object, feeds: object, options: object = None) -> list[np.ndarray]:
        self.options.append(options)
        return []


def test_llm_step_gives_back_its_arena_after_a_prefill_only(tiny_bundle: Path) -> None:
    """A prefill (many positions at once) leaves arena chunks no decode step reuses: they go back after it; decode
    steps keep their arena."""
    bundle = ModelBundle.load(tiny_bundle)
    step = open_sessions(bundle, RuntimeOptions(intra_op_threads=1), ["llm_step"])["llm_step"]
    assert isinstance(step, ShrinkingSession) and step.get_inputs()  # the session's own methods reach through
    recording = _RecordingSession()
    wrapped = ShrinkingSession(recording, when=prefill)  # type: ignore[arg-type]
    d = 8
    wrapped.run(None, {"x": np.zeros((1, 12, d), np.float32)})
    wrapped.run(None, {"x": np.zeros((3, 1, d), np.float32)})
    assert recording.options[0] is not None and recording.options[1] is None
    plain = open_sessions(bundle, RuntimeOptions(intra_op_threads=1, enable_cpu_mem_arena=False), ["llm_step"])["llm_step"]
    assert not isinstance(plain, ShrinkingSession)


def test_position_table_projected_in_pieces_equals_one_call(tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The table is projected PROJECT_ROWS rows a call (each row's projection is its own): the same table as one call
    over every row."""
    from service.families.cosyvoice1 import llm as v1_llm
    from service.families.cosyvoice1.contract import relative_pe

    bundle = ModelBundle.load(tiny_bundle)
    pos = open_sessions(bundle, RuntimeOptions(intra_op_threads=1), ["llm_pos"])["llm_pos"]
    monkeypatch.setattr(v1_llm, "PROJECT_ROWS", 48)
    calls: list[int] = []

    class Counting:
        def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
            calls.append(len(feeds["pe"]))
            return list(pos.run(names, feeds))

    table = v1_llm.position_table(Counting(), bundle.constants, rows=200).table(200)
    assert calls == [48, 48, 48, 48, 8]
    whole = pos.run(["pos"], {"pe": relative_pe(200, bundle.constants.llm_model_dim)})[0]
    np.testing.assert_allclose(table, whole, rtol=0, atol=1e-6)


def test_malloc_mmap_threshold_is_fixed_only_under_a_memory_limit() -> None:
    from service.engine.options import MEMORY_LIMIT_MMAP_THRESHOLD

    assert RuntimeOptions().mmap_threshold() == 0  # glibc's sliding threshold: no page-fault churn
    assert RuntimeOptions(memory_limit_bytes=2 << 30).mmap_threshold() == MEMORY_LIMIT_MMAP_THRESHOLD
    assert RuntimeOptions(memory_limit_bytes=2 << 30, malloc_mmap_threshold=0).mmap_threshold() == 0
    assert RuntimeOptions(malloc_mmap_threshold=4096).mmap_threshold() == 4096
    with pytest.raises(ValueError):
        RuntimeOptions(malloc_mmap_threshold=-1)
