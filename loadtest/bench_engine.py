"""Benchmark: one request through the engine (forced token count), per-stage seconds, RTF, first-chunk latency."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.bundle import ModelBundle
from service.engine.llm import LLMRunner
from service.engine.sessions import RuntimeOptions, open_sessions
from service.engine.synthesizer import SynthesisOptions, Synthesizer
from service.frontend import TextFrontend

# A realistic prompt: one normalized sentence of ordinary Chinese text (about 50 text tokens).
PROMPT_TEXT = "2024年3月15日，我们在北京发布了新版本，售价99.5元，支持一百种语言。"


class ForcedLength:
    """Wraps an LLMRunner so every sentence yields exactly `n` sampled tokens (EOS masked until then)."""

    def __init__(self, runner: LLMRunner, n: int) -> None:
        self.runner, self.n = runner, n

    def generate(
        self,
        text_ids: Sequence[int],
        embedding: np.ndarray,
        rng: np.random.Generator,
        *,
        min_tokens: int | None = None,
        max_tokens: int | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[int]:
        return self.runner.generate(text_ids, embedding, rng, min_tokens=self.n, max_tokens=self.n, cancel=cancel)


def run_once(synth: Synthesizer, ids: list[int], options: SynthesisOptions) -> dict[str, float]:
    """Wall time, per-stage seconds, audio seconds and first-chunk latency of one request."""
    t0 = time.perf_counter()
    first = None
    llm = flow = hift = 0.0
    samples = 0
    for chunk in synth.synthesize([ids], "中文女", options):
        first = first if first is not None else time.perf_counter() - t0
        llm, flow, hift = llm + chunk.timings.llm_s, flow + chunk.timings.flow_s, hift + chunk.timings.hift_s
        samples += chunk.audio.size
    wall = time.perf_counter() - t0
    audio_s = samples / synth.sample_rate
    return {
        "wall_s": wall,
        "audio_s": audio_s,
        "rtf": wall / audio_s,
        "first_chunk_s": first or wall,
        "llm_s": llm,
        "flow_s": flow,
        "hift_s": hift,
    }


def bench_bundle(path: Path, tokens: int, threads: int, reps: int, stream: bool, n_timesteps: int | None) -> dict:
    bundle = ModelBundle.load(path)
    sessions = open_sessions(bundle, RuntimeOptions(intra_op_threads=threads))
    synth = Synthesizer(bundle, sessions, llm=ForcedLength(LLMRunner(sessions, bundle.constants), tokens))
    options = SynthesisOptions(seed=0, stream=stream, n_timesteps=n_timesteps)
    ids = [i for s in TextFrontend.load(bundle.tokenizer_path).sentences(PROMPT_TEXT) for i in s.ids]
    run_once(Synthesizer(bundle, sessions, llm=ForcedLength(LLMRunner(sessions, bundle.constants), 30)), ids, options)
    runs = [run_once(synth, ids, options) for _ in range(reps)]
    summary = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    spread = {k: [min(r[k] for r in runs), max(r[k] for r in runs)] for k in runs[0]}
    return {
        "bundle": str(path),
        "precision": bundle.manifest.precision,
        "tokens": tokens,
        "text_tokens": len(ids),
        "threads": threads,
        "stream": stream,
        "n_timesteps": n_timesteps or bundle.constants.n_timesteps,
        "median": summary,
        "min_max": spread,
        "runs": runs,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("bundles", nargs="+", type=Path)
    p.add_argument("--tokens", type=int, default=250)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--stream", action="store_true", help="streaming mode (first-chunk latency is meaningful)")
    p.add_argument("--n-timesteps", type=int)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    results = [bench_bundle(b, args.tokens, args.threads, args.reps, args.stream, args.n_timesteps) for b in args.bundles]
    base = results[0]["median"]["rtf"]
    print(f"{'bundle':<34} {'RTF':>6} {'vs 1st':>7} {'LLM s':>7} {'ms/tok':>7} {'flow s':>7} {'HiFT s':>7} {'1st chunk s':>11}")
    for r in results:
        m = r["median"]
        print(
            f"{Path(r['bundle']).name:<34} {m['rtf']:6.2f} {base / m['rtf']:6.2f}x {m['llm_s']:7.2f} "
            f"{1e3 * m['llm_s'] / r['tokens']:7.1f} {m['flow_s']:7.2f} {m['hift_s']:7.2f} {m['first_chunk_s']:11.2f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
