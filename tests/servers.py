"""Test helpers that run real processes (redis-server, the app under uvicorn, headless chromium) on free loopback ports."""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import websocket

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port that was free on the loopback interface a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def port_open(port: int, host: str = LOOPBACK) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_until(check: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    """Poll `check` until it returns True; raise TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class ManagedProcess:
    """One child process whose stdout+stderr go to a log file; stopped by its own PID only."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._env = dict(env) if env is not None else None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self._env, cwd=REPO)

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit within `timeout_s`."""
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL (a crash, as far as clients can tell) and reap."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log_text(self, tail_chars: int = 20_000) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-tail_chars:]
        except OSError:
            return ""

    def dump_log(self) -> None:
        """Print the log; pytest shows it only when the test failed."""
        print(f"----- {self.name} (pid {self.proc.pid if self.proc else '-'}) log: {self.log_path} -----")
        print(self.log_text())


class RedisServer(ManagedProcess):
    """A throw-away redis-server: no persistence, loopback only, on a free port."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server not found: run scripts/install_test_deps.sh")
        workdir.mkdir(parents=True, exist_ok=True)
        argv = [binary, "--port", str(self.port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(workdir), "--protected-mode", "yes", "--loglevel", "notice"]
        super().__init__(f"redis:{self.port}", argv, workdir / f"redis-{self.port}.log")

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def start(self) -> None:
        super().start()
        wait_until(lambda: port_open(self.port) or not self.alive(), 10, f"redis-server on port {self.port}")
        if not self.alive():
            pytest.fail(f"redis-server exited at start:\n{self.log_text()}")

    def restart(self) -> None:
        """Start again on the same port (after kill/stop)."""
        self.stop()
        self.start()


def app_env(model_dir: Path, port: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The parent environment without any TTS_* variable, plus the app's address and model."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTS_")}
    env.update({"TTS_MODEL_DIR": str(model_dir), "TTS_HOST": LOOPBACK, "TTS_PORT": str(port), "PYTHONUNBUFFERED": "1"})
    env["TTS_GRPC_PORT"] = "0"  # gRPC only where a test asks for it (extra), never on the shared default port
    env.update(extra or {})
    return env


class AppServer(ManagedProcess):
    """`python -m service.api` (uvicorn) on a free port, configured only through TTS_* variables."""

    def __init__(
        self, workdir: Path, model_dir: Path, env: Mapping[str, str] | None = None, name: str = "app", gate: Path | None = None
    ) -> None:
        """`gate`: serve through tests/gated_server.py, whose engine holds each stream after every chunk while the
        file `gate` is missing (tests/gated_engine.py FileGate); None serves `python -m service.api` itself."""
        self.port = free_port()
        entry = ["-m", "service.api"] if gate is None else [str(REPO / "tests" / "gated_server.py")]
        argv = [sys.executable, *entry]
        # saved voices go to the test's scratch directory unless the test names a place (never the repository)
        env = {"TTS_VOICES_DIR": str(workdir / f"{name}-voices"), **(env or {})}
        self.gate_path = gate
        if gate is not None:
            env["TEST_GATE_FILE"] = str(gate)
        super().__init__(f"{name}:{self.port}", argv, workdir / f"{name}-{self.port}.log", app_env(model_dir, self.port, env))

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, ready_timeout_s: float = 90.0) -> None:
        """Start and wait until GET /readyz answers 200 (the app warms up before it is ready)."""
        super().start()
        try:
            wait_until(lambda: self.ready() or not self.alive(), ready_timeout_s, f"{self.name} /readyz", interval_s=0.2)
        except TimeoutError:
            self.dump_log()
            raise
        if not self.alive():
            pytest.fail(f"{self.name} exited at start:\n{self.log_text()}")

    def ready(self) -> bool:
        try:
            return httpx.get(self.base_url + "/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60, **kwargs)  # type: ignore[arg-type]


def metric_value(metrics_text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """Sum of the samples of `name` in Prometheus text whose labels include `labels` (0.0 when absent)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_part = head.partition("{")
        if metric != name:
            continue
        if labels and not all(f'{k}="{v}"' in label_part for k, v in labels.items()):
            continue
        total += float(value)
    return total


CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",  # chromium picks a free port and writes it to DevToolsActivePort
    "--window-size=1000,900",
]


class Chromium(ManagedProcess):
    """A headless chromium with its own profile directory; `page()` opens a DevTools session on its tab."""

    def __init__(self, workdir: Path) -> None:
        if not CHROMIUM.is_file():
            pytest.fail(f"{CHROMIUM} not found: run scripts/install_test_deps.sh")
        self.profile = workdir / "chromium-profile"
        self.profile.mkdir(parents=True, exist_ok=True)
        argv = [str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "about:blank"]
        super().__init__("chromium", argv, workdir / "chromium.log")
        self.port = 0

    def start(self) -> None:
        active = self.profile / "DevToolsActivePort"
        active.unlink(missing_ok=True)  # a stale file from an earlier run would name a dead port
        super().start()
        wait_until(
            lambda: (active.is_file() and active.read_text().strip() != "") or not self.alive(), 30, "chromium DevTools port"
        )
        if not self.alive():
            pytest.fail(f"chromium exited at start:\n{self.log_text()}")
        self.port = int(active.read_text().splitlines()[0])

    def page(self) -> DevToolsPage:
        targets = httpx.get(f"http://127.0.0.1:{self.port}/json/list", timeout=10).json()
        url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        return DevToolsPage(url)


class DevToolsPage:
    """A minimal synchronous DevTools client for one tab: commands, JS evaluation, clicks, screenshots."""

    def __init__(self, ws_url: str) -> None:
        self._ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self._ids = itertools.count(1)
        self.console: list[str] = []
        self.send("Page.enable")
        self.send("Runtime.enable")

    def close(self) -> None:
        self._ws.close()

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command and return its result; events that arrive meanwhile are logged to `console`."""
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self._ws.recv())
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"DevTools {method} failed: {msg['error']}")
                return dict(msg.get("result", {}))
            self._note_event(msg)

    def _note_event(self, msg: dict[str, Any]) -> None:
        params = msg.get("params", {})
        if msg.get("method") == "Runtime.consoleAPICalled":
            self.console.append(
                params["type"] + ": " + " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            )
        elif msg.get("method") == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.console.append("exception: " + str(details.get("exception", {}).get("description", details.get("text"))))

    def eval(self, expression: str) -> Any:
        """Evaluate JS in the page (promises awaited) and return its JSON value."""
        result = self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"JS error in {expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def navigate(self, url: str) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", 30, f"load of {url}")

    def wait_for(self, expression: str, timeout_s: float, what: str) -> Any:
        """Poll a JS expression until it is truthy; return its value."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.1)
        page_text = self.eval("document.body.innerText")
        raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}; page: {page_text!r}; console: {self.console}")

    def click(self, selector: str) -> None:
        """A real mouse click at the element's centre (counts as a user gesture, unlike element.click())."""
        box = self.eval(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
            " return {x: r.x + r.width / 2, y: r.y + r.height / 2}; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=box["x"], y=box["y"], button="left", clickCount=1)

    def screenshot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))


@contextmanager
def running_apps(
    apps: Sequence[AppServer], start: Callable[[Sequence[AppServer]], None] | None = None
) -> Iterator[Sequence[AppServer]]:
    """Start `apps` (one by one, or with `start`), yield them, then stop each and print its log."""
    try:
        if start is None:
            for app in apps:
                app.start()
        else:
            start(apps)
        yield apps
    finally:
        for app in apps:
            app.stop()
            app.dump_log()
