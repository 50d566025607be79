"""One streamed request as a timeline: every graph call (thread, start, duration), the chunks as the listener gets them,
first audio, time to continuous audio (TTCA), and the decode steps' pace, for a bundle of any family.

    python loadtest/timeline.py models/full-random-int8 [--voice 10] [--tokens 250] [--json out.json]
        [--env TTS_ENGINE_PROFILE=stream_schedule=official ...]

The bundle's family is loaded as the service loads it (its default settings, or the TTS_* settings named with
`--env`), the sentence forced to `--tokens` speech tokens (default: 5 s at the family's token rate), in the first
built-in speaker (`--voice builtin`, the default; the family's warm-up voice for a bundle without one) or a voice saved
from an N-second recording (`--voice N`, as loadtest/bench_listen.py saves it: random features of that length, the
first built-in speaker's x-vector). One request runs first and is left out
(prepacking, arenas, the engine's measured rates), then the measured one. In process, no HTTP: where a stream waits,
which call it waits for, and what runs beside it (docs/perf-log.md cites these timelines).

TTCA here is the earliest playback start from which no chunk arrives late: max over chunks of (arrival - audio offset),
from the request's start.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import service.engine.sessions as sessions_mod
from loadtest.bench_engine import SHORT_TEXT, apply_env, forced_engines, one_request_parser, sentence_tokens, text_ids
from loadtest.bench_http import write_saved_voice
from service.bundle import ModelBundle
from service.engine.types import SynthesisOptions
from service.families.model import ModelContext
from service.families.registry import load_model
from service.runtime import runtime_options
from service.settings import Settings
from service.stores.voices import DirectoryVoiceStore

BIN_S = 0.5  # the decode steps' pace is reported per bin of this many seconds
DECODE_GRAPH = "llm_step"


class Calls:
    """Every session.run of the sessions opened after `record()`: (graph, thread, start, seconds, first input shape)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.rows: list[tuple[str, str, float, float, tuple[int, ...]]] = []
        self._lock = threading.Lock()

    def restart(self) -> None:
        with self._lock:
            self.rows = []
            self.t0 = time.perf_counter()

    def add(self, graph: str, start: float, seconds: float, feeds: Any) -> None:
        shapes = [tuple(v.shape) for v in feeds.values() if hasattr(v, "shape") and len(v.shape) >= 2] if feeds else []
        with self._lock:
            self.rows.append((graph, threading.current_thread().name, start - self.t0, seconds, shapes[0] if shapes else ()))

    def record(self) -> None:
        """Make every session this process opens from now on report its calls here."""
        open_ = sessions_mod._open
        calls = self

        class Recorded:
            def __init__(self, session: Any, graph: str) -> None:
                self._session, self._graph = session, graph

            def __getattr__(self, name: str) -> Any:
                return getattr(self._session, name)

            def run(self, outputs: Any, feeds: Any, *args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                result = self._session.run(outputs, feeds, *args, **kwargs)
                calls.add(self._graph, start, time.perf_counter() - start, feeds)
                return result

        sessions_mod._open = lambda path, so: Recorded(open_(path, so), Path(path).stem)  # type: ignore[assignment]


def ttca(chunks: list[tuple[float, float, float]]) -> float:
    """The earliest playback start (from the request's start) at which every chunk (arrival, offset, seconds) is there
    when its audio is due."""
    return max((arrival - offset for arrival, offset, _ in chunks), default=0.0)


def decode_pace(rows: list[tuple[str, str, float, float, tuple[int, ...]]]) -> dict[str, Any]:
    """The decode calls (one row per step, prefill included): how many, their mean, and per BIN_S bin how many ran and
    how long they took (a bin with few steps is one in which the decode waited)."""
    steps = [(start, seconds) for graph, _, start, seconds, _ in rows if graph.startswith(DECODE_GRAPH)]
    if not steps:
        return {"steps": 0}
    bins: dict[int, list[float]] = defaultdict(list)
    for start, seconds in steps:
        bins[int(start / BIN_S)].append(seconds)
    return {
        "steps": len(steps),
        "mean_ms": 1000.0 * sum(s for _, s in steps) / len(steps),
        "first_s": steps[0][0],
        "last_end_s": steps[-1][0] + steps[-1][1],
        "bins": [
            {"from_s": k * BIN_S, "steps": len(v), "busy_ms": 1000.0 * sum(v), "mean_ms": 1000.0 * sum(v) / len(v)}
            for k, v in sorted(bins.items())
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = one_request_parser(__doc__.splitlines()[0])
    p.add_argument("--voice", default="builtin", help="builtin, or N: a voice saved from an N-second recording")
    args = p.parse_args(argv)
    apply_env(args.env)
    bundle = ModelBundle.load(args.bundle)
    tokens = sentence_tokens(bundle, args.tokens)
    calls = Calls()
    calls.record()
    runtime = runtime_options(Settings(_env_file=None, model_dir=args.bundle))  # type: ignore[call-arg]

    store, saved = None, None
    if args.voice != "builtin" and not bundle.speakers:
        p.error("--voice N saves a voice with a built-in speaker's x-vector; this bundle has no built-in speakers")
    if args.voice != "builtin":
        folder = Path(tempfile.mkdtemp(prefix="timeline-voices-"))
        saved = write_saved_voice(args.bundle, folder, float(args.voice))
        store = DirectoryVoiceStore(folder)
    context = ModelContext(options=runtime, engine_loader=forced_engines(tokens), prompt_analysis=False, voice_store=store)
    model = load_model(bundle, context)
    ids = text_ids(model.frontend, SHORT_TEXT)
    if saved is not None:
        voice = model.voices.resolve(saved)
    else:
        voice = model.voice(model.speakers[0]) if model.speakers else model.warmup_voice()
    result: dict[str, Any] = {}
    try:
        for seed in (0, 1):  # the first is left out: prepacking, arenas, the rates the engine measures
            calls.restart()
            cpu, chunks, audio, first = time.process_time(), [], 0.0, None
            for chunk in model.synthesize([ids], voice, SynthesisOptions(seed=seed, stream=True), threading.Event()):
                now = time.perf_counter() - calls.t0
                if first is None and chunk.audio.size:
                    first = now
                chunks.append((now, audio, chunk.seconds))
                audio += chunk.seconds
            wall = time.perf_counter() - calls.t0
            result = {
                "bundle": str(args.bundle), "family": bundle.family, "voice": args.voice, "tokens": tokens,
                "env": args.env, "first_audio_s": first or 0.0, "ttca_s": ttca(chunks), "wall_s": wall, "audio_s": audio,
                "cpu_s": time.process_time() - cpu,
                "chunks": [{"at_s": a, "offset_s": o, "seconds": s} for a, o, s in chunks],
                "decode": decode_pace(calls.rows),
                "calls": [
                    {"graph": g, "thread": th, "start_s": st, "ms": 1000.0 * d, "shape": list(shape)}
                    for g, th, st, d, shape in calls.rows
                    if not g.startswith((DECODE_GRAPH, "llm_embed"))
                ],
            }  # fmt: skip
    finally:
        model.close()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    r = result
    print(f"first audio {r['first_audio_s']:.2f} s, TTCA {r['ttca_s']:.2f} s")
    print(f"wall {r['wall_s']:.2f} s for {r['audio_s']:.2f} s of audio, CPU {r['cpu_s']:.2f} s")
    for c in r["chunks"]:
        print(f"  chunk at {c['at_s']:6.2f} s: offset {c['offset_s']:5.2f} s, {c['seconds']:.2f} s")
    pace = r["decode"]
    if pace["steps"]:
        print(f"decode: {pace['steps']} calls, {pace['mean_ms']:.1f} ms mean, {pace['first_s']:.2f}-{pace['last_end_s']:.2f} s")
        for b in pace["bins"]:
            print(f"  {b['from_s']:5.1f} s: {b['steps']:3d} calls, busy {b['busy_ms']:4.0f} ms")
    for c in r["calls"]:
        print(f"{c['graph']:<24} {c['thread'][:14]:<14} {c['start_s']:7.3f} s {c['ms']:7.1f} ms {tuple(c['shape'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
