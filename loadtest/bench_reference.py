"""Baseline for the benchmark: OUR torch modules (export/modules) run in eager PyTorch the way the official code runs.

The official CosyVoice package cannot be installed here, so this stands in for it ("PyTorch reference
pipeline"). It keeps what makes the official v1 inference slow and nothing else:
* the LLM decodes with `forward_chunk` semantics: every step re-projects the relative positional encodings
  of the whole sequence (2*T2 - 1 rows) through `linear_pos` in every layer, and grows its KV cache with
  `torch.cat`;
* the flow runs 10 Euler steps of the estimator with CFG as a batch of 2 (`MaskedDiffWithXvec.inference`);
* HiFT runs f0 predictor, SineGen, source merge, STFT, conv decode and iSTFT in torch.
Weights are the seeded random init of `export/export_onnx.py --random-init` (same seed, same modules), so it
computes the same function as the full-random bundles. fp32, `torch.set_num_threads(threads)`, no_grad.
Streaming first audio is composed from measured parts: the time the LLM needed for the official first chunk
(hop 100 + overlap 20 = 120 tokens) plus one flow and one HiFT call on that chunk.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from export.bundle_writer import ExportOptions
from export.config import load_config
from export.cosyvoice1.bundle_writer import Models, build_models
from export.cosyvoice1.modules.llm import TransformerLM
from export.modules.flow import mel_frames
from export.modules.transformer import espnet_sinusoids, step_geometry

OFFICIAL_FIRST_CHUNK_TOKENS = 120  # token_hop_len 100 + token_overlap_len 20
OFFICIAL_FIRST_CHUNK_FRAMES_HELD = 34  # mel_overlap_len: frames held back from HiFT in a non-final chunk


def official_step(
    llm: TransformerLM, xs: torch.Tensor, cache_k: list[torch.Tensor], cache_v: list[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """One `forward_chunk` call: xs (1,T,DI) after a cache of T_cache positions -> (logp (V,), grown caches)."""
    enc = llm.llm
    t_cache = cache_k[0].shape[2]
    t2 = t_cache + xs.shape[1]
    x = enc.embed(xs)
    # relative positions +(T2-1) .. -(T2-1), as EspnetRelPositionalEncoding.position_encoding(0, T2) slices them
    pe = espnet_sinusoids(torch.arange(t2 - 1, -t2, -1), enc.cfg.output_size)
    past_len = torch.tensor([t_cache])
    geometry = step_geometry(past_len, t_cache, xs.shape[1], enc.layers()[0].self_attn.heads)  # the step's mask, once
    new_k, new_v = [], []
    for i, layer in enumerate(enc.layers()):
        projected = layer.self_attn.project_pos(pe)  # (H, 2*T2-1, DK): the official per-step, per-layer work
        pos = projected[:, :t2].flip(1)  # distances 0..T2-1, the rows the causal attention reads
        x, k, v = layer.step(x, cache_k[i], cache_v[i], pos, geometry)
        new_k.append(torch.cat((cache_k[i], k), dim=2))
        new_v.append(torch.cat((cache_v[i], v), dim=2))
    logp = llm.log_probs(enc.after_norm(x)[:, -1])[0]
    return logp, new_k, new_v


def run_llm(llm: TransformerLM, text_ids: torch.Tensor, embedding: torch.Tensor, tokens: list[int]) -> list[float]:
    """Teacher-forced decode of `tokens` (the cost does not depend on which tokens); returns the time after each token."""
    heads, d_k = llm.llm.layers()[0].self_attn.heads, llm.llm.layers()[0].self_attn.d_k
    empty = [torch.zeros(1, heads, 0, d_k) for _ in llm.llm.layers()]
    t0 = time.perf_counter()
    lm_input = llm.encode(text_ids.view(1, -1), embedding.view(1, -1))
    logp, cache_k, cache_v = official_step(llm, lm_input, empty, list(empty))
    stamps = []
    for tok in tokens:
        torch.multinomial(torch.softmax(logp, -1), 1)  # the sampler's cost (ras_sampling draws from logp)
        logp, cache_k, cache_v = official_step(llm, llm.embed_tokens(torch.tensor([[tok]])), cache_k, cache_v)
        stamps.append(time.perf_counter() - t0)
    return stamps


def run_flow(models: Models, tokens: list[int], embedding: torch.Tensor, seed: int) -> torch.Tensor:
    flow = models.flow
    frames = mel_frames(len(tokens), flow.cfg.input_frame_rate)
    noise = torch.randn(1, flow.cfg.output_size, frames, generator=torch.Generator().manual_seed(seed))
    return flow.inference(torch.tensor([tokens]), embedding.view(1, -1), noise).mel


def run_hift(models: Models, mel: torch.Tensor, seed: int) -> torch.Tensor:
    hift = models.hift
    gen = torch.Generator().manual_seed(seed)
    f0 = hift.f0(mel)
    n = f0.shape[1] * hift.upsample_factor
    phase = (torch.rand(1, hift.num_harmonics, 1, generator=gen) * 2 - 1) * torch.pi
    phase[:, 0] = 0
    source = hift.source_from_f0(f0, phase, torch.randn(1, hift.num_harmonics, n, generator=gen))
    return hift.decode(mel, source)


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def measure(models: Models, n_text: int, n_tokens: int, seed: int) -> dict[str, Any]:
    """One non-streamed request with per-stage seconds, plus the composed official first-chunk latency."""
    gen = torch.Generator().manual_seed(seed)
    text_ids = torch.randint(0, models.llm.cfg.text_token_size, (n_text,), generator=gen)
    embedding = torch.randn(models.llm.cfg.spk_embed_dim, generator=gen)
    tokens = torch.randint(0, models.llm.cfg.speech_token_size, (n_tokens,), generator=gen).tolist()
    t0 = time.perf_counter()
    stamps = run_llm(models.llm, text_ids, embedding, tokens)
    mel, flow_s = timed(run_flow, models, tokens, embedding, seed)
    wav, hift_s = timed(run_hift, models, mel, seed)
    wall = time.perf_counter() - t0
    first = tokens[:OFFICIAL_FIRST_CHUNK_TOKENS]
    first_mel, first_flow_s = timed(run_flow, models, first, embedding, seed)
    _, first_hift_s = timed(run_hift, models, first_mel[:, :, :-OFFICIAL_FIRST_CHUNK_FRAMES_HELD], seed)
    llm_first_s = stamps[min(len(stamps), OFFICIAL_FIRST_CHUNK_TOKENS) - 1]
    audio_s = wav.shape[-1] / models.hift.cfg.sampling_rate
    return {
        "wall_s": wall,
        "audio_s": audio_s,
        "rtf": wall / audio_s,
        "llm_s": stamps[-1],
        "flow_s": flow_s,
        "hift_s": hift_s,
        "ms_per_token": 1e3 * stamps[-1] / len(stamps),
        "ms_per_token_first_50": 1e3 * stamps[min(49, len(stamps) - 1)] / min(50, len(stamps)),
        "first_chunk_s": llm_first_s + first_flow_s + first_hift_s,
        "first_chunk_parts_s": {"llm_120_tokens": llm_first_s, "flow": first_flow_s, "hift": first_hift_s},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=Path(__file__).resolve().parents[1] / "export/configs/cosyvoice-300m-sft.yaml")
    p.add_argument("--tokens", type=int, default=250)
    p.add_argument("--text-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    models = build_models(cfg, ExportOptions(model_dir=args.config.parent, out=Path("unused"), random_init=True, seed=args.seed))
    with torch.inference_mode():
        runs = [measure(models, args.text_tokens, args.tokens, args.seed + r) for r in range(args.reps)]
    keys = [k for k in runs[0] if isinstance(runs[0][k], float)]
    print(
        json.dumps(
            {
                "pipeline": "PyTorch reference (our export/modules in eager torch, official inference loop)",
                "torch": torch.__version__,
                "threads": args.threads,
                "tokens": args.tokens,
                "text_tokens": args.text_tokens,
                "median": {k: float(np.median([r[k] for r in runs])) for k in keys},
                "min_max": {k: [min(r[k] for r in runs), max(r[k] for r in runs)] for k in keys},
                "runs": runs,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
