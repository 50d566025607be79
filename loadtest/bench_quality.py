"""What the speed options cost in accuracy: quantized bundles and fewer flow steps, measured against fp32 / 10 steps.

* LLM decode step: log-prob error and top-1 agreement of int8 / int4 `llm_step` vs fp32 (export.quantize.step_deviation).
* Flow: relative L2 error of the mel for the same tokens, speaker and noise: int8 estimator+encoder vs fp32,
  and fp32 with N Euler steps vs the official 10.
With random-init weights these are checks of size and direction, not predictions for the released model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from export.quantize import step_deviation
from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.engine.sessions import open_sessions
from service.families.cosyvoice1.flow import FlowRunner

FLOW_GRAPHS = ("flow_encoder", "flow_lr", "flow_estimator")


def flow_mel(bundle_dir: Path, tokens: np.ndarray, embedding: np.ndarray, noise: np.ndarray, steps: int) -> np.ndarray:
    bundle = ModelBundle.load(bundle_dir)
    flow = FlowRunner(open_sessions(bundle, RuntimeOptions(), FLOW_GRAPHS), bundle.constants)
    mel, _ = flow.inference(tokens, embedding, noise, None, steps)
    return mel


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def measure(fp32: Path, quantized: list[Path], steps: list[int], n_tokens: int) -> dict[str, Any]:
    bundle = ModelBundle.load(fp32)
    c = bundle.constants
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, c.speech_token_size, n_tokens)
    embedding = next(iter(bundle.speakers.values()))
    noise = rng.standard_normal((c.n_mels, c.tokens_to_mel_frames(n_tokens)), dtype=np.float32)
    reference = flow_mel(fp32, tokens, embedding, noise, c.n_timesteps)
    out: dict[str, Any] = {"tokens": n_tokens, "llm_step": {}, "flow_mel_rel_l2": {}}
    for q in quantized:
        precision = ModelBundle.load(q).manifest.precision
        out["llm_step"][precision] = step_deviation(fp32, q, c)
        mel = flow_mel(q, tokens, embedding, noise, c.n_timesteps)
        out["flow_mel_rel_l2"][f"{precision} (10 steps)"] = rel_l2(mel, reference)
    for n in steps:
        out["flow_mel_rel_l2"][f"fp32, {n} steps"] = rel_l2(flow_mel(fp32, tokens, embedding, noise, n), reference)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("fp32", type=Path)
    p.add_argument("quantized", type=Path, nargs="*")
    p.add_argument("--steps", type=int, nargs="*", default=[5])
    p.add_argument("--tokens", type=int, default=250)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.fp32, args.quantized, args.steps, args.tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
