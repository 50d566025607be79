"""A request whose client went away stops consuming CPU at once (issue 40 item 5a): the engine sees the cancel between
two Euler steps of a flow solve (a whole sentence's solve is one call of minutes for a long one), the LLM scheduler
decodes no step for it, and every transport that notices the client leaving (HTTP stream and whole file, the
WebSocket, DashScope, gRPC) cancels the job while the engine is inside that solve.

Preconditions hold by construction: the estimator graph is wrapped so that it cancels the request, or holds its call
until the test lets it go, at a call the test chooses; the tests count graph calls, never time them."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from gated_engine import GatedEngine
from servers import free_port, wait_until
from test_api_concurrency import LiveServer
from websockets.sync.client import connect

from service.api import create_app
from service.api.deps import AppState
from service.bundle import ModelBundle
from service.engine.llm import LLMRunner
from service.engine.options import RuntimeOptions
from service.engine.scheduler import BatchScheduler
from service.engine.sessions import open_sessions
from service.engine.types import SynthesisOptions
from service.families.cosyvoice1.engine import Synthesizer
from service.families.cosyvoice2.assembly import one_thread_calls, open_engine_sessions
from service.families.cosyvoice2.engine import CosyVoice2Engine
from service.families.cosyvoice2.voice import Voice2
from service.rpc import cosyvoice_pb2, cosyvoice_pb2_grpc
from service.settings import Settings

pytestmark = pytest.mark.filterwarnings("ignore:connect.. must be used as a context manager")

REPO = Path(__file__).resolve().parent.parent
V2_PROMPT = REPO / "tests" / "reference" / "tiny-cosyvoice2" / "prompts" / "zh_16k.wav"
VOICE = "cancel-voice"
TEXT = "今天天气很好，我们一起去公园散步吧。"
STEPS = 10  # Euler steps of a flow solve (the tiny bundles' n_timesteps): 2 estimator calls each (guidance rows)
WAIT_S = 60.0  # how long a test waits for another thread to reach a state (a bound, never a measured speed)


class WatchedEstimator:
    """The flow estimator session, counting its calls; `on_call` (if set) runs before each call with its number."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0
        self.on_call: Callable[[int], None] | None = None
        self._lock = threading.Lock()

    def run(self, names: Any, feeds: Mapping[str, np.ndarray]) -> Any:
        with self._lock:
            self.calls += 1
            number = self.calls
        if self.on_call is not None:
            self.on_call(number)
        return self.inner.run(names, feeds)

    def __getattr__(self, name: str) -> Any:  # get_inputs, session, ... of the wrapped session
        return getattr(self.inner, name)


def cancel_at(watched: WatchedEstimator, call: int, cancel: threading.Event) -> None:
    """Set `cancel` (the client goes away) when the estimator is called for the `call`-th time from now."""
    first = watched.calls + call
    watched.on_call = lambda n: cancel.set() if n == first else None


# ---- the engines -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def v1(tiny_bundle: Path) -> tuple[Synthesizer, WatchedEstimator]:
    bundle = ModelBundle.load(tiny_bundle)
    sessions = dict(open_sessions(bundle, RuntimeOptions(intra_op_threads=1)))
    watched = sessions["flow_estimator"] = WatchedEstimator(sessions["flow_estimator"])
    return Synthesizer(bundle, sessions), watched


@pytest.fixture(scope="module")
def v2(tiny_v2_bundle: Path) -> Iterator[tuple[CosyVoice2Engine, WatchedEstimator]]:
    bundle = ModelBundle.load(tiny_v2_bundle)
    runtime = one_thread_calls(RuntimeOptions(intra_op_threads=1, max_batch=0, acoustic_slots=0))
    sessions = open_engine_sessions(bundle, runtime, wide=False)
    watched = sessions["flow_estimator"] = WatchedEstimator(sessions["flow_estimator"])
    engine = CosyVoice2Engine.from_sessions(bundle, sessions, runtime)
    yield engine, watched
    engine.close()


def v2_voice() -> Voice2:
    """A voice whose prompt is shorter than one attention chunk: no prompt-only flow state to compute first."""
    rng = np.random.default_rng(3)
    tokens = tuple(int(t) for t in rng.integers(0, 6561, 10))
    mel = rng.standard_normal((20, 80)).astype(np.float32) - 5
    return Voice2.cloned("v", rng.standard_normal(192).astype(np.float32), tokens, mel, (5, 6, 7))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_v1_stops_inside_a_flow_solve(v1: tuple[Synthesizer, WatchedEstimator], stream: bool) -> None:
    """Cancelled at the third estimator call of the sentence's first solve: no further call, no chunk."""
    synth, watched = v1
    cancel = threading.Event()
    cancel_at(watched, 3, cancel)
    try:
        before = watched.calls
        chunks = list(synth.synthesize([[15947, 1002, 13]], "中文女", SynthesisOptions(stream=stream, seed=1), cancel))
    finally:
        watched.on_call = None
    assert cancel.is_set()
    assert chunks == []
    assert watched.calls - before == 3, f"{watched.calls - before} estimator calls of a solve cancelled at the 3rd"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_cosyvoice2_stops_inside_a_flow_solve(v2: tuple[CosyVoice2Engine, WatchedEstimator], stream: bool) -> None:
    """The same for CosyVoice2: after the call that saw the cancel, at most the other guidance row of its step."""
    engine, watched = v2
    cancel = threading.Event()
    cancel_at(watched, 3, cancel)
    try:
        before = watched.calls
        chunks = list(engine.synthesize([[1000, 2000, 3000]], v2_voice(), SynthesisOptions(stream=stream, seed=1), cancel))
    finally:
        watched.on_call = None
    assert cancel.is_set()
    assert chunks == []
    assert watched.calls - before <= 4, f"{watched.calls - before} estimator calls of a solve cancelled at the 3rd"


def test_the_scheduler_decodes_nothing_for_a_cancelled_request_its_consumer_does_not_read(tiny_bundle: Path) -> None:
    """The consumer takes one token, is cancelled, and reads no more (it is busy in a flow call): the scheduler drops
    the row before its next step instead of decoding on to the request's max length. The scheduler is held before
    its second decode step until the cancel is set, so the order holds on a machine of any speed."""
    synth = Synthesizer.load(tiny_bundle, RuntimeOptions(intra_op_threads=1, max_batch=0, acoustic_slots=0))
    assert isinstance(synth.llm, LLMRunner)
    held, go, steps = threading.Event(), threading.Event(), [0]

    def before_step() -> None:
        steps[0] += 1
        if steps[0] == 2:
            held.set()
            go.wait(WAIT_S)

    scheduler = BatchScheduler(synth.llm, max_batch=4, before_step=before_step)
    try:
        cancel = threading.Event()
        rng = np.random.default_rng(0)
        tokens = scheduler.generate([15947, 1002, 13], synth.voice("中文女").llm, rng, min_tokens=2000, max_tokens=2000,
                                    cancel=cancel)  # fmt: skip
        next(tokens)
        assert held.wait(WAIT_S)
        cancel.set()
        go.set()
        wait_until(lambda: scheduler.active == 0, WAIT_S, "the cancelled row to leave the batch")
        assert steps[0] <= 2, f"{steps[0]} decode steps for a request cancelled before its second"
        del tokens
    finally:
        go.set()
        scheduler.close()


# ---- the transports ------------------------------------------------------------------------------------
class HeldEstimator(WatchedEstimator):
    """Once `hold()` is called, the next estimator call waits inside the graph until `release()`: the engine is then
    in the middle of a flow solve for as long as the test needs."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.entered = threading.Event()
        self._released = threading.Event()
        self._armed = False

    def hold(self) -> None:
        self.entered.clear()
        self._released.clear()
        self._armed = True
        self.on_call = self._maybe_hold

    def release(self) -> int:
        """Let the held call go on; returns the number of calls so far."""
        self.on_call = None
        calls = self.calls
        self._released.set()
        return calls

    def _maybe_hold(self, _: int) -> None:
        if self._armed:
            self._armed = False
            self.entered.set()
            self._released.wait(WAIT_S)


@dataclass
class HeldApp:
    app: FastAPI
    engines: list[GatedEngine]
    estimators: list[HeldEstimator]
    grpc_port: int

    @property
    def state(self) -> AppState:
        state = self.app.state.tts
        assert isinstance(state, AppState)
        return state

    @property
    def estimator(self) -> HeldEstimator:
        return self.estimators[-1]

    def idle(self) -> bool:
        service = self.state.service
        return service.queue_state() == (0, 0)


@pytest.fixture(scope="module")
def held(tiny_v2_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HeldApp, int]]:
    """The tiny CosyVoice2 bundle served on a free port (HTTP, both WebSockets, gRPC) with a held estimator and a
    saved voice whose streamed prompt state is already cached (nothing of the voice is computed while held)."""
    engines: list[GatedEngine] = []
    estimators: list[HeldEstimator] = []

    def loader(bundle: ModelBundle, options: RuntimeOptions) -> GatedEngine:
        runtime = one_thread_calls(options)
        sessions = open_engine_sessions(bundle, runtime, wide=False)
        estimators.append(HeldEstimator(sessions["flow_estimator"]))
        sessions["flow_estimator"] = estimators[-1]
        engines.append(GatedEngine(CosyVoice2Engine.from_sessions(bundle, sessions, runtime)))
        return engines[-1]

    grpc_port = free_port()
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None, model_dir=tiny_v2_bundle, intra_op_threads=1, rate_limit_per_minute=0, cache_max_bytes=0,
        grpc_port=grpc_port, voices_dir=tmp_path_factory.mktemp("cancel-voices"), concurrent_requests=1,
    )  # fmt: skip
    app = HeldApp(create_app(settings, engine_loader=loader), engines, estimators, grpc_port)
    with LiveServer(app.app) as live:
        with httpx.Client(base_url=live.url, timeout=WAIT_S) as client:
            files = {"audio": (V2_PROMPT.name, V2_PROMPT.read_bytes(), "audio/wav")}
            saved = client.post("/v1/voices", data={"name": VOICE, "transcript": "希望你以后能够做的比我还好呦。"}, files=files)
            assert saved.status_code == 201, saved.text
            warm = client.post("/tts", json={"text": "你好。", "speaker": VOICE, "format": "pcm", "stream": True})
            assert warm.status_code == 200, warm.text
        yield app, live.port


def http_request(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    """A POST sent on a raw socket (closing it is the client going away, at a moment the test chooses)."""
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    sock.sendall(head.encode() + data)
    return sock


def leave_http(stream: bool) -> Callable[[int], Callable[[], None]]:
    def start(port: int) -> Callable[[], None]:
        sock = http_request(port, "/tts", {"text": TEXT, "speaker": VOICE, "format": "mp3", "stream": stream})
        return sock.close

    return start


def leave_websocket(port: int) -> Callable[[], None]:
    ws = connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream", open_timeout=WAIT_S, max_size=None)
    ws.send(json.dumps({"type": "config", "voice": VOICE, "format": "pcm"}))
    json.loads(ws.recv(timeout=WAIT_S))  # ready
    ws.send(json.dumps({"type": "text", "text": TEXT}))
    ws.send(json.dumps({"type": "flush"}))
    return ws.close


def leave_dashscope(port: int) -> Callable[[], None]:
    ws = connect(f"ws://127.0.0.1:{port}/api-ws/v1/inference", open_timeout=WAIT_S, max_size=None)
    params = {"voice": VOICE, "format": "pcm", "sample_rate": 24000}
    payload = {"model": "cosyvoice-v2", "task_group": "audio", "task": "tts", "function": "SpeechSynthesizer"}
    header = {"action": "run-task", "task_id": "t1", "streaming": "duplex"}
    ws.send(json.dumps({"header": header, "payload": payload | {"parameters": params, "input": {}}}))
    assert json.loads(ws.recv(timeout=WAIT_S))["header"]["event"] == "task-started"
    more = {"header": {"action": "continue-task", "task_id": "t1", "streaming": "duplex"}, "payload": {"input": {"text": TEXT}}}
    ws.send(json.dumps(more))
    ws.send(json.dumps({"header": {"action": "finish-task", "task_id": "t1", "streaming": "duplex"}, "payload": {"input": {}}}))
    return ws.close


def leave_grpc(grpc_port: int) -> Callable[[int], Callable[[], None]]:
    def start(_: int) -> Callable[[], None]:
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        request = cosyvoice_pb2.Request(sft_request=cosyvoice_pb2.sftRequest(spk_id=VOICE, tts_text=TEXT))
        call = cosyvoice_pb2_grpc.CosyVoiceStub(channel).Inference(request)

        def leave() -> None:
            call.cancel()
            channel.close()

        return leave

    return start


TRANSPORTS = ["http-whole", "http-stream", "websocket", "dashscope", "grpc"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_client_that_leaves_stops_the_flow_solve_it_is_in(held: tuple[HeldApp, int], transport: str) -> None:
    """The engine is held inside the first estimator call of the request's first flow solve; the client goes away;
    once the transport has cancelled the job, the held call goes on and the solve stops after it: at most the other
    guidance row of that Euler step runs (the solve had 2 x 10 calls to go)."""
    app, port = held
    starts: dict[str, Callable[[int], Callable[[], None]]] = {
        "http-whole": leave_http(False), "http-stream": leave_http(True), "websocket": leave_websocket,
        "dashscope": leave_dashscope, "grpc": leave_grpc(app.grpc_port),
    }  # fmt: skip
    engine, estimator = app.engines[-1], app.estimator
    wait_until(app.idle, WAIT_S, "the server to be idle")
    seen = len(engine.cancels)
    estimator.hold()
    leave = starts[transport](port)
    try:
        assert estimator.entered.wait(WAIT_S), "the request never reached the flow"
        assert len(engine.cancels) == seen + 1
        leave()
        cancel = engine.cancels[-1]
        wait_until(cancel.is_set, WAIT_S, f"{transport} to cancel the job of a client that left")
    finally:
        calls = estimator.release()
    wait_until(app.idle, WAIT_S, "the cancelled job to end")
    assert estimator.calls - calls <= 1, f"{estimator.calls - calls} estimator calls after the client left"
