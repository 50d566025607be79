"""Where the time goes: ONNX Runtime profiles of one streamed request on a bundle, summarized per graph and op type.

    python loadtest/profile_stages.py models/full-random-int8 [--tokens 200] [--steps 10] [--json out.json]

Every session is opened with ORT profiling on; one warm-up request runs first and is left out. For each graph:
calls, ms per call, nodes in the graph, and the op types that take the time. The LLM decode step (one token of one
stream), the first-chunk estimator call and the HiFT calls are the rows the speed issue asks about.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import service.engine.sessions as sessions_mod
from loadtest.bench_engine import SHORT_TEXT, ForcedLength, text_ids
from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.engine.types import SynthesisOptions
from service.families.cosyvoice1.contract import TOKENIZER_NAME
from service.families.cosyvoice1.engine import Synthesizer
from service.frontend import TextFrontend

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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="ort-profile-"))
    _profiled(out)
    bundle = ModelBundle.load(args.bundle)
    synth = Synthesizer.load(bundle, RuntimeOptions(max_batch=0))  # one stream, no scheduler thread
    synth.llm = ForcedLength(synth.llm, args.tokens)
    ids = text_ids(TextFrontend.load(bundle.file(TOKENIZER_NAME)), SHORT_TEXT)
    voice = synth.speakers[0]
    warm = SynthesisOptions(seed=0, stream=True, n_timesteps=args.steps)
    for _ in synth.synthesize([ids], voice, warm):  # warm-up (prepacking, arenas), left out of the summary
        pass
    for _ in synth.synthesize([ids], voice, SynthesisOptions(seed=1, stream=True, n_timesteps=args.steps)):
        pass
    result: dict[str, Any] = {"bundle": str(args.bundle), "tokens": args.tokens, "flow_steps": args.steps, "graphs": {}}
    for name, (stem, session) in OPENED.items():
        path = Path(session.end_profiling())
        graph_nodes = len(onnx.load(str(args.bundle / f"{stem}.onnx"), load_external_data=False).graph.node)
        result["graphs"][name] = {"graph_nodes": graph_nodes, **summarize(path)}
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
