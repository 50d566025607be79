"""Replay the Fun-CosyVoice3 reference fixtures (layout of tests/reference/tiny-cosyvoice3) through a bundle, stage by
stage: tokenizer, prompt analysis, LLM, flow and HiFT per mode, HiFT alone, and every chunk of the official stream
(recomputed as the official code does, and from the caches)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.engine.sessions import open_sessions
from service.engine.types import LLMPrompt, SynthesisOptions
from service.families.cosyvoice3.assembly import SilenceFilter
from service.families.cosyvoice3.contract import GRAPH_IO, TOKENIZER_NAME
from service.families.cosyvoice3.engine import CosyVoice3Engine
from service.families.cosyvoice3.flow import FULL_ATTENTION
from service.families.cosyvoice3.vocoder import OfficialStream, SineSource, WindowedStream
from service.families.cosyvoice3.voices import PromptAnalyzer3
from service.layers.flow_prompt import FlowPrompt
from service.layers.prompt_checks import verify_prompts, verify_tokenizer
from service.layers.qwen_tokenizer import Qwen2Tokenizer
from service.verify.checks import CASE, Check, VerifyReport, indices, max_abs, mismatches, skip_reason

MODE_FILES = ("zero_shot.npz", "cross_lingual.npz", "instruct2.npz")
STREAM_FILE, HIFT_FILE, PROMPTS_FILE, TOKENIZER_FILE = "stream.npz", "hift.npz", "prompts.npz", "tokenizer_cases.json"
PROMPT_MODELS = ("campplus.onnx", "speech_tokenizer_v3.onnx")
TOL = 1e-4  # every model stage in float32 (the f0 predictor in float64, as the official); integer results exactly


def run_verification3(
    bundle: ModelBundle, fixtures: Path, runtime: RuntimeOptions | None = None, on_check: Callable[[Check], None] | None = None
) -> VerifyReport:
    """Every CosyVoice3 fixture file present in `fixtures`; missing ones are listed in `report.skipped`."""
    runtime = runtime or RuntimeOptions(max_batch=0, acoustic_slots=0)
    sessions = open_sessions(bundle, runtime, names=tuple(GRAPH_IO))
    official = CosyVoice3Engine(bundle, sessions, recompute=True)  # the official schedule and stream
    cached = CosyVoice3Engine(bundle, sessions)  # the same boundaries from the caches (no window: every frame)
    report = VerifyReport()
    stages: list[tuple[str, Callable[[Path], Iterator[Check]]]] = [
        (TOKENIZER_FILE, lambda p: verify_tokenizer(Qwen2Tokenizer.load(bundle.file(TOKENIZER_NAME)), p)),
        (PROMPTS_FILE, lambda p: verify_prompts(fixtures, runtime, PromptAnalyzer3, PROMPT_MODELS)),
        *[(name, lambda p, n=name: verify_mode(official, p, n.removesuffix(".npz"))) for name in MODE_FILES],
        (HIFT_FILE, lambda p: verify_hift(official, p)),
        (STREAM_FILE, lambda p: verify_streams(official, cached, p)),
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


def _ids(npz: Any, key: str) -> tuple[int, ...]:
    return tuple(int(t) for t in npz[key]) if key in npz.files else ()


def flow_prompt(npz: Any, key: str) -> FlowPrompt:
    return FlowPrompt(
        npz[key + "mi_embedding"], _ids(npz, key + "mi_flow_prompt_speech_token"), npz[key + "mi_prompt_speech_feat"]
    )


def filtered(engine: CosyVoice3Engine, tokens: list[int]) -> list[int]:
    """The official llm_job's silent-token filter (what the flow receives)."""
    return list(SilenceFilter(iter(tokens), engine.silent, engine.extra.max_silent_run))


# ---- model stages per mode ----------------------------------------------------------------------


def verify_mode(engine: CosyVoice3Engine, path: Path, mode: str) -> Iterator[Check]:
    """LLM prefill and teacher-forced log-probs, the silent filter, flow spks / look-ahead / estimator step 1 / mel,
    HiFT f0, source and speech, for every case of one mode file."""
    with np.load(path) as npz:
        for c in indices(npz, CASE):
            key, label = f"case{c}_", f"{mode} case{c}"
            yield from _llm_case(engine, npz, key, label)
            tokens = filtered(engine, npz[key + "forced_tokens"].tolist())
            yield Check(label, "silent-token filter", mismatches(tokens, npz[key + "flow_tokens"]), 0.0)
            yield from _flow_case(engine, npz, key, label)
            yield from _hift_case(engine, npz, key, label)


def _llm_case(engine: CosyVoice3Engine, npz: Any, key: str, label: str) -> Iterator[Check]:
    text = npz[key + "mi_text"].tolist()
    prompt = LLMPrompt(None, _ids(npz, key + "mi_prompt_text"), _ids(npz, key + "mi_llm_prompt_speech_token"))
    yield Check(label, "llm prefill input", max_abs(engine.runner.encode(text, prompt), npz[key + "llm_prefill_input"]), TOL)
    forced = npz[key + "forced_tokens"]
    logp = engine.runner.teacher_force(text, prompt, forced)
    rows = npz[key + "llm_logp_row_index"]
    yield Check(label, "llm logp rows", max_abs(logp[rows], npz[key + "llm_logp_rows"]), TOL)
    eos = engine.extra.eos
    taken = np.append(logp[np.arange(len(forced)), forced], logp[len(forced), eos])
    yield Check(label, "llm logp of taken tokens", max_abs(taken, npz[key + "llm_logp_taken"]), TOL)
    yield Check(label, "llm logp of eos", max_abs(logp[:, eos], npz[key + "llm_logp_eos"]), TOL)


def _flow_case(engine: CosyVoice3Engine, npz: Any, key: str, label: str) -> Iterator[Check]:
    flow, prompt = engine.flow, flow_prompt(npz, key)
    yield Check(label, "flow spks", max_abs(flow.speaker(prompt.embedding), npz[key + "flow_spks"]), TOL)
    tokens = npz[key + "flow_tokens"].tolist()
    seq = np.asarray([*prompt.tokens, *tokens], dtype=np.int64)
    state = flow.empty_state(1, capacity=0)
    mu = flow.encode(seq, seq[:0], state)
    yield Check(label, "flow look-ahead h", max_abs(mu[:, ::2].T, npz[key + "flow_lookahead_h"]), TOL)
    if key + "est1_out" in npz.files:
        yield Check(label, "flow estimator step 1", max_abs(_estimator_step1(engine, mu, prompt), npz[key + "est1_out"]), TOL)
    (chunk,) = engine.mel_chunks(iter(tokens), prompt, SynthesisOptions(stream=False))
    solver_out = npz[key + "flow_solver_out"]
    yield Check(label, "flow mel", max_abs(chunk.mel, solver_out[:, 2 * len(prompt.tokens) :]), TOL)


def _estimator_step1(engine: CosyVoice3Engine, mu: np.ndarray, prompt: FlowPrompt) -> np.ndarray:
    """Both CFG rows of the DiT at t = 0 over the whole sequence (full attention, no cache)."""
    flow = engine.flow
    frames = mu.shape[1]
    cond = np.zeros_like(mu)
    cond[:, : prompt.mel.shape[0]] = prompt.mel.T
    spks = flow.speaker(prompt.embedding)
    x = flow.noise[:, :frames]
    feeds = {
        "x": np.stack([x, x]), "mu": np.stack([mu, np.zeros_like(mu)]), "t": np.zeros(2, dtype=np.float32),
        "spks": np.stack([spks, np.zeros_like(spks)]), "cond": np.stack([cond, np.zeros_like(cond)]),
        "chunk": np.array([FULL_ATTENTION], dtype=np.int64), "start": np.array([0], dtype=np.int64),
    }  # fmt: skip
    return flow.estimate(feeds, flow.empty_state(1, capacity=0).steps[0], keep=False)


def _hift_case(engine: CosyVoice3Engine, npz: Any, key: str, label: str) -> Iterator[Check]:
    mel = npz[key + "flow_solver_out"][:, 2 * len(_ids(npz, key + "mi_flow_prompt_speech_token")) :]
    vocoder = engine.vocoder
    yield Check(label, "hift f0", max_abs(vocoder.runner.predict_f0(mel), npz[key + "hift_f0"]), TOL)
    source = vocoder.source(mel, 0, mel.shape[1], SineSource.start(engine.constants, vocoder.noise))
    yield Check(label, "hift source", max_abs(source, npz[key + "hift_source"]), TOL)
    speech = WindowedStream.start(vocoder).push(mel, final=True)
    yield Check(label, "hift speech", max_abs(speech, npz[key + "hift_speech"]), TOL)


# ---- HiFT alone -----------------------------------------------------------------------------------


def verify_hift(engine: CosyVoice3Engine, path: Path) -> Iterator[Check]:
    """The vocoder on direct calls: predicted f0 (case 0), the source from the f0 used, the speech (finalize or not)."""
    vocoder = engine.vocoder
    with np.load(path) as npz:
        for c in indices(npz, CASE):
            key, label = f"case{c}_", f"hift case{c}"
            mel, f0 = npz[key + "mel"], npz[key + "f0"]
            if c == 0:  # the other cases injected their f0 contour into the official call
                yield Check(label, "f0", max_abs(vocoder.runner.predict_f0(mel), f0), TOL)
            sine = SineSource.start(engine.constants, vocoder.noise)
            source = vocoder.runner.source(sine.stack(f0.astype(np.float32)))
            yield Check(label, "source", max_abs(source, npz[key + "source"]), TOL)
            speech = vocoder.decode(mel[:, : f0.shape[0]], source)[: npz[key + "speech"].shape[0]]
            yield Check(label, "speech", max_abs(speech, npz[key + "speech"]), TOL)


# ---- streaming -------------------------------------------------------------------------------------


def verify_streams(official: CosyVoice3Engine, cached: CosyVoice3Engine, path: Path) -> Iterator[Check]:
    """Each recorded stream=True run: the official recompute stream (schedule, every chunk's new mel, the audio yielded
    with HiFT re-run over the whole history), then the same boundaries from the caches (non-final chunks as the
    official's, the last one with chunk masks as the harness extra) and the windowed vocoder's audio."""
    with np.load(path) as npz:
        for run in sorted({k.split("_chunk_offset")[0] for k in npz.files if k.endswith("_chunk_offset")}):
            yield from _official_stream(official, npz, run)
            yield from _cached_stream(cached, npz, run)


def _official_stream(engine: CosyVoice3Engine, npz: Any, run: str) -> Iterator[Check]:
    label, key = f"stream {run} official", run + "_"
    prompt, n = flow_prompt(npz, key), int(npz[key + "chunk_offset"].shape[0])
    tokens = filtered(engine, npz[key + "forced_tokens"].tolist())
    chunks = list(engine.mel_chunks(iter(tokens), prompt, SynthesisOptions(stream=True)))
    frames = [int(c.mel.shape[1]) for c in chunks]
    yield Check(label, "chunk schedule (new mel frames)", mismatches(frames, npz[key + "chunk_new_mel_frames"]), 0.0)
    stream = OfficialStream.start(engine.vocoder)
    for k, chunk in enumerate(chunks[:n]):
        yield Check(label, f"chunk{k} flow mel", max_abs(chunk.mel, npz[f"{key}k{k}_flow_new_mel"]), TOL)
        audio = stream.push(npz[f"{key}k{k}_flow_new_mel"], final=k == n - 1)
        yield Check(label, f"chunk{k} audio (HiFT over the history)", max_abs(audio, npz[f"{key}k{k}_yielded"]), TOL)


def _cached_stream(engine: CosyVoice3Engine, npz: Any, run: str) -> Iterator[Check]:
    label, key = f"stream {run} cached", run + "_"
    prompt, n = flow_prompt(npz, key), int(npz[key + "chunk_offset"].shape[0])
    tokens = filtered(engine, npz[key + "forced_tokens"].tolist())
    chunks = list(engine.mel_chunks(iter(tokens), prompt, SynthesisOptions(stream=True)))
    frames = [int(c.mel.shape[1]) for c in chunks]
    yield Check(label, "chunk schedule (new mel frames)", mismatches(frames, npz[key + "chunk_new_mel_frames"]), 0.0)
    for k, chunk in enumerate(chunks[: n - 1]):
        yield Check(label, f"chunk{k} flow mel (official's)", max_abs(chunk.mel, npz[f"{key}k{k}_flow_new_mel"]), TOL)
    if key + "extra_final_chunkmask_new_mel" in npz.files:
        yield Check(label, "final chunk, chunk masks", max_abs(chunks[-1].mel, npz[key + "extra_final_chunkmask_new_mel"]), TOL)
    stream = WindowedStream.start(engine.vocoder)
    for k in range(n):
        audio = stream.push(npz[f"{key}k{k}_flow_new_mel"], final=k == n - 1)
        yield Check(label, f"chunk{k} audio (windowed HiFT)", max_abs(audio, npz[f"{key}k{k}_yielded"]), TOL)
