"""Benchmark the CosyVoice2 engine in-process: what a listener hears (first audio, TTCA, stall) and where time goes.

Random-init weights never emit EOS, so every sentence is forced to `--tokens` speech tokens (125 = 5 s at 25 Hz).
Voices are saved (cloned) voices as a prompt analysis gives them, drawn at random with the real sizes: a recording
of S seconds is 25 S speech tokens and 50 S mel frames, a transcript and an x-vector (what costs time is their length,
not their values). Modes, each printing one JSON object:
  listen       streamed requests one after another per voice: first audio, TTCA, stall, chunk arrivals
  concurrency  1, 2, 4 closed-loop clients (threads, like service workers): audio seconds per wall second, listener p50s
  stages       every graph call timed (per graph: calls, seconds, median ms, by input shape) over one streamed request
               per voice, then 4 clients at once (the decode step at batch 1 and 4)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.bench_engine import SHORT_TEXT, ForcedLength, closed_loop, peak_rss_mb
from loadtest.listener import Listening, listen
from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.engine.types import SynthesisOptions
from service.families.cosyvoice2.assembly import one_thread_calls, open_engine_sessions, stream_schedule
from service.families.cosyvoice2.contract import TOKENIZER_NAME
from service.families.cosyvoice2.engine import CosyVoice2Engine
from service.families.cosyvoice2.voice import Voice2
from service.layers.qwen_tokenizer import Qwen2Tokenizer
from service.settings import Settings

TOKENS_5S = 125  # speech tokens of a 5 s sentence at 25 Hz
PROMPT_TEXT = "希望你以后能够做的比我还好呦，今天的会议很重要，请准时参加。"  # a recording's transcript


def saved_voice(bundle: ModelBundle, tokenizer: Qwen2Tokenizer, seconds: float, seed: int = 7) -> Voice2:
    """A zero-shot voice from a `seconds`-long recording: 25 tokens and 50 mel frames per second, drawn at random."""
    c = bundle.constants
    g = np.random.default_rng(seed)
    n = round(seconds * c.token_rate_hz)
    tokens = tuple(int(t) for t in g.integers(0, c.speech_token_size, n))
    mel = g.standard_normal((2 * n, c.n_mels), dtype=np.float32) - 5.0
    embedding = next(iter(bundle.speakers.values()))
    return Voice2.cloned(f"saved-{seconds:g}s", embedding, tokens, mel, tuple(tokenizer.encode(PROMPT_TEXT)))


class TimedSession:
    """An ORT-like session that records (seconds, leading input shape) of every `run` under its graph name."""

    def __init__(self, name: str, inner: Any, log: dict[str, list[tuple[float, tuple[int, ...]]]]) -> None:
        self.name, self.inner, self.log = name, inner, log
        self._lock = threading.Lock()

    def run(self, output_names: list[str] | None, feeds: Mapping[str, np.ndarray]) -> Any:
        t0 = time.perf_counter()
        out = self.inner.run(output_names, feeds)
        shape = tuple(next(iter(feeds.values())).shape)
        with self._lock:
            self.log[self.name].append((time.perf_counter() - t0, shape))
        return out

    def __getattr__(self, name: str) -> Any:  # get_inputs() etc. of the wrapped session
        return getattr(self.inner, name)


def load(args: argparse.Namespace, log: dict[str, list[tuple[float, tuple[int, ...]]]] | None = None) -> CosyVoice2Engine:
    bundle = ModelBundle.load(args.bundle)
    runtime = one_thread_calls(runtime_options(args))  # as CosyVoice2Engine.load
    lanes = runtime.threads_for("acoustic") == 1 and not args.no_cfg_lanes  # as CosyVoice2Engine.load
    sessions: dict[str, Any] = open_engine_sessions(bundle, runtime, wide=lanes and not args.no_wide_vocoder)
    if log is not None:
        sessions = {name: TimedSession(name, s, log) for name, s in sessions.items()}
    schedule = stream_schedule(bundle, runtime)
    if args.hop_scale:
        schedule = replace(schedule, scale=args.hop_scale)
    engine = CosyVoice2Engine.from_sessions(bundle, sessions, runtime, cfg_lanes=lanes, schedule=schedule)
    engine.llm = ForcedLength(engine.llm, args.tokens)  # type: ignore[arg-type]  # same generate() signature
    return engine


def runtime_options(args: argparse.Namespace) -> RuntimeOptions:
    return RuntimeOptions(
        intra_op_threads=args.threads,
        llm_threads=args.llm_threads,
        acoustic_threads=args.acoustic_threads,
        max_batch=args.max_batch,
        acoustic_slots=args.acoustic_slots,
        acoustic_nice=args.acoustic_nice,
        first_audio_priority=not args.no_first_audio_priority,
        decode_lead_tokens=args.decode_lead,
        acoustic_backend=args.acoustic_backend,
        native_kernels=args.native_kernels,
        stream_schedule=args.stream_schedule,
        first_hop_tokens=args.first_hop,
        prompt_window_s=None if args.prompt_window_s < 0 else args.prompt_window_s,
        flow_cache_mb=args.flow_cache_mb,
        compiled_cache_dir=args.cache_dir,
    )


def heard(
    engine: CosyVoice2Engine, ids: list[int], voice: Voice2, seed: int, steps: int | None = None
) -> tuple[Listening, list[list[float]]]:
    """One streamed request read to the end as a player would: the listener's figures and (arrival, seconds, tokens).
    `steps`: the flow's Euler steps (None: the bundle's, as the service's default)."""
    t0 = time.perf_counter()
    pieces = []
    for chunk in engine.synthesize([ids], voice, SynthesisOptions(seed=seed, stream=True, n_timesteps=steps)):
        pieces.append([round(time.perf_counter() - t0, 3), round(chunk.seconds, 3), chunk.speech_tokens])
    return listen([(t, a) for t, a, _ in pieces]), pieces


def summary(runs: list[Listening], wall_s: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": len(runs)}
    for name in ("first_audio_s", "ttca_s", "stall_s", "rtf"):
        values = [getattr(r, name) for r in runs]
        out[f"{name}_p50"] = statistics.median(values)
        out[f"{name}_max"] = max(values)
    if wall_s:
        out["audio_per_wall"] = sum(r.audio_s for r in runs) / wall_s
    return out


def mode_listen(engine: CosyVoice2Engine, ids: list[int], voices: dict[str, Voice2], args: argparse.Namespace) -> Any:
    rows = []
    for label, voice in voices.items():
        heard(engine, ids, voice, 10**6, args.n_timesteps)  # warm-up: this voice's shapes and its cached prompt state
        runs, pieces = [], []
        for rep in range(args.reps):
            h, p = heard(engine, ids, voice, rep, args.n_timesteps)
            runs.append(h)
            pieces.append(p)
            print(json.dumps({"voice": label} | asdict(h)), file=sys.stderr, flush=True)
        rows.append({"voice": label, "clients": 1} | summary(runs) | {"chunks": pieces})
    return {"rows": rows}


def mode_concurrency(engine: CosyVoice2Engine, ids: list[int], voices: dict[str, Voice2], args: argparse.Namespace) -> Any:
    rows, steps = [], args.n_timesteps
    for label, voice in voices.items():
        heard(engine, ids, voice, 10**6, steps)
        for n in args.levels:
            results, wall = closed_loop(n, args.per_client, lambda seed, v=voice: heard(engine, ids, v, 1000 + seed, steps)[0])
            rows.append({"voice": label, "clients": n} | summary(results, wall))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"rows": rows}


def graph_summary(log: dict[str, list[tuple[float, tuple[int, ...]]]]) -> dict[str, Any]:
    """Per graph: calls, total seconds, median ms; per leading input shape: calls and median ms."""
    out: dict[str, Any] = {}
    for name, calls in sorted(log.items()):
        shapes: dict[str, list[float]] = defaultdict(list)
        for seconds, shape in calls:
            shapes["x".join(map(str, shape))].append(seconds)
        out[name] = {
            "calls": len(calls),
            "total_s": round(sum(s for s, _ in calls), 3),
            "median_ms": round(1000 * statistics.median(s for s, _ in calls), 2),
            "by_shape": {k: [len(v), round(1000 * statistics.median(v), 2)] for k, v in sorted(shapes.items())[:12]},
        }
    return out


def mode_stages(args: argparse.Namespace, ids: list[int], voices: dict[str, Voice2]) -> Any:
    log: dict[str, list[tuple[float, tuple[int, ...]]]] = defaultdict(list)
    engine = load(args, log)
    try:
        out: dict[str, Any] = {}
        for label, voice in voices.items():
            heard(engine, ids, voice, 10**6, args.n_timesteps)
            log.clear()
            h, pieces = heard(engine, ids, voice, 0, args.n_timesteps)
            out[label] = {"heard": asdict(h), "chunks": pieces, "graphs": graph_summary(log)}
        log.clear()
        voice = list(voices.values())[-1]
        closed_loop(4, 1, lambda seed: heard(engine, ids, voice, 2000 + seed, args.n_timesteps)[0])
        out["4 clients"] = {"graphs": graph_summary(log)}
        return out
    finally:
        engine.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["listen", "concurrency", "stages"])
    p.add_argument("bundle", type=Path)
    p.add_argument("--tokens", type=int, default=TOKENS_5S, help="speech tokens forced per sentence (125 = 5 s)")
    p.add_argument("--prompt-seconds", type=float, nargs="+", default=[3.0, 10.0], help="saved voices' recording lengths")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--per-client", type=int, default=2)
    defaults = Settings.model_fields  # the service's defaults: the benchmark measures what users get
    p.add_argument("--threads", type=int, default=defaults["intra_op_threads"].default)
    p.add_argument("--llm-threads", type=int)
    p.add_argument("--acoustic-threads", type=int)
    p.add_argument("--max-batch", type=int, default=defaults["max_batch"].default)
    p.add_argument("--acoustic-slots", type=int, default=defaults["acoustic_slots"].default)
    p.add_argument("--acoustic-nice", type=int, default=defaults["acoustic_nice"].default, help="the engine lever acoustic_nice")
    p.add_argument("--no-first-audio-priority", action="store_true")
    p.add_argument(
        "--decode-lead", type=int, default=None, help="as the engine lever decode_lead_tokens (default: the schedule's)"
    )
    p.add_argument(
        "--n-timesteps", type=int, help="the flow's Euler steps (the bundle's 10 when omitted; the engine lever n_timesteps)"
    )
    p.add_argument("--no-cfg-lanes", action="store_true", help="never split the estimator's guidance rows")
    p.add_argument("--no-wide-vocoder", action="store_true", help="every vocoder call on one thread (no wide HiFT session)")
    p.add_argument("--first-hop", type=int, help="first streamed hop in tokens (the schedule's own when omitted)")
    p.add_argument("--hop-scale", type=int, help="growth of the later hops (the schedule's own when omitted)")
    p.add_argument("--acoustic-backend", choices=["auto", "ort", "openvino"], default=defaults["acoustic_backend"].default)
    p.add_argument("--native-kernels", choices=["auto", "off"], default=defaults["native_kernels"].default)
    p.add_argument("--stream-schedule", choices=["adaptive", "official"], default=defaults["stream_schedule"].default)
    p.add_argument("--flow-cache-mb", type=int, help="bound on streamed flow caches (auto when omitted, 0: none)")
    p.add_argument("--prompt-window-s", type=float, default=defaults["prompt_window_s"].default, help="-1: all")
    cache = defaults["cache_dir"].default
    p.add_argument("--cache-dir", type=Path, default=cache.expanduser() if cache else None, help="OpenVINO model cache")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bundle = ModelBundle.load(args.bundle)
    tokenizer = Qwen2Tokenizer.load(bundle.file(TOKENIZER_NAME))
    ids = tokenizer.encode(SHORT_TEXT)
    voices = {f"saved voice, {s:g} s recording": saved_voice(bundle, tokenizer, s) for s in args.prompt_seconds}
    t0 = time.perf_counter()
    if args.mode == "stages":
        result = mode_stages(args, ids, voices)
    else:
        engine = load(args)
        print(f"loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        try:
            result = (mode_listen if args.mode == "listen" else mode_concurrency)(engine, ids, voices, args)
        finally:
            engine.close()
    runtime = replace(one_thread_calls(runtime_options(args)), compiled_cache_dir=None)
    meta = {"mode": args.mode, "bundle": str(args.bundle), "precision": bundle.manifest.precision, "tokens": args.tokens}
    meta |= {"n_timesteps": args.n_timesteps or bundle.constants.n_timesteps}
    meta |= {"text_tokens": len(ids), "runtime": asdict(runtime), "peak_rss_mb": peak_rss_mb()}
    print(json.dumps(result | meta, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
