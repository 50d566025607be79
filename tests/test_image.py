"""The container image built and run for real (docker when its daemon answers, else podman), driven from outside:
readiness, POST /tts, gRPC, the OpenAI route, uid 10001 on a read-only root, saved voices across a restart and
under an arbitrary uid in group 0, the HEALTHCHECK, the SIGTERM drain of an in-flight request, and the image size
(budget 700 MB). Measurements go to test-artifacts/image/measurements.json (`make image-test` prints them)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import container_image as ci
import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from servers import LOOPBACK, free_port, wait_until

from service.rpc import cosyvoice_pb2, cosyvoice_pb2_grpc

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts" / "image"
SIZE_BUDGET_MB = 700
READY_TIMEOUT_S = 120
# debian (default): the base made by scripts/container_image.py, no registry needed; auto, official or an image
# reference build on python:3.11-slim-bookworm or that image instead (see `make image`).
BASE = os.environ.get("IMAGE_TEST_BASE", "debian")
TAG = f"localhost/{ci.IMAGE}:test"  # containers run the built id, so two runs that race on the tag stay apart
PROMPT = REPO / "tests" / "reference" / "tiny" / "prompts" / "zh_16k.wav"
PROMPT_TEXT = "希望你以后能够做的比我还好呦。"
ARBITRARY_UID = "12345"
DRAINING = "Waiting for connections to close"  # uvicorn logs it after closing its listeners, while requests run
_names = itertools.count()


def user_namespaces() -> bool:
    try:
        if int(Path("/proc/sys/user/max_user_namespaces").read_text(encoding="utf-8")) < 1:
            return False
        return subprocess.run(["unshare", "--user", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return False


def cannot_run_here() -> str | None:
    """Why no image can be built and run on this host (one line), None when one can."""
    try:
        engine = ci.pick_engine()
    except ci.ImageError as e:
        return f"{e} (scripts/install_test_deps.sh installs podman)"
    if os.geteuid() != 0 and not user_namespaces():
        return f"{engine} needs root or user namespaces, and this host gives neither"
    if (
        BASE == "debian"
        and not shutil.which("mmdebstrap")
        and not ci.image_id(engine, ci.debian_base_tag(), ci.engine_env(engine))
    ):
        return "the registry-free base needs mmdebstrap (scripts/install_test_deps.sh installs it)"
    return None


@dataclass(frozen=True)
class Engine:
    name: str
    env: dict[str, str]

    def __call__(self, *args: str, check: bool = True, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([self.name, *args], env=self.env, capture_output=True, text=True, timeout=timeout_s)
        assert not check or done.returncode == 0, f"{self.name} {' '.join(args)}: {done.stderr.strip()}"
        return done

    def inspect(self, ref: str, template: str, kind: str = "container") -> Any:
        return json.loads(self(kind, "inspect", "--format", "{{json " + template + "}}", ref).stdout)


class Container:
    """A container of the image, run as docs/deployment.md runs it (ci.run_argv) on free loopback ports; removed by its name."""

    def __init__(self, engine: Engine, image: str, volume: str, user: str | None = None) -> None:
        self.engine, self.image, self.volume, self.user = engine, image, volume, user
        self.name = f"{ci.IMAGE}-test-{os.getpid()}-{next(_names)}"
        self.http_port, self.grpc_port = free_port(), free_port()

    def url(self, path: str) -> str:
        return f"http://{LOOPBACK}:{self.http_port}{path}"

    def run(self) -> float:
        """`run -d`, then seconds until /readyz answers 200 (a real inference: the model is loaded and warm)."""
        started = time.monotonic()
        ports = (f"{LOOPBACK}:{self.http_port}", f"{LOOPBACK}:{self.grpc_port}")
        argv = ci.run_argv(self.engine.name, self.image, self.name, self.volume, ports, self.user)
        self.engine(*argv[1:])
        return self._ready_after(started)

    def start_again(self) -> float:
        started = time.monotonic()
        self.engine("start", self.name)
        return self._ready_after(started)

    def _ready_after(self, started: float) -> float:
        wait_until(lambda: self.ready() or not self.running(), READY_TIMEOUT_S, f"{self.name} to be ready", interval_s=0.2)
        assert self.running(), f"{self.name} exited:\n{self.logs()}"
        return time.monotonic() - started

    def ready(self) -> bool:
        try:
            return httpx.get(self.url("/readyz"), timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def running(self) -> bool:
        return bool(self.engine.inspect(self.name, ".State.Running"))

    def logs(self) -> str:
        done = self.engine("logs", self.name, check=False)
        return done.stdout + done.stderr

    def exec(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return self.engine("exec", self.name, *argv, check=False)

    def status_ids(self) -> tuple[str, str]:
        """(uid, gid) of the server process, pid 1 of the container."""
        status = dict(line.split(":", 1) for line in self.exec("cat", "/proc/1/status").stdout.splitlines() if ":" in line)
        return status["Uid"].split()[0], status["Gid"].split()[0]

    def remove(self) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / f"{self.name}.log").write_text(self.logs(), encoding="utf-8")
        right_away = ["--time", "0"] if self.engine.name == "podman" else []  # docker's rm -f kills at once
        self.engine("rm", "-f", *right_away, self.name, check=False)


@pytest.fixture(scope="module")
def measured() -> Iterator[dict[str, Any]]:
    """Figures of this run (engine, base, seconds to build and to get ready, size), written when the module ends."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for old in ARTIFACTS.glob(f"{ci.IMAGE}-test-*.log"):  # container logs of earlier runs
        old.unlink()
    found: dict[str, Any] = {}
    yield found
    (ARTIFACTS / "measurements.json").write_text(json.dumps(found, indent=2) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def engine() -> Engine:
    reason = cannot_run_here()
    if reason:
        pytest.skip(f"container image: {reason}")
    name = ci.pick_engine()
    return Engine(name, ci.engine_env(name))


@pytest.fixture(scope="module")
def image(engine: Engine, measured: dict[str, Any]) -> str:
    """The image, built once per module from this checkout; its id."""
    started = time.monotonic()
    python_image = ci.resolve_base(engine.name, BASE, engine.env)
    measured |= {"engine": engine.name, "base": python_image or ci.OFFICIAL_BASE, "base_s": round(time.monotonic() - started, 1)}
    started = time.monotonic()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    built = ci.build(engine.name, TAG, python_image, log=ARTIFACTS / "build.log")
    measured |= {
        "build_s": round(time.monotonic() - started, 1),
        "size_mb": round(ci.image_size_bytes(engine.name, built, engine.env) / 1e6),
    }
    return built


def volume_name() -> str:
    """A new named volume: `run -v` creates it as a copy of the image's /app/data (owner 10001, group 0, mode 775)."""
    return f"{ci.IMAGE}-test-{os.getpid()}-{next(_names)}"


@pytest.fixture(scope="module")
def server(engine: Engine, image: str, measured: dict[str, Any]) -> Iterator[Container]:
    """One container as docs/deployment.md runs it, shared by the checks that do not stop it."""
    container = Container(engine, image, volume_name())
    try:
        measured["ready_s"] = round(container.run(), 1)
        yield container
    finally:
        container.remove()
        engine("volume", "rm", "-f", container.volume, check=False)


def speak(container: Container, speaker: str | None = None) -> httpx.Response:
    body = {"text": "镜像测试。"} | ({"speaker": speaker} if speaker else {})
    return httpx.post(container.url("/tts"), json=body, timeout=120)


def is_wav(response: httpx.Response) -> bool:
    return response.status_code == 200 and response.content[:4] == b"RIFF" and response.content[8:12] == b"WAVE"


def save_voice(container: Container, name: str) -> httpx.Response:
    files = {"audio": ("prompt.wav", PROMPT.read_bytes(), "audio/wav")}
    return httpx.post(container.url("/v1/voices"), data={"name": name, "transcript": PROMPT_TEXT}, files=files, timeout=120)


def voice_names(container: Container) -> list[str]:
    listed = httpx.get(container.url("/v1/voices"), timeout=30)
    assert listed.status_code == 200, listed.text
    return [v["id"] for v in listed.json()["data"]]


class HeldRequest:
    """A POST sent with `Expect: 100-continue`: uvicorn answers 100 only once the app reads the body, so from the 100
    on the request is in flight inside the app, and it stays there until the body is sent. No timing involved."""

    def __init__(self, port: int, path: str, body: bytes) -> None:
        self.body = body
        self.sock = socket.create_connection((LOOPBACK, port), timeout=120)
        head = f"POST {path} HTTP/1.1\r\nHost: {LOOPBACK}:{port}\r\nContent-Type: application/json\r\n"
        self.sock.sendall(f"{head}Expect: 100-continue\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        interim = self.sock.recv(1024)
        assert interim.startswith(b"HTTP/1.1 100 "), interim

    def finish(self) -> tuple[int, bytes]:
        """Send the body; the status and the (de-chunked) payload, read until the server closes the connection."""
        self.sock.sendall(self.body)
        data = b""
        while chunk := self.sock.recv(65536):
            data += chunk
        self.sock.close()
        head, _, payload = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        chunked = any(line.lower().replace(" ", "") == "transfer-encoding:chunked" for line in lines[1:])
        return int(lines[0].split()[1]), dechunk(payload) if chunked else payload


def dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out


def test_the_image_is_within_its_size_budget(image: str, measured: dict[str, Any]) -> None:
    assert measured["size_mb"] <= SIZE_BUDGET_MB, f"the image is {measured['size_mb']} MB, over its {SIZE_BUDGET_MB} MB budget"


def test_it_gets_ready_and_speaks_wav(server: Container) -> None:
    assert server.ready()
    spoken = speak(server)
    assert is_wav(spoken), spoken.text[:300]


def test_the_grpc_port_is_serving_and_answers_the_official_call(server: Container) -> None:
    with grpc.insecure_channel(f"{LOOPBACK}:{server.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="cosyvoice.CosyVoice"), timeout=30
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        request = cosyvoice_pb2.Request(sft_request=cosyvoice_pb2.sftRequest(spk_id="中文女", tts_text="镜像测试。"))
        audio = b"".join(r.tts_audio for r in cosyvoice_pb2_grpc.CosyVoiceStub(channel).Inference(request, timeout=120))
    assert len(audio) > 2000 and len(audio) % 2 == 0  # int16 PCM, as the official client reads it


def test_the_openai_route_answers(server: Container) -> None:
    body = {"model": "tts-1", "voice": "alloy", "input": "Hello from the image.", "response_format": "wav"}
    spoken = httpx.post(server.url("/v1/audio/speech"), json=body, timeout=120)
    assert is_wav(spoken), spoken.text[:300]


def test_it_runs_as_uid_10001_in_group_0_on_a_read_only_root(server: Container, engine: Engine) -> None:
    assert server.status_ids() == ("10001", "0")
    assert engine.inspect(server.name, ".HostConfig.ReadonlyRootfs") is True
    as_root = engine("exec", "--user", "0", server.name, "touch", "/app/probe", check=False)
    assert as_root.returncode != 0 and "Read-only file system" in as_root.stderr, as_root.stderr
    assert server.exec("touch", "/app/data/probe", "/tmp/probe").returncode == 0, "the volume and /tmp are writable"


def test_the_healthcheck_passes_while_it_serves(server: Container, engine: Engine, image: str) -> None:
    assert "/healthz" in " ".join(engine.inspect(image, ".Config.Healthcheck.Test", "image")), "HEALTHCHECK lost in the build"
    if engine.name == "podman":
        checked = engine("healthcheck", "run", server.name, check=False)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    else:  # docker runs it on its own, every 15 s
        wait_until(lambda: engine.inspect(server.name, ".State.Health.Status") == "healthy", 60, "docker's healthcheck")


def test_an_arbitrary_uid_in_group_0_shares_the_saved_voices(server: Container, engine: Engine, image: str) -> None:
    """OpenShift runs images as an arbitrary uid in group 0: it reads, uses, adds and deletes what 10001 saved, and
    10001 uses what it saved (the voices directory and files are group 0 and group-writable)."""
    made = save_voice(server, "carol")
    assert made.status_code == 201, made.text
    other = Container(engine, image, server.volume, user=ARBITRARY_UID)
    try:
        other.run()
        assert other.status_ids() == (ARBITRARY_UID, "0")
        assert "carol" in voice_names(other) and is_wav(speak(other, "carol"))
        made = save_voice(other, "dave")
        assert made.status_code == 201, made.text
        assert httpx.delete(other.url("/v1/voices/carol"), timeout=30).status_code == 204
    finally:
        other.remove()
    assert voice_names(server) == ["dave"]
    assert is_wav(speak(server, "dave"))


def test_sigterm_lets_an_in_flight_request_finish_and_voices_survive_a_restart(
    engine: Engine, image: str, measured: dict[str, Any]
) -> None:
    container = Container(engine, image, volume_name())
    try:
        container.run()
        made = save_voice(container, "erin")
        assert made.status_code == 201, made.text
        held = HeldRequest(container.http_port, "/tts", json.dumps({"text": "停止前收到的请求。"}).encode())
        stop = subprocess.Popen(ci.stop_argv(engine.name, container.name), env=engine.env, stdout=subprocess.DEVNULL)
        try:
            wait_until(lambda: DRAINING in container.logs(), 30, "the app to drain after SIGTERM", interval_s=0.2)
            assert not container.ready(), "a new request was served while draining"
            status, payload = held.finish()
        finally:
            stopped = stop.wait(timeout=60)
        assert status == 200 and payload[:4] == b"RIFF", (status, payload[:200])
        assert stopped == 0 and engine.inspect(container.name, ".State.ExitCode") == 0, container.logs()
        measured["restart_ready_s"] = round(container.start_again(), 1)
        assert "erin" in voice_names(container) and is_wav(speak(container, "erin"))
    finally:
        container.remove()
        engine("volume", "rm", "-f", container.volume, check=False)
