"""Benchmark: one LLM decode step (llm_step, T=1) at a given past length, for one or more bundles."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.bundle import ModelBundle
from service.engine.llm import kv_cache_dtype
from service.engine.options import RuntimeOptions
from service.engine.sessions import open_sessions
from service.families.cosyvoice1.llm import position_dtype
from service.families.cosyvoice1.positions import PositionTable


def step_feeds(bundle: ModelBundle, sessions: dict, past: int, batch: int) -> dict[str, np.ndarray]:
    """Feeds for one decode step of `batch` rows that each have `past` cached positions."""
    c = bundle.constants
    rng = np.random.default_rng(0)
    x = sessions["llm_embed"].run(None, {"token": rng.integers(0, c.speech_token_size, (batch, 1))})[0]
    table = PositionTable(lambda pe: sessions["llm_pos"].run(None, {"pe": pe})[0], c.llm_model_dim, rows=past + 1)
    if "llm_step" in sessions:
        table.hold_as(position_dtype(sessions["llm_step"]))
    feeds: dict[str, np.ndarray] = {"x": x, "past_len": np.full((batch,), past, dtype=np.int64)}
    shape = (batch, c.llm_num_heads, past, c.llm_head_dim)
    kv = kv_cache_dtype(sessions["llm_step"]) if "llm_step" in sessions else np.float32
    for i in range(c.llm_num_layers):
        feeds[f"past_k_{i}"] = rng.standard_normal(shape, dtype=np.float32).astype(kv)
        feeds[f"past_v_{i}"] = rng.standard_normal(shape, dtype=np.float32).astype(kv)
    feeds.update(table.feeds(past + 1))
    return feeds


def time_step(bundle_dir: Path, past: int, batch: int, threads: int, reps: int, calls: int) -> dict[str, float | str]:
    bundle = ModelBundle.load(bundle_dir)
    sessions = open_sessions(bundle, RuntimeOptions(intra_op_threads=threads), ["llm_embed", "llm_pos", "llm_step"])
    feeds = step_feeds(bundle, sessions, past, batch)
    step = sessions["llm_step"]
    for _ in range(3):
        step.run(None, feeds)
    means = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            step.run(None, feeds)
        means.append((time.perf_counter() - t0) / calls * 1e3)
    return {
        "bundle": str(bundle_dir),
        "precision": bundle.manifest.graphs["llm_step"].precision,
        "past": past,
        "batch": batch,
        "ms_median": statistics.median(means),
        "ms_min": min(means),
        "ms_max": max(means),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("bundles", nargs="+", type=Path)
    p.add_argument("--past", type=int, default=300)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rows = [time_step(b, args.past, args.batch, args.threads, args.reps, args.calls) for b in args.bundles]
    base = float(rows[0]["ms_median"])
    for r in rows:
        ratio = base / float(r["ms_median"])
        print(
            f"{r['precision']:>5} past={r['past']} batch={r['batch']}: {r['ms_median']:.1f} ms/step "
            f"(min {r['ms_min']:.1f}, max {r['ms_max']:.1f}); speed vs first: {ratio:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
