"""Benchmark the engine in-process: single-stream RTF and stage times, first-chunk latency, concurrent streams.

Random-init weights never emit EOS, so every request is forced to a fixed number of speech tokens
(`ForcedLength`). Each mode prints one JSON object; `loadtest/bench.py` runs every mode in its own process
so that peak RSS is per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.listener import listen
from service.bundle import ModelBundle, ModelConstants
from service.engine.options import RuntimeOptions
from service.engine.types import SynthesisOptions, TokenGenerator
from service.families.cosyvoice1.contract import TOKENIZER_NAME
from service.families.cosyvoice1.engine import Synthesizer
from service.families.cosyvoice1.voice import Voice
from service.families.registry import family
from service.frontend import TextFrontend
from service.levers import EngineProfile
from service.settings import Settings

# One normalized sentence of ordinary Chinese text (48 text tokens), for the 250-token single-stream runs.
LONG_TEXT = "2024年3月15日，我们在北京发布了新版本，售价99.5元，支持一百种语言。"
# ~15 characters (18 text tokens): latency and concurrency runs, forced to SHORT_TOKENS (4.0 s of speech,
# about what a speaker needs for 18 Chinese characters).
SHORT_TEXT = "今天天气很好，我们一起去公园散步吧。"
SHORT_TOKENS = 200
SPEAKER_INDEX = 0


def one_request_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every one-request tool takes (loadtest/timeline.py, profile_stages.py): the bundle, `--tokens`
    (each sentence forced to that many speech tokens; default 5 s of audio, `sentence_tokens`), `--env` and `--json`."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("bundle", type=Path)
    p.add_argument("--tokens", type=int, help="speech tokens per sentence (default: 5 s of audio)")
    p.add_argument("--env", nargs="*", default=[], help="TTS_*=value settings, as the server reads them")
    p.add_argument("--json", type=Path)
    return p


def sentence_tokens(bundle: ModelBundle, tokens: int | None, seconds: float = 5.0) -> int:
    """`tokens`, or `seconds` of audio at the bundle's token rate (the sentence loadtest/bench_listen.py forces)."""
    return tokens or round(seconds * bundle.constants.token_rate_hz)


def apply_env(items: Sequence[str]) -> None:
    """Put `TTS_*=value` items into this process's environment, where the service's settings read them."""
    for item in items:
        key, _, value = item.partition("=")
        os.environ[key] = value


def forced_engines(tokens: int) -> Callable[[ModelBundle, RuntimeOptions], object]:
    """An engine loader (ModelContext.engine_loader) for any family whose engines speak every sentence in exactly
    `tokens` speech tokens (ForcedLength: random weights never stop by themselves)."""

    def load(bundle: ModelBundle, options: RuntimeOptions) -> object:
        engine = family(bundle.family).load_engine(bundle, options)
        engine.llm = ForcedLength(engine.llm, tokens)  # type: ignore[attr-defined]  # the same generate() signature
        return engine

    return load


class ForcedLength:
    """Wraps a TokenGenerator so every sentence yields exactly `n` sampled tokens (EOS masked until then)."""

    def __init__(self, inner: TokenGenerator, n: int) -> None:
        self.inner, self.n = inner, n

    def generate(
        self,
        text_ids: Sequence[int],
        embedding: np.ndarray,
        rng: np.random.Generator,
        *,
        min_tokens: int | None = None,
        max_tokens: int | None = None,
        cancel: threading.Event | None = None,
        urgent_tokens: int = 0,
    ) -> Iterator[int]:
        n = self.n
        return self.inner.generate(
            text_ids, embedding, rng, min_tokens=n, max_tokens=n, cancel=cancel, urgent_tokens=urgent_tokens
        )


def peak_rss_mb() -> float:
    """Peak resident set size of this process (VmHWM), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def runtime_options(args: argparse.Namespace) -> RuntimeOptions:
    return RuntimeOptions(
        intra_op_threads=args.threads,
        llm_threads=args.llm_threads,
        acoustic_threads=args.acoustic_threads,
        max_batch=args.max_batch,
        acoustic_slots=args.acoustic_slots,
        acoustic_nice=args.acoustic_nice,
        allow_spinning=args.spinning,
        first_audio_priority=not args.no_first_audio_priority,
        acoustic_backend=args.acoustic_backend,
        native_kernels=args.native_kernels,
        stream_schedule=args.stream_schedule,
        prompt_window_s=None if args.prompt_window_s < 0 else args.prompt_window_s,
        compiled_cache_dir=args.cache_dir,
    )


def load(bundle_dir: Path, runtime: RuntimeOptions, tokens: int) -> tuple[Synthesizer, TextFrontend]:
    synth = Synthesizer.load(bundle_dir, runtime)
    synth.llm = ForcedLength(synth.llm, tokens)
    return synth, TextFrontend.load(ModelBundle.load(bundle_dir).file(TOKENIZER_NAME))


def text_ids(frontend: TextFrontend, text: str) -> list[int]:
    return [i for s in frontend.sentences(text) for i in s.ids]


@dataclass
class Run:
    """One request: wall seconds, audio seconds, first-chunk latency and the stage seconds it reported."""

    wall_s: float
    audio_s: float
    first_chunk_s: float
    llm_s: float
    flow_s: float
    hift_s: float
    failed: bool = False

    @property
    def rtf(self) -> float:
        return self.wall_s / self.audio_s if self.audio_s else float("inf")


PROMPT_TEXT = "希望你以后能够做的比我还好呦，今天的会议很重要，请准时参加。"  # a 10 s prompt's transcript, roughly


def cloned_voice(synth: Synthesizer, frontend: TextFrontend, seconds: float, seed: int = 7) -> Voice:
    """A zero-shot voice as a `seconds`-long prompt analysis gives it: 50 speech tokens and 86.13 mel frames per
    second, a transcript, and an x-vector (the full-size bundle has random weights and no prompt models, so
    the features are drawn at random with the real sizes: what costs time is their length, not their values)."""
    tokens, mel = random_prompt(synth.bundle.constants, seconds, seed)
    embedding = synth.bundle.speakers[synth.speakers[SPEAKER_INDEX]]
    return Voice.cloned(
        f"cloned-{seconds:g}s", embedding, tuple(int(t) for t in tokens), mel, tuple(text_ids(frontend, PROMPT_TEXT))
    )


def random_prompt(c: ModelConstants, seconds: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Speech tokens (int32) and mel frames (T, n_mels float32) of a `seconds`-long prompt, drawn at random with
    the real sizes: 50 tokens and 86.13 frames per second (the cost of a prompt is its length, not its values)."""
    g = np.random.default_rng(seed)
    tokens = g.integers(0, c.speech_token_size, size=int(seconds * c.token_rate_hz)).astype(np.int32)
    mel = g.standard_normal((int(seconds * c.sample_rate / c.mel_hop_samples), c.n_mels)).astype(np.float32) - 5.0
    return tokens, mel


VOICE: Voice | None = None  # set by main(): None = the first built-in speaker


def run_once(synth: Synthesizer, ids: list[int], options: SynthesisOptions, start: float | None = None) -> Run:
    """One request through the engine (the caller's thread pulls the chunks, as a service worker does)."""
    t0 = time.perf_counter() if start is None else start
    first = None
    llm = flow = hift = 0.0
    samples = 0
    try:
        for chunk in synth.synthesize([ids], VOICE or synth.speakers[SPEAKER_INDEX], options):
            if first is None and chunk.audio.size:
                first = time.perf_counter() - t0
            llm, flow, hift = llm + chunk.timings.llm_s, flow + chunk.timings.flow_s, hift + chunk.timings.hift_s
            samples += chunk.audio.size
    except Exception as e:  # counted as a failure, the benchmark goes on
        print(f"request failed: {type(e).__name__}: {e}", file=sys.stderr)
        return Run(time.perf_counter() - t0, 0.0, float("nan"), llm, flow, hift, failed=True)
    wall = time.perf_counter() - t0
    return Run(wall, samples / synth.sample_rate, first if first is not None else wall, llm, flow, hift)


def summarize(runs: list[Run]) -> dict[str, Any]:
    """Median and min/max of every field, plus RTF."""
    rows = [asdict(r) | {"rtf": r.rtf} for r in runs if not r.failed]
    keys = [k for k in rows[0] if k != "failed"] if rows else []
    return {
        "median": {k: statistics.median(r[k] for r in rows) for k in keys},
        "min_max": {k: [min(r[k] for r in rows), max(r[k] for r in rows)] for k in keys},
        "runs": rows,
        "failures": sum(r.failed for r in runs),
    }


def mode_single(synth: Synthesizer, ids: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Non-streamed requests one after another: RTF and per-stage seconds."""
    options = SynthesisOptions(seed=0, n_timesteps=args.n_timesteps)
    run_once(synth, ids[:8], SynthesisOptions(seed=0, n_timesteps=1))  # warm-up: arena, prepacking, position table
    return summarize([run_once(synth, ids, options) for _ in range(args.reps)])


def mode_latency(synth: Synthesizer, ids: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Streamed requests one after another at concurrency 1: first-chunk latency."""
    options = SynthesisOptions(seed=0, stream=True, n_timesteps=args.n_timesteps, first_hop_tokens=args.first_hop)
    run_once(synth, ids, SynthesisOptions(seed=0, stream=True, n_timesteps=1))
    return summarize([run_once(synth, ids, options) for _ in range(args.reps)])


def closed_loop(n_clients: int, per_client: int, request: Any) -> tuple[list[Run], float]:
    """`n_clients` threads each send `per_client` requests back to back; returns the runs and the wall seconds."""
    runs: list[Run] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for i in range(per_client):
            r = request(k * per_client + i)
            with lock:
                runs.append(r)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(n_clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return runs, time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def load_summary(n_clients: int, runs: list[Run], wall: float) -> dict[str, Any]:
    """First-chunk p50/p95, aggregate audio seconds per wall second and failures of one concurrency level."""
    ok = [r for r in runs if not r.failed]
    firsts = [r.first_chunk_s for r in ok]
    return {
        "clients": n_clients,
        "requests": len(runs),
        "failures": len(runs) - len(ok),
        "wall_s": wall,
        "audio_s": sum(r.audio_s for r in ok),
        "audio_per_wall": sum(r.audio_s for r in ok) / wall,
        "first_chunk_p50_s": percentile(firsts, 50),
        "first_chunk_p95_s": percentile(firsts, 95),
        "rtf_p50": percentile([r.rtf for r in ok], 50),
    }


def mode_concurrency(synth: Synthesizer, ids: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Streamed requests from 1, 2, 4, 8 closed-loop clients (each in its own thread, like service workers)."""
    run_once(synth, ids, SynthesisOptions(seed=0, stream=True, n_timesteps=1))
    levels = []
    for n in args.levels:

        def request(seed: int) -> Run:
            opts = SynthesisOptions(seed=seed, stream=True, n_timesteps=args.n_timesteps, first_hop_tokens=args.first_hop)
            return run_once(synth, ids, opts)

        runs, wall = closed_loop(n, args.per_client, request)
        levels.append(load_summary(n, runs, wall))
        print(json.dumps(levels[-1]), file=sys.stderr, flush=True)
    return {"levels": levels}


def mode_listen(synth: Synthesizer, ids: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Streamed requests one after another, each read to the end as a player would: first audio, time to continuous
    audio (TTCA) and stall seconds per request (loadtest/listener.py), with each chunk's arrival and length."""
    options = SynthesisOptions(seed=0, stream=True, n_timesteps=args.n_timesteps, first_hop_tokens=args.first_hop)
    list(synth.synthesize([ids], VOICE or synth.speakers[SPEAKER_INDEX], SynthesisOptions(seed=0, stream=True)))  # warm-up
    runs = []
    for rep in range(args.reps):
        t0 = time.perf_counter()
        pieces = []
        voice = VOICE or synth.speakers[SPEAKER_INDEX]
        for chunk in synth.synthesize([ids], voice, SynthesisOptions(**{**asdict(options), "seed": rep})):
            pieces.append((time.perf_counter() - t0, chunk.seconds, chunk.speech_tokens))
        heard = listen([(t, a) for t, a, _ in pieces])
        runs.append(asdict(heard) | {"rtf": heard.rtf, "chunks": [[round(t, 3), round(a, 3), n] for t, a, n in pieces]})
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "chunks"}), file=sys.stderr, flush=True)
    keys = ("first_audio_s", "ttca_s", "stall_s", "rtf")
    return {"median": {k: statistics.median(r[k] for r in runs) for k in keys}, "runs": runs}


MODES = {"single": mode_single, "latency": mode_latency, "concurrency": mode_concurrency, "listen": mode_listen}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=sorted(MODES))
    p.add_argument("bundle", type=Path)
    p.add_argument("--text", choices=["long", "short"], default="long")
    p.add_argument("--tokens", type=int, default=250, help="speech tokens forced per request")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--n-timesteps", type=int)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--per-client", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llm-threads", type=int)
    p.add_argument("--acoustic-threads", type=int)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--acoustic-slots", type=int, default=1)
    p.add_argument("--acoustic-nice", type=int, default=0)
    p.add_argument("--spinning", action="store_true")
    p.add_argument("--no-first-audio-priority", action="store_true")
    p.add_argument("--first-hop", type=int, help="first streaming hop in tokens (engine default when omitted)")
    # the service's defaults: the benchmark measures what users get (the engine's levers live in its profile)
    defaults = {**Settings.model_fields, **EngineProfile.model_fields}
    p.add_argument("--acoustic-backend", choices=["auto", "ort", "openvino"], default=defaults["acoustic_backend"].default)
    p.add_argument("--native-kernels", choices=["auto", "off"], default=defaults["native_kernels"].default)
    p.add_argument("--stream-schedule", choices=["adaptive", "official"], default=defaults["stream_schedule"].default)
    p.add_argument(
        "--prompt-window-s", type=float, default=defaults["prompt_window_s"].default, help="flow prompt window (-1: all)"
    )
    p.add_argument("--prompt-seconds", type=float, default=0.0, help="speak in a cloned voice with a prompt this long")
    cache = defaults["cache_dir"].default
    p.add_argument(
        "--cache-dir", type=Path, default=cache.expanduser() if cache else None, help="OpenVINO model cache (as TTS_CACHE_DIR)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    synth, frontend = load(args.bundle, runtime_options(args), args.tokens)
    load_s = time.perf_counter() - t0
    rss_loaded = peak_rss_mb()
    ids = text_ids(frontend, LONG_TEXT if args.text == "long" else SHORT_TEXT)
    global VOICE
    VOICE = cloned_voice(synth, frontend, args.prompt_seconds) if args.prompt_seconds > 0 else None
    try:
        result = MODES[args.mode](synth, ids, args)
    finally:
        synth.close()
    manifest = ModelBundle.load(args.bundle).manifest
    result |= {
        "mode": args.mode,
        "bundle": str(args.bundle),
        "precision": manifest.precision,
        "tokens": args.tokens,
        "text_tokens": len(ids),
        "n_timesteps": args.n_timesteps or manifest.constants.n_timesteps,
        "first_chunk_tokens": (args.first_hop or synth.first_hop_tokens) + manifest.constants.token_overlap_len,
        "runtime": asdict(runtime_options(args)),
        "voice": VOICE.kind if VOICE is not None else "sft",
        "prompt_seconds": args.prompt_seconds,
        "load_s": load_s,
        "rss_after_load_mb": rss_loaded,
        "peak_rss_mb": peak_rss_mb(),
    }
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
