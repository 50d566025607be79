"""Benchmark over HTTP: a real uvicorn server process on a free loopback port, closed-loop streaming clients.

`serve` runs the app (create_app) with the engine forced to a fixed token count (random-init weights never
emit EOS); `load` starts that server, drives 1/2/4/8 clients through POST /tts (stream, pcm), and reports
first-chunk p50/p95, aggregate audio seconds per wall second, failures and the server's peak RSS as JSON.
With `--voice-seconds S` it also stores a saved (cloned) voice with an S-second prompt in the server's voice
directory and measures first audio at 1 client for that voice and for the built-in speaker, alternately.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.bench_engine import (
    PROMPT_TEXT,
    SHORT_TEXT,
    SHORT_TOKENS,
    ForcedLength,
    Run,
    closed_loop,
    load_summary,
    random_prompt,
)

REPO = Path(__file__).resolve().parents[1]
V1_PCM_BYTES_PER_S = 2 * 22050  # /tts pcm of a v1 bundle: int16 mono at 22,050 Hz


def pcm_bytes_per_s(bundle_dir: Path) -> int:
    """Bytes per second of /tts pcm: int16 mono at the model's own rate (22,050 Hz v1, 24,000 Hz CosyVoice2)."""
    from service.bundle import ModelBundle

    return 2 * ModelBundle.load(bundle_dir).constants.sample_rate


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(args: argparse.Namespace) -> None:
    """Run the service app in this process (blocks) with every request forced to `args.tokens` tokens."""
    import uvicorn

    from service.api.app import create_app
    from service.bundle import ModelBundle
    from service.engine.options import RuntimeOptions
    from service.families.registry import family
    from service.settings import Settings

    settings = Settings(_env_file=None, model_dir=args.bundle, port=args.port)  # type: ignore[call-arg]

    def forced(bundle: ModelBundle, runtime: RuntimeOptions) -> object:
        """The bundle's family engine as the service loads it, its LLM forced to `args.tokens` per sentence."""
        engine = family(bundle.family).load_engine(bundle, runtime)
        engine.llm = ForcedLength(engine.llm, args.tokens)  # type: ignore[attr-defined]  # the same generate() signature
        return engine

    uvicorn.run(create_app(settings, engine_loader=forced), host="127.0.0.1", port=args.port, log_level="warning")


def server_env(n_timesteps: int | None, extra: dict[str, str]) -> dict[str, str]:
    """The service's default settings. Only what a benchmark must change: every client shares one IP, so the
    per-client rate limit is off; warnings only in the log; no gRPC listener (its fixed port could be taken);
    `--n-timesteps` when a row asks for it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTS_")}
    env |= {"TTS_RATE_LIMIT_PER_MINUTE": "0", "TTS_LOG_LEVEL": "warning", "TTS_GRPC_PORT": "0"}  # gRPC unused here
    if n_timesteps:
        env["TTS_ENGINE_PROFILE"] = f"n_timesteps={n_timesteps}"
    return env | extra


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not ready in time")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def write_saved_voice(bundle_dir: Path, voices_dir: Path, seconds: float, seed: int = 7) -> str:
    """Store a saved voice as a `seconds`-long prompt analysis gives it (v1: 50 speech tokens and 86.13 mel frames
    per second; CosyVoice2: 25 tokens and 50 frames), a transcript, an x-vector. The full-size bundle has random
    weights and no prompt models, so the features are drawn at random with the real sizes: what costs time is their
    length, not their values."""
    import numpy as np

    from loadtest.bundles import VOICE_VARIANTS
    from service.bundle import ModelBundle
    from service.families.voices import models_fingerprint
    from service.stores.voices import DirectoryVoiceStore, PromptFeatures, SavedVoice

    bundle = ModelBundle.load(bundle_dir)
    tokens, mel = random_prompt(bundle.constants, seconds, seed)
    embedding = next(iter(bundle.speakers.values())).astype(np.float32)
    variant = VOICE_VARIANTS[bundle.family]
    features = PromptFeatures(embedding, tokens, mel, duration_s=seconds, mel_variant=variant)
    name = f"bench-cloned-{seconds:g}s"
    voice = SavedVoice(name, PROMPT_TEXT, features, audio_sha256="0" * 64, models=models_fingerprint(bundle))
    DirectoryVoiceStore(voices_dir).add(voice, max_voices=1000)
    return name


def stream_request(
    client: httpx.Client, seed: int, speaker: str | None = None, first_only: bool = False, bytes_per_s: float = V1_PCM_BYTES_PER_S
) -> Run:
    """One streamed /tts request: first audio bytes latency and audio seconds received (`first_only`: hang up at the
    first audio, which cancels the synthesis: only the latency is measured; `bytes_per_s`: the model's PCM rate)."""
    t0 = time.perf_counter()
    first = None
    received = 0
    try:
        body = {"text": SHORT_TEXT, "stream": True, "format": "pcm", "seed": seed}
        if speaker:
            body["speaker"] = speaker
        with client.stream("POST", "/tts", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}")
            for piece in resp.iter_bytes():
                if piece and first is None:
                    first = time.perf_counter() - t0
                received += len(piece)
                if first_only and first is not None:
                    break
    except Exception as e:  # counted as a failure
        print(f"request failed: {type(e).__name__}: {e}", file=sys.stderr)
        return Run(time.perf_counter() - t0, 0.0, float("nan"), 0.0, 0.0, 0.0, failed=True)
    wall = time.perf_counter() - t0
    return Run(wall, received / bytes_per_s, first if first is not None else wall, 0.0, 0.0, 0.0)


def voice_rows(client: httpx.Client, saved: str, reps: int) -> dict[str, Any]:
    """First audio at 1 client: the built-in default speaker and the saved voice, alternately, `reps` each. Each
    request hangs up at its first audio (the rest of a prompted request takes minutes here and is not measured)."""
    runs: dict[str, list[Run]] = {"built-in speaker": [], "saved voice": []}
    stream_request(client, 10**6 + 1, saved, first_only=True)  # warm-up of the prompted shapes
    for i in range(reps):
        time.sleep(1.0)  # the previous request's cancelled job stops
        runs["built-in speaker"].append(stream_request(client, 2 * 10**6 + i, first_only=True))
        time.sleep(1.0)
        runs["saved voice"].append(stream_request(client, 3 * 10**6 + i, saved, first_only=True))
    return {label: load_summary(1, r, sum(x.wall_s for x in r)) for label, r in runs.items()}


def load(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-voices-") as voices_dir:
        saved = write_saved_voice(args.bundle, Path(voices_dir), args.voice_seconds) if args.voice_seconds else None
        return _load(args, {"TTS_VOICES_DIR": voices_dir}, saved)


@contextmanager
def served(args: argparse.Namespace, env: dict[str, str]) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A `serve` process of this script on a free port (settings `env` plus `args.env`), ready; stopped on exit."""
    port = free_port()
    extra = dict(kv.split("=", 1) for kv in args.env)
    cmd = [sys.executable, str(Path(__file__).resolve()), "serve", str(args.bundle)]
    cmd += ["--port", str(port), "--tokens", str(args.tokens)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=server_env(args.n_timesteps, env | extra))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _load(args: argparse.Namespace, env: dict[str, str], saved: str | None) -> dict[str, Any]:
    extra = dict(kv.split("=", 1) for kv in args.env)
    with served(args, env) as (url, proc):
        rss_ready = peak_rss_mb(proc.pid)
        levels = []
        with httpx.Client(base_url=url, timeout=httpx.Timeout(600.0)) as client:
            rate = pcm_bytes_per_s(args.bundle)
            stream_request(client, 10**6, bytes_per_s=rate)  # warm-up
            for n in args.levels:
                # a seed no other request used: the audio cache (on, as by default) must not answer for the engine
                runs, wall = closed_loop(
                    n, args.per_client, lambda seed, n=n: stream_request(client, 1000 * n + seed, bytes_per_s=rate)
                )
                levels.append(load_summary(n, runs, wall))
                print(json.dumps(levels[-1]), file=sys.stderr, flush=True)
            peak_rss = peak_rss_mb(proc.pid)  # under the 1-8 streams of the built-in speaker
            voices = voice_rows(client, saved, args.voice_reps) if saved else {}
        result = {"levels": levels, "server_rss_ready_mb": rss_ready, "server_peak_rss_mb": peak_rss, "env": extra}
        return result | ({"voices": voices, "voice_prompt_s": args.voice_seconds} if voices else {})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["serve", "load"])
    p.add_argument("bundle", type=Path)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tokens", type=int, default=SHORT_TOKENS)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--per-client", type=int, default=2)
    p.add_argument("--n-timesteps", type=int)
    p.add_argument("--env", nargs="*", default=[], help="extra TTS_*=value settings for the server")
    p.add_argument("--voice-seconds", type=float, default=10.0, help="saved-voice prompt length (0: no voice rows)")
    p.add_argument("--voice-reps", type=int, default=3, help="1-client requests per voice in the voice rows")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode == "serve":
        serve(args)
        return 0
    result = load(args) | {"bundle": str(args.bundle), "tokens": args.tokens, "n_timesteps": args.n_timesteps}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
