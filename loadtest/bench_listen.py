"""Listener benchmark over HTTP: first audio, time to continuous audio (TTCA) and stall per voice and client count.

One server process (`bench_http.py serve`: default settings, every sentence forced to `--tokens` speech tokens, by
default 5 s: 250 for v1, 125 for CosyVoice2) with two saved voices written to its voice directory (3 s and 10 s
recordings). For each voice (the built-in default speaker, then the saved ones) and each client count (1, 2, 4), that
many clients send
`--per-client` streamed `POST /tts` pcm requests back to back; every piece's arrival time and size is recorded
and turned into what a player hears (loadtest/listener.py). Prints one JSON line: p50 and max per row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.bench_engine import SHORT_TEXT, closed_loop
from loadtest.bench_http import pcm_bytes_per_s, peak_rss_mb, served, write_saved_voice
from loadtest.listener import Listening, listen, pcm_pieces

BUILTIN = "built-in speaker"
SENTENCE_S = 5.0  # forced speech per request: 250 tokens for v1 (50 Hz), 125 for CosyVoice2 (25 Hz)


REFUSED = "refused"  # a 503 with Retry-After: the server's admission said no (not a failure)


def stream_listen(client: httpx.Client, seed: int, speaker: str | None, bytes_per_s: float) -> Listening | str | None:
    """One streamed /tts pcm request, read to the end; REFUSED for a 503 with Retry-After, None when it failed."""
    body: dict[str, Any] = {"text": SHORT_TEXT, "stream": True, "format": "pcm", "seed": seed}
    if speaker:
        body["speaker"] = speaker
    arrivals: list[tuple[float, int]] = []
    t0 = time.perf_counter()
    try:
        with client.stream("POST", "/tts", json=body) as resp:
            if resp.status_code == 503 and "retry-after" in resp.headers:
                resp.read()
                return REFUSED
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:200]!r}")
            for piece in resp.iter_raw():
                arrivals.append((time.perf_counter() - t0, len(piece)))
        return listen(pcm_pieces(arrivals, bytes_per_s))
    except Exception as e:  # counted as a failure; the benchmark goes on
        print(f"request failed: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def tokens_heard(listening: Listening, token_rate_hz: int) -> int:
    """The speech tokens a request's audio carries (its seconds at the model's token rate, rounded)."""
    return round(listening.audio_s * token_rate_hz)


def row(
    label: str, clients: int, heard: list[Listening | str | None], wall_s: float, forced: tuple[int, int] | None = None
) -> dict[str, Any]:
    """p50 and max of first audio, TTCA and stall over the requests of one (voice, clients) row. With `forced`
    (tokens, token rate), the requests whose audio did not carry exactly that many tokens are counted as `short`: a
    forced length that was not honoured (the row is then not a measurement of that length)."""
    ok = [h for h in heard if isinstance(h, Listening)]
    refused = sum(1 for h in heard if h == REFUSED)
    out: dict[str, Any] = {"voice": label, "clients": clients, "requests": len(heard), "refused": refused}
    out["failures"] = len(heard) - len(ok) - refused  # neither audio nor a 503 with Retry-After
    if forced is not None:
        tokens, rate = forced
        out["tokens_heard"] = sorted({tokens_heard(h, rate) for h in ok})
        out["short"] = sum(1 for h in ok if abs(tokens_heard(h, rate) - tokens) > 1)
    for name in ("first_audio_s", "ttca_s", "stall_s", "rtf"):
        values = [getattr(h, name) for h in ok]
        out[f"{name}_p50"] = statistics.median(values) if values else float("nan")
        out[f"{name}_max"] = max(values) if values else float("nan")
    stalls = sorted(h.stall_s for h in ok)
    out["stall_s_p95"] = stalls[min(len(stalls) - 1, math.ceil(0.95 * len(stalls)) - 1)] if stalls else float("nan")
    out["audio_per_wall"] = sum(h.audio_s for h in ok) / wall_s if wall_s else 0.0
    out["runs"] = [asdict(h) for h in ok]
    return out


def reset_peak_rss(pid: int | None) -> None:
    """Restart the server's peak resident size (VmHWM) so the next reading is one row's peak (Linux clear_refs 5)."""
    if pid is None:
        return
    with contextlib.suppress(OSError):  # another user's process or no procfs: the row reports the peak so far
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def measure(
    client: httpx.Client,
    voices: dict[str, str | None],
    levels: list[int],
    per_client: int,
    bytes_per_s: float,
    one_client: int | None = None,
    forced: tuple[int, int] | None = None,
    server_pid: int | None = None,
) -> list[dict[str, Any]]:
    """Every (voice, clients) row; `one_client` requests (default `per_client`) at one client, where the issue's
    targets are read (their p50 rests on these). With `server_pid`, each row carries the server's peak RSS during it."""
    rows = []
    for v, (label, speaker) in enumerate(voices.items()):
        stream_listen(client, 10**6 + v, speaker, bytes_per_s)  # warm-up of this voice's shapes (not counted)
        for n in levels:
            base = 10**4 * (v + 1) + 100 * n  # seeds no other request used: the audio cache must not answer

            def request(i: int, base: int = base, speaker: str | None = speaker) -> Listening | str | None:
                return stream_listen(client, base + i, speaker, bytes_per_s)

            reset_peak_rss(server_pid)
            heard, wall = closed_loop(n, (one_client or per_client) if n == 1 else per_client, request)
            rows.append(row(label, n, heard, wall, forced))
            if server_pid is not None:
                rows[-1]["peak_rss_mb"] = peak_rss_mb(server_pid)
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "runs"}), file=sys.stderr, flush=True)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-listen-voices-") as voices_dir:
        voices: dict[str, str | None] = {BUILTIN: None}
        for seconds in args.prompt_seconds:
            voices[f"saved voice, {seconds:g} s recording"] = write_saved_voice(args.bundle, Path(voices_dir), seconds)
        rate = pcm_bytes_per_s(args.bundle)
        levels, per_client, one = args.levels, args.per_client, args.one_client_requests
        forced = (args.tokens, token_rate_hz(args.bundle))
        return serve_and(
            args,
            {"TTS_VOICES_DIR": voices_dir},
            lambda client, pid: measure(client, voices, levels, per_client, rate, one, forced, pid),
        )


def token_rate_hz(bundle: Path) -> int:
    from service.bundle import ModelBundle

    return ModelBundle.load(bundle).constants.token_rate_hz


def serve_and(
    args: argparse.Namespace, env: dict[str, str], work: Callable[[httpx.Client, int], list[dict[str, Any]]]
) -> dict[str, Any]:
    with served(args, env) as (url, proc), httpx.Client(base_url=url, timeout=httpx.Timeout(900.0)) as client:
        peak_before_rows = peak_rss_mb(proc.pid)  # loading and warm-up: the rows reset the peak, so read it first
        rows = work(client, proc.pid)
        extra = dict(kv.split("=", 1) for kv in args.env)
        peak = max([peak_before_rows, *(r.get("peak_rss_mb", 0.0) for r in rows)])
        return {"rows": rows, "server_peak_rss_mb": peak, "env": extra, "tokens": args.tokens}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--tokens", type=int, help="speech tokens per request (default: 5 s of audio at the model's token rate)")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--per-client", type=int, default=3)
    p.add_argument("--one-client-requests", type=int, help="requests of the one-client rows (default: --per-client)")
    p.add_argument("--prompt-seconds", type=float, nargs="*", default=[3.0, 10.0], help="saved voices' recording lengths")
    p.add_argument("--n-timesteps", type=int)
    p.add_argument("--env", nargs="*", default=[], help="extra TTS_*=value settings for the server")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tokens is None:
        args.tokens = round(SENTENCE_S * token_rate_hz(args.bundle))
    result = run(args) | {"bundle": str(args.bundle)}
    print(json.dumps(result))
    short = [f"{r['voice']} x{r['clients']}: {r['short']} of {r['requests']}" for r in result["rows"] if r.get("short")]
    if short:
        print(f"forced length {args.tokens} not honoured (rows not measured): {'; '.join(short)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
