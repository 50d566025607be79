"""`python -m service.api` answers from its start while the model loads in the background: /healthz 200, /readyz 503
`loading`, synthesis 503 not_ready with Retry-After, one log line per graph opened; a load that fails stops it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx
import pytest
from api_bundles import flagged_bundle
from gated_engine import FileGate
from servers import AppServer, ManagedProcess, wait_until

from service.bundle import ModelBundle
from service.families.cosyvoice1.llm import TRANSIENT_GRAPHS

pytestmark = pytest.mark.integration


def answers(app: AppServer) -> bool:
    try:
        return httpx.get(app.base_url + "/healthz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def graphs_opened(log: str) -> list[str]:
    return re.findall(r"opened graph (\w+)", log)


def test_health_and_readiness_answer_while_the_model_loads(tmp_path: Path, tiny_bundle: Path) -> None:
    """The warm-up is held by a closed gate (tests/gated_engine.py): the model stays loading until the test opens it,
    however fast the machine is."""
    gate = FileGate(tmp_path / "gate")
    env = {"TTS_INTRA_OP_THREADS": "1", "TTS_RATE_LIMIT_PER_MINUTE": "0", "TEST_GATE_CLOSED": "1"}
    app = AppServer(tmp_path, tiny_bundle, env, name="loading", gate=gate.path)
    try:
        ManagedProcess.start(app)
        wait_until(lambda: answers(app) or not app.alive(), 60, "/healthz")
        wait_until(lambda: "warming up" in app.log_text() or not app.alive(), 60, "the warm-up (graphs opened)")
        assert app.alive(), app.log_text()
        with app.client() as http:
            assert http.get("/healthz").json() == {"status": "ok"}
            ready = http.get("/readyz")
            assert ready.status_code == 503 and ready.headers["retry-after"] == "5"
            assert ready.json() | {"cache": "-"} == {"status": "not_ready", "engine": "loading", "cache": "-", "detail": None}
            for path, body in (
                ("/tts", {"text": "你好。"}),
                ("/v1/audio/speech", {"model": "tts-1", "input": "hi", "voice": "alloy"}),
            ):
                refused = http.post(path, json=body)
                assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1, refused.text
                assert refused.json()["error"]["code"] == "not_ready", refused.text
            gate.set()  # the warm-up may finish now
            wait_until(app.ready, 60, "/readyz 200 after the load")
            assert http.get("/readyz").json()["status"] == "ready"
            assert http.post("/tts", json={"text": "你好。"}).status_code == 200
    finally:
        gate.set()
        app.stop()
        app.dump_log()
    opened = graphs_opened(app.log_text(tail_chars=10_000_000))
    manifest = ModelBundle.load(tiny_bundle).manifest
    expected = {n for n, g in manifest.graphs.items() if g.group in ("core", "prompt")} - TRANSIENT_GRAPHS
    assert set(opened) == expected, opened  # every graph, with its name
    # each once, but HiFT's decode graph, which also opens as the two-thread session of chunks that take both cores
    assert sorted(n for n in set(opened) if opened.count(n) > 1) in ([], ["hift_decode"]), opened
    assert opened.count("hift_decode") <= 2, opened


def test_a_model_that_cannot_load_stops_the_server_with_status_1(tmp_path: Path, tiny_bundle: Path) -> None:
    """The manifest is fine (checked before uvicorn starts), a graph file is not ONNX: the load fails in the
    background, the log says why in one line, and the process exits 1 instead of staying up `loading`."""
    bundle = flagged_bundle(tiny_bundle, tmp_path / "broken")
    victim = ModelBundle.load(bundle).graph_path("hift_decode")
    victim.unlink()  # the copy's symlink, not the committed file
    victim.write_bytes(b"not an onnx graph")
    app = AppServer(tmp_path, bundle, {"TTS_INTRA_OP_THREADS": "1"}, name="broken")
    ManagedProcess.start(app)
    try:
        assert app.proc is not None
        code = app.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        app.stop()
        pytest.fail(f"the server stayed up with a model that cannot load:\n{app.log_text()}")
    log = app.log_text()
    assert code == 1, log
    assert "the model could not be loaded: " in log and "hift_decode" in log and "Traceback" not in log, log
