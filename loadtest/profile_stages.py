"""Where the time goes: ONNX Runtime profiles of one streamed request on a bundle of any family, per graph and op type.

    python loadtest/profile_stages.py models/full-random-cosyvoice3-int8 [--tokens 125] [--steps 10] [--json out.json]
        [--env TTS_ENGINE_PROFILE=native_estimator=false ...]

The bundle's family is loaded as the service loads it (its default settings, or the TTS_* settings named with
`--env`), every sentence forced to `--tokens` speech tokens (default: 5 s at the family's token rate), in the first
built-in speaker or, for a bundle without one, the family's warm-up voice. Every session is opened with ORT profiling
on; one warm-up request runs first and is left out. For each graph: calls, ms per call, its share of the measured
request's wall time, nodes in the graph, and the op types that take the time (our kernels appear as their custom op
names). Calls of one graph may overlap (two streams' lanes), so shares may add up to more than 1.
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

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import service.engine.sessions as sessions_mod
from loadtest.bench_engine import SHORT_TEXT, apply_env, forced_engines, one_request_parser, sentence_tokens, text_ids
from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.engine.types import SynthesisOptions
from service.families.model import ModelContext
from service.families.registry import load_model
from service.runtime import runtime_options
from service.settings import Settings

OPENED: dict[str, tuple[str, Any]] = {}  # graph file stem (a second session of it: "stem#2") -> (stem, InferenceSession)


def _profiled(out: Path) -> None:
    """Make every session this process opens profile itself into `out`, and remember it."""
    make, open_ = sessions_mod.make_session_options, sessions_mod._open

    def make_profiled(opts: RuntimeOptions, graph: str | None = None) -> Any:
        so = make(opts, graph)
        so.enable_profiling = True
        so.profile_file_prefix = str(out / (graph or "graph"))
        return so

    def open_recorded(path: Path, so: Any) -> Any:
        session = open_(path, so)
        stem = Path(path).stem
        key = stem if stem not in OPENED else f"{stem}#{sum(s == stem for s, _ in OPENED.values()) + 1}"
        OPENED[key] = (stem, session)  # e.g. the wide HiFT decode session beside the one-thread one
        return session

    sessions_mod.make_session_options = make_profiled  # type: ignore[assignment]
    sessions_mod._open = open_recorded  # type: ignore[assignment]


def summarize(profile: Path) -> dict[str, Any]:
    """Per call of the graph in the measured request: ms, nodes run, and time by op type. Both requests make the
    same calls (forced token count, same text), so the second half of the calls is the measured request's."""
    events = json.loads(profile.read_text())
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    kept = runs[len(runs) // 2 :]
    if not kept:
        return {"calls": 0}
    start = kept[0]["ts"]
    by_op: dict[str, float] = defaultdict(float)
    nodes = 0
    for e in events:
        if e.get("cat") == "Node" and e["ts"] >= start and e["name"].endswith("_kernel_time"):
            by_op[e["args"].get("op_name", "?")] += e["dur"] / 1000.0
            nodes += 1
    calls = len(kept)
    run_ms = [r["dur"] / 1000.0 for r in kept]
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:8]
    return {
        "calls": calls,
        "ms_per_call": sum(run_ms) / calls,
        "first_call_ms": run_ms[0],
        "nodes_run_per_call": nodes / calls,
        "kernel_ms_per_call": sum(by_op.values()) / calls,
        "top_ops_ms_per_call": {op: ms / calls for op, ms in top},
    }


def main(argv: list[str] | None = None) -> int:
    p = one_request_parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    apply_env(args.env)
    bundle = ModelBundle.load(args.bundle)
    tokens = sentence_tokens(bundle, args.tokens)
    out = Path(tempfile.mkdtemp(prefix="ort-profile-"))
    _profiled(out)
    runtime = runtime_options(Settings(_env_file=None, model_dir=args.bundle))  # type: ignore[call-arg]

    model = load_model(bundle, ModelContext(options=runtime, engine_loader=forced_engines(tokens), prompt_analysis=False))
    ids = text_ids(model.frontend, SHORT_TEXT)
    voice = model.voice(model.speakers[0]) if model.speakers else model.warmup_voice()
    timings: dict[str, float] = {}
    try:
        for seed in (0, 1):  # the first is the warm-up (prepacking, arenas), left out of the summary
            options = SynthesisOptions(seed=seed, stream=True, n_timesteps=args.steps)
            start, first, audio = time.perf_counter(), None, 0.0
            for chunk in model.synthesize([ids], voice, options, threading.Event()):
                if first is None and chunk.audio.size:
                    first = time.perf_counter() - start
                audio += chunk.seconds
            timings = {"first_audio_s": first or 0.0, "wall_s": time.perf_counter() - start, "audio_s": audio}
    finally:
        model.close()
    result: dict[str, Any] = {
        "bundle": str(args.bundle), "family": bundle.family, "tokens": tokens, "flow_steps": args.steps,
        "env": args.env, **timings, "graphs": {},
    }  # fmt: skip
    for name, (stem, session) in OPENED.items():
        path = Path(session.end_profiling())
        graph_nodes = len(onnx.load(str(args.bundle / f"{stem}.onnx"), load_external_data=False).graph.node)
        summary = summarize(path)
        if summary.get("calls"):
            summary["share_of_wall"] = summary["calls"] * summary["ms_per_call"] / 1000.0 / timings["wall_s"]
        result["graphs"][name] = {"graph_nodes": graph_nodes, **summary}
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
