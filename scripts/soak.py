"""Soak test: run the app under steady load for a fixed time and fail when its resident memory keeps growing.

    python scripts/soak.py --duration-s 600 --users 2 --model-dir models/tiny --out test-artifacts/soak

Starts `python -m service.api` on a free loopback port (rate limit off, a small in-process audio cache so the
cache fills during warm-up and then only churns), drives `--users` clients that each send requests back to
back (whole files and streams, fresh text of one size each time) after one warm-up request per text and
mode, samples the app's RSS from /proc, and compares the mean RSS of the last minute with that of the minute
after --warmup-s. Writes rss.csv and summary.json to --out.
Exit status 0 when growth < --max-growth and no request failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = "127.0.0.1"
TEXTS = ["今天天气很好，我们去公园散步吧。", "The meeting starts at nine thirty.", "欢迎使用语音合成服务，Streaming works too。"]


@dataclass
class Sample:
    t_s: float
    rss_mib: float
    requests: int
    failures: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration-s", type=float, default=600.0, help="load duration after warm-up starts (default 600)")
    p.add_argument("--warmup-s", type=float, default=60.0, help="load before the baseline window (default 60)")
    p.add_argument("--window-s", type=float, default=60.0, help="length of the baseline and final windows (default 60)")
    p.add_argument("--users", type=int, default=2, help="concurrent clients (default 2)")
    p.add_argument("--interval-s", type=float, default=2.0, help="RSS sampling interval (default 2)")
    p.add_argument("--max-growth", type=float, default=0.05, help="allowed relative RSS growth (default 0.05)")
    p.add_argument("--model-dir", type=Path, default=REPO / "models" / "tiny")
    p.add_argument("--out", type=Path, default=REPO / "test-artifacts" / "soak")
    args = p.parse_args(argv)
    if args.duration_s < args.warmup_s + 2 * args.window_s:
        p.error("--duration-s must cover the warm-up and two windows")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    """Resident set size of `pid` in MiB (VmRSS from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start_app(model_dir: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTS_")}
    env.update(
        TTS_HOST=LOOPBACK, TTS_PORT=str(port), TTS_MODEL_DIR=str(model_dir), TTS_RATE_LIMIT_PER_MINUTE="0",
        TTS_CACHE_MAX_BYTES=str(4 << 20), TTS_LOG_LEVEL="warning",
    )  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "service.api"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://{LOOPBACK}:{port}/readyz", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the app did not become ready; see {log_path}")


class Load:
    """`users` threads sending requests until `stop` is set; counts requests and failures."""

    def __init__(self, base_url: str, users: int) -> None:
        self.requests = self.failures = 0
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._user, args=(base_url, u), daemon=True) for u in range(users)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(120)

    def _user(self, base_url: str, user: int) -> None:
        rng = random.Random(user)
        with httpx.Client(base_url=base_url, timeout=120) as client:
            while not self.stop.is_set():
                self._record(speak(client, rng.choice(TEXTS), rng.randint(100_000, 999_999), rng.random() < 0.5))

    def _record(self, ok: bool) -> None:
        with self._lock:
            self.requests += 1
            self.failures += not ok


def speak(client: httpx.Client, text: str, number: int, stream: bool) -> bool:
    """One /tts request with a fresh number in the text (always six digits: every request has the same size)."""
    try:
        with client.stream("POST", "/tts", json={"text": f"{text} {number}", "stream": stream}) as response:
            return response.status_code == 200 and sum(len(c) for c in response.iter_bytes()) > 44
    except httpx.HTTPError:
        return False


def warm_up(base_url: str) -> None:
    """Every text in both modes once, so that buffers reach their working size before the baseline window."""
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for text in TEXTS:
            for stream in (False, True):
                if not speak(client, text, 999_999, stream):
                    raise SystemExit(f"warm-up request failed: {text!r} stream={stream}")


def window_mean(samples: list[Sample], start_s: float, end_s: float) -> float:
    values = [s.rss_mib for s in samples if start_s <= s.t_s < end_s]
    if not values:
        raise SystemExit(f"no RSS samples between {start_s:.0f} s and {end_s:.0f} s")
    return statistics.fmean(values)


def run(args: argparse.Namespace) -> dict[str, object]:
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = start_app(args.model_dir.resolve(), port, args.out / "app.log")
    load = Load(f"http://{LOOPBACK}:{port}", args.users)
    samples: list[Sample] = []
    try:
        warm_up(f"http://{LOOPBACK}:{port}")
        t0 = time.monotonic()
        load.start()
        while (elapsed := time.monotonic() - t0) < args.duration_s and proc.poll() is None:
            samples.append(Sample(round(elapsed, 1), round(rss_mib(proc.pid), 2), load.requests, load.failures))
            time.sleep(args.interval_s)
    finally:
        load.join()
        alive = proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    (args.out / "rss.csv").write_text(
        "t_s,rss_mib,requests,failures\n" + "".join(f"{s.t_s},{s.rss_mib},{s.requests},{s.failures}\n" for s in samples)
    )
    baseline = window_mean(samples, args.warmup_s, args.warmup_s + args.window_s)
    final = window_mean(samples, args.duration_s - args.window_s, args.duration_s)
    summary: dict[str, object] = {
        "duration_s": args.duration_s,
        "users": args.users,
        "requests": load.requests,
        "failures": load.failures,
        "app_alive_at_end": alive,
        "rss_start_mib": samples[0].rss_mib,
        "rss_baseline_mib": round(baseline, 2),
        "rss_final_mib": round(final, 2),
        "rss_max_mib": max(s.rss_mib for s in samples),
        "growth": round(final / baseline - 1, 4),
        "max_growth": args.max_growth,
        "last_sample": asdict(samples[-1]),
    }
    summary["passed"] = bool(alive and load.failures == 0 and float(summary["growth"]) < args.max_growth)  # type: ignore[arg-type]
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    summary = run(parse_args(argv))
    print(json.dumps(summary, indent=2))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
