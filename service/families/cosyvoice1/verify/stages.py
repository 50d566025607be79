"""Replay the v1 model-stage fixtures (tokenizer, LLM, flow, HiFT, streaming) through a bundle's runners."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.engine.sessions import open_sessions
from service.engine.types import LLMPrompt
from service.families.cosyvoice1.contract import TOKENIZER_NAME
from service.families.cosyvoice1.flow import FlowRunner
from service.families.cosyvoice1.llm import CosyVoice1LLM
from service.families.cosyvoice1.schedule import ScheduleConfig
from service.families.cosyvoice1.streaming import RequestContext, stream_sentence
from service.families.cosyvoice1.token2wav import ReplayNoise, SentenceState, Token2Wav, WavChunk
from service.families.cosyvoice1.voice import FlowPrompt
from service.frontend import TextFrontend
from service.layers.hift import HiFTNoise, HiFTRunner, sine_excitation
from service.verify.checks import CASE, CHUNK, Check, indices, max_abs, mismatches

# Acceptance thresholds (max abs error), from the fixture README: float32 CPU re-implementation with the
# recorded randomness injected. Integer results (token ids, chunk boundaries) must match exactly.
TOL_LLM_LOGP = 1e-4
TOL_LLM_INPUT = 1e-4
TOL_FLOW_MEL = 1e-3
TOL_FLOW_STEP = 1e-4
TOL_FLOW_MU = 1e-4
TOL_HIFT_F0 = 1e-3  # Hz
TOL_HIFT_SOURCE = 1e-4
TOL_HIFT_WAV = 1e-4
# Streaming audio (flow -> cross-fades -> HiFT) is held to the HiFT bound: the tiny reference run measures
# ~2e-7, and an orchestration slip (a wrong fade or cache) moves samples by far more (audio std ~0.07).
TOL_STREAM_AUDIO = 1e-4


@dataclass
class Engines:
    """The runners one verification uses, built from one set of sessions."""

    bundle: ModelBundle
    llm: CosyVoice1LLM
    flow: FlowRunner
    hift: HiFTRunner
    sessions: dict[str, Any]

    @classmethod
    def open(cls, bundle: ModelBundle, runtime: RuntimeOptions | None = None) -> Engines:
        sessions: dict[str, Any] = dict(open_sessions(bundle, runtime))
        c = bundle.constants
        return cls(bundle, CosyVoice1LLM(sessions, c), FlowRunner(sessions, c), HiFTRunner(sessions, c), sessions)


# ---- stages -----------------------------------------------------------------------------------


def verify_tokenizer(engines: Engines, path: Path) -> Iterator[Check]:
    """Whisper BPE ids of every recorded normalized sentence must equal the official ids exactly."""
    frontend = TextFrontend.load(engines.bundle.file(TOKENIZER_NAME))
    cases = json.loads(path.read_text(encoding="utf-8"))["cases"]
    for i, case in enumerate(cases):
        got = [frontend.encode(s) for s in case["normalized_sentences"]]
        bad = sum(mismatches(g, w) > 0 for g, w in zip(got, case["ids"], strict=False))
        bad += abs(len(got) - len(case["ids"]))
        label = f"case{i} ({case['name']})" if case.get("name") else f"case{i}"
        yield Check("tokenizer", f"{label} ids", float(bad), 0.0)


def verify_llm(engines: Engines, npz: Any) -> Iterator[Check]:
    """Teacher-force the recorded speech tokens; log-probs of every decode position (prefill row first)."""
    for c in indices(npz, CASE):
        ids, emb = npz[f"case{c}_text_ids"], LLMPrompt(npz[f"case{c}_embedding"])
        if f"case{c}_prefill_lm_input" in npz.files:
            got = engines.llm.encode(ids, emb)
            yield Check("llm", f"case{c} lm_input", max_abs(got, npz[f"case{c}_prefill_lm_input"]), TOL_LLM_INPUT)
        logp = engines.llm.teacher_force(ids, emb, npz[f"case{c}_speech_ids"])
        yield Check("llm", f"case{c} logp", max_abs(logp, npz[f"case{c}_logp"]), TOL_LLM_LOGP)


def verify_flow(engines: Engines, npz: Any) -> Iterator[Check]:
    """Flow with the recorded initial noise: mu, first estimator call, final mel and the returned cache."""
    for c in indices(npz, CASE):
        key = f"case{c}_"
        mel, cache = engines.flow.inference(npz[key + "tokens"], npz[key + "embedding"], npz[key + "noise"][0])
        h, _ = engines.flow.encode(npz[key + "tokens"], npz[key + "embedding"])
        mu = engines.flow.mean(h, engines.flow.mel_frames(len(npz[key + "tokens"])))
        yield Check("flow", f"case{c} mu", max_abs(mu, npz[key + "mu"][0]), TOL_FLOW_MU)
        if key + "est_step1_out" in npz.files:
            yield Check("flow", f"case{c} estimator step 1", _estimator_error(engines, npz, key), TOL_FLOW_STEP)
        yield Check("flow", f"case{c} mel", max_abs(mel, npz[key + "mel"][0]), TOL_FLOW_MEL)
        if key + "flow_cache_out" in npz.files:
            got = np.stack([cache.z, cache.mu], axis=-1)
            yield Check("flow", f"case{c} cache", max_abs(got, npz[key + "flow_cache_out"][0]), TOL_FLOW_MU)


def _estimator_error(engines: Engines, npz: Any, key: str) -> float:
    names = ("x", "mask", "mu", "t", "spks", "cond")
    feeds = {n: np.ascontiguousarray(npz[f"{key}est_step1_in_{n}"], dtype=np.float32) for n in names}
    (v,) = engines.sessions["flow_estimator"].run(["v"], feeds)
    return max_abs(v, npz[key + "est_step1_out"])


def verify_hift(engines: Engines, npz: Any) -> Iterator[Check]:
    """HiFT: f0, the source rebuilt from f0 and the recorded noise, and the waveform from both sources."""
    hift = engines.hift
    for c in indices(npz, CASE):
        key = f"case{c}_"
        mel = npz[key + "mel"][0]
        predicted = npz[key + "f0_predicted"] if key + "f0_predicted" in npz.files else npz[key + "f0"]
        yield Check("hift", f"case{c} f0", max_abs(hift.predict_f0(mel), predicted[0]), TOL_HIFT_F0)
        noise = HiFTNoise(phase=npz[key + "phase_used"][0, :, 0], sine_noise=npz[key + "sine_noise"][0])
        source = hift.source(sine_excitation(npz[key + "f0"][0], hift.samples_per_frame, hift.constants, noise))
        want_src, want_wav = npz[key + "source"][0, 0], npz[key + "wav"][0]
        yield Check("hift", f"case{c} source (rebuilt from f0 + noise)", max_abs(source, want_src), TOL_HIFT_SOURCE)
        yield Check("hift", f"case{c} wav (recorded source)", max_abs(hift.decode(mel, want_src), want_wav), TOL_HIFT_WAV)
        yield Check("hift", f"case{c} wav (rebuilt source)", max_abs(hift.decode(mel, source), want_wav), TOL_HIFT_WAV)


class _RecordingToken2Wav(Token2Wav):
    """Token2Wav that remembers the tokens and finalize flag of every call (the chunk boundaries)."""

    def __init__(self, inner: Token2Wav) -> None:
        super().__init__(inner.flow, inner.hift, inner.constants)
        self.calls: list[tuple[list[int], bool]] = []

    def __call__(self, tokens: Any, prompt: FlowPrompt | np.ndarray, state: SentenceState, noise: Any, **kw: Any) -> WavChunk:
        self.calls.append(([int(t) for t in tokens], bool(kw.get("finalize"))))
        return super().__call__(tokens, prompt, state, noise, **kw)


def verify_stream(engines: Engines, npz: Any) -> Iterator[Check]:
    """Official-schedule streaming with the recorded noise: chunk boundaries, finalize flags, yielded audio."""
    chunks = indices(npz, CHUNK)
    noise = ReplayNoise(
        flow=[npz[f"chunk{i}_flow_noise"][0] for i in chunks],
        hift=[HiFTNoise(npz[f"chunk{i}_hift_phase_used"][0, :, 0], npz[f"chunk{i}_hift_sine_noise"][0]) for i in chunks],
    )
    c = engines.bundle.constants
    t2w = _RecordingToken2Wav(Token2Wav(engines.flow, engines.hift, c))
    ctx = RequestContext.alone(noise, ScheduleConfig.official(c), c.sample_rate)  # the official chunk boundaries
    got = list(stream_sentence(npz["tokens"].tolist(), FlowPrompt(npz["embedding"]), t2w, ctx))
    yield Check("stream", "chunk count", abs(len(got) - len(chunks)), 0.0)
    for i in chunks:
        call_tokens, finalize = t2w.calls[i] if i < len(t2w.calls) else ([], None)
        yield Check("stream", f"chunk{i} tokens", mismatches(call_tokens, npz[f"chunk{i}_token"]), 0.0)
        if "chunk_finalize" in npz.files:
            yield Check("stream", f"chunk{i} finalize", float(finalize != bool(npz["chunk_finalize"][i])), 0.0)
        audio = got[i].audio if i < len(got) else np.zeros(0, np.float32)
        yield Check("stream", f"chunk{i} samples", abs(audio.size - npz[f"chunk{i}_yielded"].size), 0.0)
        yield Check("stream", f"chunk{i} audio", max_abs(audio, npz[f"chunk{i}_yielded"][0]), TOL_STREAM_AUDIO)
    if "audio" in npz.files and got:
        whole = np.concatenate([g.audio for g in got])
        yield Check("stream", "joined audio", max_abs(whole, npz["audio"][0]), TOL_STREAM_AUDIO)
