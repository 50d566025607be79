"""Soak test: run the app under steady load for a fixed time and fail when its resident memory keeps growing.

    python scripts/soak.py --duration-s 300 --users 4 --model-dir models/tiny --out test-artifacts/soak

Starts `python -m service.api` on a free loopback port (rate limit off, a small in-process audio cache so the
cache fills during warm-up and then only churns; `--set TTS_NAME=VALUE` adds settings), drives `--users` clients
that each send requests back to back (whole files and streams, fresh text of one size each time) after one warm-up
request per text and mode, and samples the app's RSS from /proc every --interval-s. Every --idle-every-s the clients
pause: once no request is in flight, the RSS is sampled idle, then the load resumes. What the app keeps between
requests is what a leak grows; the RSS under load also holds the requests in flight (HiFT's activations for a whole
sentence: ~100 MB on the tiny bundle), which swing the loaded samples by a third. So the verdict compares the lowest
idle RSS of the last --window-s with that of the window after --warmup-s (the loaded means are reported beside it).
Writes rss.csv and summary.json to --out. Exit status 0 when growth < --max-growth and no request failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = "127.0.0.1"
TEXTS = ["今天天气很好，我们去公园散步吧。", "The meeting starts at nine thirty.", "欢迎使用语音合成服务，Streaming works too。"]
# A model without built-in speakers (CosyVoice2) speaks as a voice saved from this recording, named SOAK_VOICE.
PROMPT_WAV = REPO / "tests" / "reference" / "tiny-cosyvoice2" / "prompts" / "zh_16k.wav"
PROMPT_TEXT = "希望你以后能够做的比我还好呦。"
SOAK_VOICE = "soak-voice"
IDLE_READINGS = 3  # RSS readings per idle sample, 0.5 s apart (the lowest is kept: memory freed as the last reply left)


@dataclass
class Sample:
    t_s: float
    rss_mib: float
    requests: int
    failures: int
    idle: bool = False  # taken with every client paused and no request in flight


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration-s", type=float, default=300.0, help="load duration after warm-up starts (default 300)")
    p.add_argument("--warmup-s", type=float, default=60.0, help="load before the baseline window (default 60)")
    p.add_argument("--window-s", type=float, default=60.0, help="length of the baseline and final windows (default 60)")
    p.add_argument("--users", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--interval-s", type=float, default=2.0, help="RSS sampling interval under load (default 2)")
    p.add_argument("--idle-every-s", type=float, default=15.0, help="pause the load for an idle sample (default 15)")
    p.add_argument("--max-growth", type=float, default=0.05, help="allowed relative idle RSS growth (default 0.05)")
    p.add_argument("--model-dir", type=Path, default=REPO / "models" / "tiny")
    p.add_argument("--out", type=Path, default=REPO / "test-artifacts" / "soak")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="TTS_NAME=VALUE", type=setting,
                   help="a setting for the app (repeatable), e.g. TTS_ACOUSTIC_BACKEND=openvino")  # fmt: skip
    args = p.parse_args(argv)
    if args.duration_s < args.warmup_s + 2 * args.window_s:
        p.error("--duration-s must cover the warm-up and two windows")
    if args.idle_every_s > args.window_s / 2:
        p.error("--idle-every-s must give each window at least two idle samples")
    return args


def setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.startswith("TTS_"):
        raise argparse.ArgumentTypeError(f"expected TTS_NAME=VALUE, got {text!r}")
    return name, value


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


def start_app(model_dir: Path, port: int, out: Path, settings: list[tuple[str, str]]) -> subprocess.Popen[bytes]:
    """The app on `port`, its log in `out` and its saved voices in a fresh directory there."""
    voices = out / "voices"
    shutil.rmtree(voices, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTS_")}
    env.update(
        TTS_HOST=LOOPBACK, TTS_PORT=str(port), TTS_MODEL_DIR=str(model_dir), TTS_RATE_LIMIT_PER_MINUTE="0",
        TTS_CACHE_MAX_BYTES=str(4 << 20), TTS_LOG_LEVEL="warning", TTS_GRPC_PORT="0",
        TTS_VOICES_DIR=str(voices),
    )  # fmt: skip
    env.update(settings)
    log_path = out / "app.log"
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
    """`users` threads sending requests until `stop()`; counts requests and failures. `pause()` returns once every
    client has finished its request and waits; `resume()` lets them go on."""

    def __init__(self, base_url: str, users: int, speaker: str | None) -> None:
        self.speaker = speaker
        self.requests = self.failures = 0
        self._stopped = self._paused = False
        self._in_flight = 0
        self._cond = threading.Condition()
        self._threads = [threading.Thread(target=self._user, args=(base_url, u), daemon=True) for u in range(users)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def pause(self) -> None:
        with self._cond:
            self._paused = True
            self._cond.wait_for(lambda: self._in_flight == 0)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(120)

    def _user(self, base_url: str, user: int) -> None:
        rng = random.Random(user)
        with httpx.Client(base_url=base_url, timeout=120) as client:
            while self._next():
                ok = speak(client, rng.choice(TEXTS), rng.randint(100_000, 999_999), rng.random() < 0.5, self.speaker)
                with self._cond:
                    self.requests += 1
                    self.failures += not ok
                    self._in_flight -= 1
                    self._cond.notify_all()

    def _next(self) -> bool:
        """Wait while paused; False once stopped, else one more request is in flight."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopped or not self._paused)
            if self._stopped:
                return False
            self._in_flight += 1
            return True


def soak_speaker(base_url: str) -> str | None:
    """None (the default speaker) for a model with built-in speakers; else SOAK_VOICE, saved now from PROMPT_WAV."""
    with httpx.Client(base_url=base_url, timeout=120) as client:
        if client.get("/info").json()["speakers"]:
            return None
        files = {"audio": (PROMPT_WAV.name, PROMPT_WAV.read_bytes(), "audio/wav")}
        response = client.post("/v1/voices", data={"name": SOAK_VOICE, "transcript": PROMPT_TEXT}, files=files)
        if response.status_code != 201:
            raise SystemExit(f"saving the soak's voice failed: {response.status_code} {response.text}")
        return SOAK_VOICE


def speak(client: httpx.Client, text: str, number: int, stream: bool, speaker: str | None) -> bool:
    """One /tts request with a fresh number in the text (always six digits: every request has the same size)."""
    body = {"text": f"{text} {number}", "stream": stream} | ({"speaker": speaker} if speaker else {})
    try:
        with client.stream("POST", "/tts", json=body) as response:
            return response.status_code == 200 and sum(len(c) for c in response.iter_bytes()) > 44
    except httpx.HTTPError:
        return False


def warm_up(base_url: str, speaker: str | None) -> None:
    """Every text in both modes once, so that buffers reach their working size before the baseline window."""
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for text in TEXTS:
            for stream in (False, True):
                if not speak(client, text, 999_999, stream, speaker):
                    raise SystemExit(f"warm-up request failed: {text!r} stream={stream}")


def idle_rss(pid: int) -> float:
    """The lowest of IDLE_READINGS readings of the RSS of `pid` (MiB), 0.5 s apart."""
    readings = []
    for i in range(IDLE_READINGS):
        time.sleep(0.5 if i else 0.0)
        readings.append(rss_mib(pid))
    return min(readings)


def window_values(samples: Sequence[Sample], start_s: float, end_s: float, *, idle: bool) -> list[float]:
    return [s.rss_mib for s in samples if start_s <= s.t_s < end_s and s.idle == idle]


def lowest_idle(samples: Sequence[Sample], start_s: float, end_s: float) -> float:
    values = window_values(samples, start_s, end_s, idle=True)
    if not values:
        raise SystemExit(f"no idle RSS sample between {start_s:.0f} s and {end_s:.0f} s: lengthen --window-s")
    return min(values)


def loaded_mean(samples: Sequence[Sample], start_s: float, end_s: float) -> float | None:
    values = window_values(samples, start_s, end_s, idle=False)
    return round(statistics.fmean(values), 2) if values else None


def drive(args: argparse.Namespace, proc: subprocess.Popen[bytes], load: Load) -> list[Sample]:
    """Run `load` for --duration-s, sampling the app's RSS every --interval-s and idle every --idle-every-s."""
    samples: list[Sample] = []
    t0 = time.monotonic()
    next_idle = args.idle_every_s
    load.start()
    try:
        while (elapsed := time.monotonic() - t0) < args.duration_s and proc.poll() is None:
            if elapsed < next_idle:
                samples.append(Sample(round(elapsed, 1), round(rss_mib(proc.pid), 2), load.requests, load.failures))
                time.sleep(args.interval_s)
                continue
            load.pause()  # requests to an app that died fail at once: the pause ends either way
            rss = idle_rss(proc.pid)
            resumed_s = time.monotonic() - t0
            samples.append(Sample(round(resumed_s, 1), round(rss, 2), load.requests, load.failures, True))
            load.resume()
            next_idle = resumed_s + args.idle_every_s  # a slow drain does not make the next pause come sooner
    finally:
        load.stop()
    return samples


def summarize(args: argparse.Namespace, samples: Sequence[Sample], alive: bool) -> dict[str, object]:
    """The verdict: growth of the lowest idle RSS from the baseline window (after --warmup-s) to the last --window-s,
    with the loaded means beside it; passed when the app lived, no request failed and the growth stayed under
    --max-growth. The lowest, because an idle reading only ever exceeds what the app keeps for good (an acoustic
    session's arena holds its last call's region until its next call, glibc the heap freed since the last trim: tens of
    MB at times), while a leak raises every reading."""
    baseline_window = (args.warmup_s, args.warmup_s + args.window_s)
    final_window = (args.duration_s - args.window_s, args.duration_s + args.idle_every_s)  # the last pause may end late
    baseline = lowest_idle(samples, *baseline_window)
    final = lowest_idle(samples, *final_window)
    last = samples[-1]
    summary: dict[str, object] = {
        "duration_s": args.duration_s,
        "users": args.users,
        "requests": last.requests,
        "failures": last.failures,
        "app_alive_at_end": alive,
        "rss_start_mib": samples[0].rss_mib,
        "rss_idle_baseline_mib": round(baseline, 2),
        "rss_idle_final_mib": round(final, 2),
        "rss_loaded_baseline_mib": loaded_mean(samples, *baseline_window),
        "rss_loaded_final_mib": loaded_mean(samples, *final_window),
        "rss_max_mib": max(s.rss_mib for s in samples),
        "growth": round(final / baseline - 1, 4),
        "max_growth": args.max_growth,
        "last_sample": asdict(last),
    }
    summary["passed"] = alive and last.failures == 0 and final / baseline - 1 < args.max_growth
    return summary


def run(args: argparse.Namespace) -> dict[str, object]:
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = start_app(args.model_dir.resolve(), port, args.out, args.settings)
    base_url = f"http://{LOOPBACK}:{port}"
    try:
        speaker = soak_speaker(base_url)
        warm_up(base_url, speaker)
        samples = drive(args, proc, Load(base_url, args.users, speaker))
    finally:
        alive = proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    (args.out / "rss.csv").write_text(
        "t_s,rss_mib,requests,failures,idle\n"
        + "".join(f"{s.t_s},{s.rss_mib},{s.requests},{s.failures},{int(s.idle)}\n" for s in samples)
    )
    summary = summarize(args, samples, alive)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    summary = run(parse_args(argv))
    print(json.dumps(summary, indent=2))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
