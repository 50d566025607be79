"""Replay the CosyVoice2 reference fixtures (layout of tests/reference/tiny-cosyvoice2) through a bundle, stage by stage."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.engine.sessions import open_sessions
from service.engine.types import LLMPrompt, SynthesisOptions
from service.families.cosyvoice2.contract import GRAPH_IO, TOKENIZER_NAME
from service.families.cosyvoice2.engine import CosyVoice2Engine
from service.families.cosyvoice2.voice import FlowPrompt2
from service.layers.prompt24k import PromptAnalyzer2
from service.layers.prompt_checks import verify_prompts, verify_tokenizer
from service.layers.qwen_tokenizer import Qwen2Tokenizer
from service.layers.vocoder import VocoderStream, sine_excitation2
from service.verify.checks import CASE, Check, VerifyReport, indices, max_abs, mismatches, skip_reason

MODE_FILES = ("zero_shot.npz", "cross_lingual.npz", "instruct2.npz")
STREAM_FILE, HIFT_FILE, PROMPTS_FILE, TOKENIZER_FILE = "stream.npz", "hift.npz", "prompts.npz", "tokenizer_cases.json"
PROMPT_MODELS = ("campplus.onnx", "speech_tokenizer_v2.onnx")
# Every model stage is held to 1e-4 (float32, recorded randomness injected); integer results must match exactly.
TOL = 1e-4


def run_verification2(
    bundle: ModelBundle, fixtures: Path, runtime: RuntimeOptions | None = None, on_check: Callable[[Check], None] | None = None
) -> VerifyReport:
    """Every CosyVoice2 fixture file present in `fixtures`; missing ones are listed in `report.skipped`."""
    runtime = runtime or RuntimeOptions(max_batch=0, acoustic_slots=0)
    engine = CosyVoice2Engine(bundle, open_sessions(bundle, runtime, names=_graph_names(bundle)))
    report = VerifyReport()
    stages: list[tuple[str, Callable[[Path], Iterator[Check]]]] = [
        (TOKENIZER_FILE, lambda p: verify_tokenizer(Qwen2Tokenizer.load(bundle.file(TOKENIZER_NAME)), p)),
        (PROMPTS_FILE, lambda p: verify_prompts(fixtures, runtime, PromptAnalyzer2, PROMPT_MODELS)),
        *[(name, lambda p, n=name: verify_mode(engine, p, n.removesuffix(".npz"))) for name in MODE_FILES],
        (HIFT_FILE, lambda p: verify_hift(engine, p)),
        (STREAM_FILE, lambda p: verify_streams(engine, p)),
    ]
    for name, stage in stages:
        why = skip_reason(fixtures, name, PROMPT_MODELS if name == PROMPTS_FILE else ())
        if why is not None:
            report.skipped.append(why)
            continue
        for check in stage(fixtures / name):
            report.checks.append(check)
            if on_check is not None:
                on_check(check)
    return report


def _graph_names(bundle: ModelBundle) -> tuple[str, ...]:
    return tuple(GRAPH_IO)


# ---- model stages per mode ----------------------------------------------------------------------


def _ids(npz: Any, key: str) -> tuple[int, ...]:
    return tuple(int(t) for t in npz[key]) if key in npz.files else ()


def flow_prompt(npz: Any, key: str) -> FlowPrompt2:
    return FlowPrompt2(
        npz[key + "mi_embedding"], _ids(npz, key + "mi_flow_prompt_speech_token"), npz[key + "mi_prompt_speech_feat"]
    )


def verify_mode(engine: CosyVoice2Engine, path: Path, mode: str) -> Iterator[Check]:
    """LLM prefill and teacher-forced log-probs, flow spks / mu / estimator step 1 / solver output, HiFT on the
    recorded source, for every case of one mode file."""
    with np.load(path) as npz:
        for c in indices(npz, CASE):
            key, label = f"case{c}_", f"{mode} case{c}"
            yield from _llm_case(engine, npz, key, label)
            yield from _flow_case(engine, npz, key, label)
            f0 = engine.vocoder.runner.predict_f0(npz[key + "hift_mel"])
            yield Check(label, "hift f0", max_abs(f0, npz[key + "hift_f0"]), TOL)
            wav = engine.vocoder.runner.decode(npz[key + "hift_mel"], npz[key + "hift_source"])
            yield Check(label, "hift speech (recorded source)", max_abs(wav, npz[key + "hift_speech"]), TOL)


def _llm_case(engine: CosyVoice2Engine, npz: Any, key: str, label: str) -> Iterator[Check]:
    text = npz[key + "mi_text"].tolist()
    prompt = LLMPrompt(None, _ids(npz, key + "mi_prompt_text"), _ids(npz, key + "mi_llm_prompt_speech_token"))
    yield Check(label, "llm prefill input", max_abs(engine.runner.encode(text, prompt), npz[key + "llm_prefill_input"]), TOL)
    forced = npz[key + "forced_tokens"]
    logp = engine.runner.teacher_force(text, prompt, forced)
    rows = npz[key + "llm_logp_row_index"]
    yield Check(label, "llm logp rows", max_abs(logp[rows], npz[key + "llm_logp_rows"]), TOL)
    eos = engine.constants.eos_token
    taken = np.append(logp[np.arange(len(forced)), forced], logp[len(forced), eos])
    yield Check(label, "llm logp of taken tokens", max_abs(taken, npz[key + "llm_logp_taken"]), TOL)
    yield Check(label, "llm logp of eos", max_abs(logp[:, eos], npz[key + "llm_logp_eos"]), TOL)


def _flow_case(engine: CosyVoice2Engine, npz: Any, key: str, label: str) -> Iterator[Check]:
    flow, prompt = engine.flow, flow_prompt(npz, key)
    yield Check(label, "flow spks", max_abs(flow.speaker(prompt.embedding), npz[key + "flow_spks"]), TOL)
    seq = np.asarray([*prompt.tokens, *npz[key + "forced_tokens"].tolist()], dtype=np.int64)
    state = flow.empty_state(engine.constants.n_timesteps)
    mu = flow.encode(seq, seq[:0], state.encoder, 1 << 30)
    yield Check(label, "flow mu", max_abs(mu, npz[key + "flow_mu"]), TOL)
    if key + "est1_out" in npz.files:
        yield Check(label, "flow estimator step 1", max_abs(_estimator_step1(engine, mu, prompt), npz[key + "est1_out"]), TOL)
    (chunk,) = engine.mel_chunks(iter(npz[key + "forced_tokens"].tolist()), prompt, SynthesisOptions(stream=False))
    solver_out = npz[key + "flow_solver_out"]
    yield Check(label, "flow mel", max_abs(chunk.mel, solver_out[:, 2 * len(prompt.tokens) :]), TOL)


def _estimator_step1(engine: CosyVoice2Engine, mu: np.ndarray, prompt: FlowPrompt2) -> np.ndarray:
    """Both CFG rows of the estimator at t = 0 over the whole sequence (full attention, no cache)."""
    flow = engine.flow
    frames = mu.shape[1]
    cond = np.zeros_like(mu)
    cond[:, : prompt.mel.shape[0]] = prompt.mel.T
    spks = flow.speaker(prompt.embedding)
    x = flow.noise[:, :frames]
    feeds = {
        "x": np.stack([x, x]),
        "mu": np.stack([mu, np.zeros_like(mu)]),
        "t": np.zeros(2, dtype=np.float32),
        "spks": np.stack([spks, np.zeros_like(spks)]),
        "cond": np.stack([cond, np.zeros_like(cond)]),
        "chunk": np.array([1 << 30], dtype=np.int64),
    }
    return flow.estimate(feeds, flow.empty_state(1).steps[0])


# ---- HiFT alone ----------------------------------------------------------------------------------


def verify_hift(engine: CosyVoice2Engine, path: Path) -> Iterator[Check]:
    """The vocoder with every random draw recorded: f0, SineGen2 + source graph (cache applied), decode."""
    runner = engine.vocoder.runner
    with np.load(path) as npz:
        for c in indices(npz, CASE):
            key, label = f"case{c}_", f"hift case{c}"
            mel = npz[key + "mel"]
            if c == 0:  # the other cases injected their f0 contour into the official call
                yield Check(label, "f0", max_abs(runner.predict_f0(mel), npz[key + "f0"]), TOL)
            source = runner.source(sine_excitation2(npz[key + "f0"], engine.constants, npz[key + "sine_noise"]))
            cache = npz[key + "cache_source"]
            source[: cache.shape[0]] = cache
            yield Check(label, "source", max_abs(source, npz[key + "source"]), TOL)
            yield Check(label, "speech", max_abs(runner.decode(mel, source), npz[key + "speech"]), TOL)


# ---- streaming -----------------------------------------------------------------------------------


def verify_streams(engine: CosyVoice2Engine, path: Path) -> Iterator[Check]:
    """Each recorded stream=True run: the chunk schedule, every chunk's new mel from the cached flow (the last one
    with the official full-attention pass, and the chunk-masked harness extra), and the yielded audio with the
    recorded HiFT sources."""
    with np.load(path) as npz:
        for run in sorted({k.split("_chunk_offset")[0] for k in npz.files if k.endswith("_chunk_offset")}):
            yield from _stream(engine, npz, run)


def _stream(engine: CosyVoice2Engine, npz: Any, run: str) -> Iterator[Check]:
    label = f"stream {run}"
    key = run + "_"
    prompt = flow_prompt(npz, key)
    tokens = npz[key + "forced_tokens"].tolist()
    options = SynthesisOptions(stream=True)
    chunks = list(engine.mel_chunks(iter(tokens), prompt, options, exact_final=True))
    n = int(npz[key + "chunk_offset"].shape[0])
    frames = [int(c.mel.shape[1]) for c in chunks]
    yield Check(label, "chunk schedule (new mel frames)", mismatches(frames, npz[key + "chunk_new_mel_frames"]), 0.0)
    for k, chunk in enumerate(chunks[:n]):
        yield Check(label, f"chunk{k} flow mel", max_abs(chunk.mel, npz[f"{key}k{k}_flow_new_mel"]), TOL)
    if key + "extra_final_chunkmask_new_mel" in npz.files:
        causal = list(engine.mel_chunks(iter(tokens), prompt, options))[-1].mel
        yield Check(label, "final chunk, chunk masks (cached)", max_abs(causal, npz[key + "extra_final_chunkmask_new_mel"]), TOL)
    vocoder = VocoderStream(engine.vocoder, np.random.default_rng(0))
    for k, chunk in enumerate(chunks[:n]):
        audio = vocoder.push(chunk.mel, final=k == n - 1, source=npz[f"{key}k{k}_hift_source"])
        yield Check(label, f"chunk{k} audio (recorded source)", max_abs(audio, npz[f"{key}k{k}_yielded"]), TOL)
