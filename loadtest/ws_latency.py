"""First audio over the WebSocket (text arriving in LLM-paced deltas) against one HTTP request with the same
sentence, same server, same run: a real server process on the full-size bundle, the default settings.

    python loadtest/ws_latency.py models/full-random-int8 --reps 3

The sentence completes after N deltas (`--piece-chars` characters every `--delay-s`); the text after it keeps
coming without a sentence end, as an LLM's reply would. Reported: WebSocket first audio measured from the delta that
completed the sentence and from the first delta, and HTTP first audio from the request; medians and min-max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.bench_engine import SHORT_TEXT, SHORT_TOKENS
from loadtest.bench_http import REPO, free_port, peak_rss_mb, server_env, wait_ready

CONTINUATION = "然后我们可以在湖边坐一会儿"  # more text, no sentence end yet


def http_first_audio(url: str, seed: int) -> float:
    t0 = time.perf_counter()
    body = {"text": SHORT_TEXT, "stream": True, "format": "pcm", "seed": seed}
    with httpx.stream("POST", url + "/tts", json=body, timeout=600) as r:
        r.raise_for_status()
        for piece in r.iter_bytes():
            if piece:
                return time.perf_counter() - t0
    raise RuntimeError("no audio")


def ws_first_audio(url: str, seed: int, piece_chars: int, delay_s: float) -> dict[str, float]:
    """Seconds to the first audio frame from the first delta and from the delta that completed the sentence."""
    ws_url = url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with connect(ws_url, open_timeout=60, max_size=None) as ws:
        ws.send(json.dumps({"type": "config", "format": "pcm", "seed": seed}))
        assert json.loads(ws.recv(timeout=600))["type"] == "ready"
        first: list[float] = []

        def read() -> None:
            while not first:
                if isinstance(ws.recv(timeout=600), bytes):
                    first.append(time.perf_counter())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        text = SHORT_TEXT + CONTINUATION
        sentence_end = len(SHORT_TEXT)
        t_first = t_complete = None
        for i in range(0, len(text), piece_chars):
            ws.send(json.dumps({"type": "text", "text": text[i : i + piece_chars]}))
            now = time.perf_counter()
            t_first = t_first or now
            if t_complete is None and i + piece_chars > sentence_end:  # this delta shows the sentence has ended
                t_complete = now
            if first:
                break
            time.sleep(delay_s)
        reader.join(600)
    assert first and t_first is not None and t_complete is not None
    deltas = -(-(sentence_end + 1) // piece_chars)
    return {"from_complete_s": first[0] - t_complete, "from_first_delta_s": first[0] - t_first, "deltas": deltas}


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=SHORT_TOKENS)
    p.add_argument("--piece-chars", type=int, default=4)
    p.add_argument("--delay-s", type=float, default=0.03)
    args = p.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "loadtest/bench_http.py", "serve", str(args.bundle), "--port", str(port), "--tokens", str(args.tokens)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=server_env(None, {}))
    try:
        wait_ready(url, proc)
        http_first_audio(url, 10**6)  # warm-up
        http, ws = [], []
        for i in range(args.reps):  # alternate, so drift of the shared host hits both alike
            http.append(http_first_audio(url, 2 * 10**6 + i))
            time.sleep(1.0)
            ws.append(ws_first_audio(url, 3 * 10**6 + i, args.piece_chars, args.delay_s))
            time.sleep(3.0)  # the closed connection's jobs are cancelled before the next request
        result: dict[str, Any] = {
            "bundle": str(args.bundle),
            "sentence": SHORT_TEXT,
            "deltas_to_complete": ws[0]["deltas"],
            "piece_chars": args.piece_chars,
            "delay_s": args.delay_s,
            "http_first_audio_s": _stats(http),
            "ws_first_audio_from_complete_s": _stats([w["from_complete_s"] for w in ws]),
            "ws_first_audio_from_first_delta_s": _stats([w["from_first_delta_s"] for w in ws]),
            "server_peak_rss_mb": peak_rss_mb(proc.pid),
        }
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(json.dumps(result, ensure_ascii=False))  # one line: loadtest/bench.py reads the last line
    return 0


if __name__ == "__main__":
    sys.exit(main())
