"""Deployment test helpers: nginx rendered from nginx/nginx.conf in front of app processes, and a threaded load driver."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from servers import LOOPBACK, REPO, AppServer, ManagedProcess, free_port, port_open, wait_until

from service.settings import Settings

NGINX_CONF = REPO / "nginx" / "nginx.conf"
UPSTREAM_BLOCK = re.compile(r"(upstream\s+tts_app\s*\{)(.*?)(\})", re.S)
SERVER_LINE = re.compile(r"^(\s*)server\s+\S+(.*);\s*$", re.M)
LISTEN_LINE = re.compile(r"^(\s*)listen\s+\S+;\s*$", re.M)


def drain_timeout_s(env: Mapping[str, str]) -> int:
    """How long an app started with the TTS_* variables `env` (see servers.app_env) lets in-flight requests
    finish after SIGTERM: its TTS_DRAIN_TIMEOUT_S, else the setting's default."""
    value = env.get("TTS_DRAIN_TIMEOUT_S")
    return int(value) if value else int(Settings.model_fields["drain_timeout_s"].default)


def render_site_config(template: str, upstream_ports: Sequence[int], listen_port: int) -> str:
    """nginx/nginx.conf with the upstream `server` lines pointed at loopback ports and `listen` at `listen_port`.

    Nothing else changes: the server parameters (max_fails, fail_timeout) of the first line are kept for all.
    """
    block = UPSTREAM_BLOCK.search(template)
    if block is None:
        raise ValueError("nginx.conf has no `upstream tts_app { ... }` block")
    servers = list(SERVER_LINE.finditer(block.group(2)))
    if len(servers) < 2:
        raise ValueError("the upstream block should list at least two replicas")
    indent, params = servers[0].group(1), servers[0].group(2)
    lines = "".join(f"{indent}server {LOOPBACK}:{port}{params};\n" for port in upstream_ports)
    body = SERVER_LINE.sub("", block.group(2))
    body = re.sub(r"\n\s*\n", "\n", lines + body)
    rendered = template[: block.start(2)] + "\n" + body + template[block.end(2) :]
    rendered, n_listen = LISTEN_LINE.subn(rf"\g<1>listen {LOOPBACK}:{listen_port};", rendered)
    if n_listen != 1:
        raise ValueError(f"expected exactly one `listen` line, found {n_listen}")
    return rendered


def main_config(workdir: Path, site_conf: Path) -> str:
    """A minimal main nginx.conf, as a distribution ships it, that includes the site config from a scratch dir."""
    user = "user root root;\n" if os.geteuid() == 0 else ""  # workers must read the (private) scratch dir
    temp = "".join(f"  {kind}_temp_path {workdir / kind};\n" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return (
        f"{user}daemon off;\nworker_processes 1;\npid {workdir / 'nginx.pid'};\nerror_log {workdir / 'error.log'} info;\n"
        "events { worker_connections 1024; }\n"
        f"http {{\n  access_log {workdir / 'access.log'};\n{temp}  include {site_conf};\n}}\n"
    )


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").is_file() else None)
    if found is None:
        pytest.fail("nginx not found: run scripts/install_test_deps.sh")
    return found


class NginxServer(ManagedProcess):
    """Real nginx (foreground, own prefix) serving nginx/nginx.conf in front of the given app ports."""

    def __init__(self, workdir: Path, upstream_ports: Sequence[int]) -> None:
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        site = workdir / "cosyvoice-lite.conf"
        site.write_text(render_site_config(NGINX_CONF.read_text(encoding="utf-8"), upstream_ports, self.port), encoding="utf-8")
        self.conf = workdir / "nginx.conf"
        self.conf.write_text(main_config(workdir, site), encoding="utf-8")
        self.workdir = workdir
        argv = [nginx_binary(), "-p", str(workdir), "-c", str(self.conf), "-e", str(workdir / "error.log")]
        super().__init__(f"nginx:{self.port}", argv, workdir / "nginx-stdout.log")

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> None:
        check = ManagedProcess("nginx-t", [*self.argv, "-t"], self.workdir / "nginx-t.log")
        check.start()
        assert check.proc is not None
        if check.proc.wait(timeout=30) != 0:
            pytest.fail(f"nginx -t rejected the rendered config:\n{check.log_text()}")
        super().start()
        wait_until(lambda: port_open(self.port) or not self.alive(), 15, f"nginx on port {self.port}")
        if not self.alive():
            pytest.fail(f"nginx exited at start:\n{self.log_text()}\n{(self.workdir / 'error.log').read_text()}")

    def error_log(self) -> str:
        path = self.workdir / "error.log"
        return path.read_text(encoding="utf-8", errors="replace")[-20_000:] if path.is_file() else ""


class ProcessInDir(ManagedProcess):
    """A ManagedProcess whose working directory is `cwd` (the base class starts everything in the repository)."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str], cwd: Path) -> None:
        super().__init__(name, argv, log_path, env)
        self.cwd = cwd

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self._env, cwd=self.cwd)


def start_apps(apps: Iterable[AppServer], ready_timeout_s: float = 120.0) -> None:
    """Start several apps at once (they load and warm up in parallel) and wait until each one is ready."""
    apps = list(apps)
    for app in apps:
        ManagedProcess.start(app)
    for app in apps:
        try:
            wait_until(lambda a=app: a.ready() or not a.alive(), ready_timeout_s, f"{app.name} /readyz", interval_s=0.2)  # type: ignore[misc]
        except TimeoutError:
            app.dump_log()
            raise
        if not app.alive():
            pytest.fail(f"{app.name} exited at start:\n{app.log_text()}")


@dataclass
class Outcome:
    """One request as the client saw it. `started` = a 200 status line arrived (the response began)."""

    kind: str
    t_start: float
    t_end: float = 0.0
    status: int | None = None
    started: bool = False
    n_bytes: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200


@dataclass
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    def completed_after(self, t: float) -> list[Outcome]:
        """Successful requests that were sent at or after monotonic time `t`."""
        with self.lock:
            return [o for o in self.outcomes if o.ok and o.t_start >= t]

    def wait_completed_after(self, t: float, n: int, timeout_s: float = 60.0) -> None:
        """Block until `n` requests sent after `t` have succeeded (progress, not a fixed sleep, on a busy machine)."""
        wait_until(lambda: len(self.completed_after(t)) >= n, timeout_s, f"{n} successful requests", interval_s=0.1)

    def summary(self) -> str:
        bad = self.failures()
        lines = [f"{len(self.outcomes)} requests, {len(bad)} failed"]
        lines += [f"  {o.kind} status={o.status} started={o.started} bytes={o.n_bytes} error={o.error}" for o in bad[:20]]
        return "\n".join(lines)


RequestFn = Callable[[httpx.Client, int], Outcome]


def tts_request(stream: bool, text_of: Callable[[int], str]) -> RequestFn:
    """A POST /tts (whole file or chunked stream) whose text depends on the request number (no cache hits)."""

    def run(client: httpx.Client, n: int) -> Outcome:
        body = {"text": text_of(n), "format": "wav", "stream": stream, "seed": n}
        out = Outcome("stream" if stream else "whole", time.monotonic())
        try:
            with client.stream("POST", "/tts", json=body) as response:
                out.status = response.status_code
                out.started = response.status_code == 200
                for chunk in response.iter_bytes():
                    out.n_bytes += len(chunk)
        except httpx.HTTPError as e:
            out.error = f"{type(e).__name__}: {e}"
        out.t_end = time.monotonic()
        return out

    return run


class LoadDriver:
    """`users` threads, each sending requests in a loop until `stop()` (or `max_requests` each); bounded in time."""

    def __init__(self, base_url: str, users: int, request: Callable[[int], RequestFn], max_requests: int = 200) -> None:
        self.result = LoadResult()
        self._stop = threading.Event()
        self._counter = iter(range(1_000_000))
        self._counter_lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._user, args=(base_url, request(i), max_requests), daemon=True) for i in range(users)
        ]

    def _next(self) -> int:
        with self._counter_lock:
            return next(self._counter)

    def _user(self, base_url: str, request: RequestFn, max_requests: int) -> None:
        with httpx.Client(base_url=base_url, timeout=60) as client:
            for _ in range(max_requests):
                if self._stop.is_set():
                    return
                self.result.add(request(client, self._next()))

    def start(self) -> LoadDriver:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout_s: float = 90.0) -> LoadResult:
        """Let every user finish its current request, then return all outcomes."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            raise TimeoutError(f"load users still running {timeout_s:.0f} s after stop()")
        return self.result


def mixed_texts(prefix: str) -> Callable[[int], str]:
    """Distinct short texts (request number inside), so every request is synthesized rather than cached."""
    return lambda n: f"{prefix}第{n}次请求，测试一下。This is request {n}."
