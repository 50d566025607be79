"""Replay the zero-shot, cross-lingual and instruct fixtures (model stages, prompted streaming, legacy prompt mel)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from service.engine.types import LLMPrompt
from service.families.cosyvoice1.schedule import ScheduleConfig
from service.families.cosyvoice1.streaming import RequestContext, stream_sentence
from service.families.cosyvoice1.token2wav import ReplayNoise, Token2Wav
from service.families.cosyvoice1.verify.stages import (
    TOL_FLOW_MEL,
    TOL_FLOW_MU,
    TOL_FLOW_STEP,
    TOL_HIFT_WAV,
    TOL_LLM_INPUT,
    TOL_LLM_LOGP,
    TOL_STREAM_AUDIO,
    Engines,
)
from service.families.cosyvoice1.voice import FlowPrompt
from service.layers.hift import HiFTNoise, HiFTRunner
from service.verify.checks import CASE, Check, indices, max_abs

MODE_FILES = ("zero_shot.npz", "cross_lingual.npz", "instruct.npz")
META_NAME = "modes_meta.json"
PROMPTS_NAME = "prompts.npz"


def _ids(npz: Any, key: str) -> tuple[int, ...]:
    return tuple(int(t) for t in npz[key]) if key in npz.files else ()


def llm_prompt(npz: Any, key: str) -> LLMPrompt:
    """The LLM inputs of one recorded case (no `mi_llm_embedding`: instruct, no speaker slot)."""
    emb = npz[key + "mi_llm_embedding"] if key + "mi_llm_embedding" in npz.files else None
    return LLMPrompt(emb, _ids(npz, key + "mi_prompt_text"), _ids(npz, key + "mi_llm_prompt_speech_token"))


def flow_prompt(npz: Any, key: str, prompt_mel: np.ndarray | None) -> FlowPrompt:
    tokens = _ids(npz, key + "flow_prompt_token")
    return FlowPrompt(npz[key + "flow_embedding"], tokens, prompt_mel if tokens else None)


def verify_mode_case(engines: Engines, npz: Any, key: str, label: str, prompt_mel: np.ndarray | None) -> Iterator[Check]:
    """LLM prefill and teacher-forced log-probs, flow mu / estimator step 1 / solver / mel, HiFT wav."""
    text = npz[key + "mi_text"]
    llm = llm_prompt(npz, key)
    got = engines.llm.encode(text, llm)
    yield Check(label, "llm lm_input", max_abs(got, npz[key + "llm_prefill_lm_input"]), TOL_LLM_INPUT)
    logp = engines.llm.teacher_force(text, llm, npz[key + "forced_tokens"])
    yield Check(label, "llm logp", max_abs(logp, npz[key + "llm_logp"]), TOL_LLM_LOGP)
    yield from verify_flow_case(engines, npz, key, label, flow_prompt(npz, key, prompt_mel))


def verify_flow_case(engines: Engines, npz: Any, key: str, label: str, prompt: FlowPrompt) -> Iterator[Check]:
    flow = engines.flow
    inp, _ = flow.prepare(npz[key + "flow_token"], prompt, npz[key + "flow_solver_noise"][0])
    yield Check(label, "flow mu", max_abs(inp.mu, npz[key + "flow_solver_mu"][0]), TOL_FLOW_MU)
    if key + "flow_est1_out" in npz.files:
        yield Check(label, "flow estimator step 1", _estimator_step1(engines, inp, npz[key + "flow_est1_out"]), TOL_FLOW_STEP)
    (full,) = flow.solve_many([inp.mu], [inp.spks], [inp.z], flow.steps(None), conds=[inp.cond])
    yield Check(label, "flow solver out", max_abs(full, npz[key + "flow_solver_out"][0]), TOL_FLOW_MEL)
    mel = full[:, inp.prompt_frames :]
    yield Check(label, "flow mel", max_abs(mel, npz[key + "flow_mel"][0]), TOL_FLOW_MEL)
    wav = engines.hift.decode(npz[key + "hift_mel"][0], npz[key + "hift_source"][0, 0])
    yield Check(label, "hift wav (recorded source)", max_abs(wav, npz[key + "hift_wav"][0]), TOL_HIFT_WAV)


def _estimator_step1(engines: Engines, inp: Any, want: np.ndarray) -> float:
    """Estimator at t=0 on the CFG batch: row 0 conditioned (mu, spks, cond), row 1 all zero."""
    zeros = np.zeros_like(inp.mu)
    feeds = {
        "x": np.stack([inp.z, inp.z]),
        "mask": np.ones((2, 1, inp.mu.shape[-1]), dtype=np.float32),
        "mu": np.stack([inp.mu, zeros]),
        "t": np.zeros(2, dtype=np.float32),
        "spks": np.stack([inp.spks, np.zeros_like(inp.spks)]),
        "cond": np.stack([inp.cond, zeros]),
    }
    (v,) = engines.sessions["flow_estimator"].run(["v"], feeds)
    return max_abs(v, want)


class _RecordedSourceHiFT(HiFTRunner):
    """HiFT whose excitation is the recorded one of each call in turn (the fixture keeps no SineGen draws)."""

    def __init__(self, inner: HiFTRunner, sources: list[np.ndarray]) -> None:
        self.__dict__.update(inner.__dict__)
        self._sources = list(sources)

    def excitation(self, mel: np.ndarray, cache_source: np.ndarray, noise: HiFTNoise) -> np.ndarray:
        return np.asarray(self._sources.pop(0), dtype=np.float32)


def verify_prompt_stream(engines: Engines, npz: Any) -> Iterator[Check]:
    """Official-schedule streaming with a zero-shot prompt: recorded flow noise and HiFT sources, yielded audio."""
    n = int(npz["stream_n_chunks"])
    c = engines.bundle.constants
    flow_noise = [npz[f"stream_chunk{i}_flow_solver_noise"][0] for i in range(n)]
    dummy = [HiFTNoise(np.zeros(c.nb_harmonics + 1, np.float32), np.zeros((0, 0), np.float32))] * n
    hift = _RecordedSourceHiFT(engines.hift, [npz[f"stream_chunk{i}_hift_source"][0, 0] for i in range(n)])
    t2w = Token2Wav(engines.flow, hift, c)
    prompt = FlowPrompt(
        npz["stream_mi_flow_embedding"], _ids(npz, "stream_mi_flow_prompt_speech_token"), npz["stream_mi_prompt_speech_feat"]
    )
    noise = _LooseReplay(flow_noise, dummy)
    ctx = RequestContext.alone(noise, ScheduleConfig.official(c), c.sample_rate)  # the official chunk boundaries
    got = list(stream_sentence(npz["stream_forced_tokens"].tolist(), prompt, t2w, ctx))
    yield Check("zero_shot stream", "chunk count", abs(len(got) - n), 0.0)
    for i in range(min(n, len(got))):
        yield Check("zero_shot stream", f"chunk{i} samples", abs(got[i].audio.size - npz[f"stream_chunk{i}_yielded"].size), 0.0)
        yield Check(
            "zero_shot stream", f"chunk{i} audio", max_abs(got[i].audio, npz[f"stream_chunk{i}_yielded"][0]), TOL_STREAM_AUDIO
        )


class _LooseReplay(ReplayNoise):
    """ReplayNoise whose HiFT draws are placeholders (the recorded-source HiFT never reads them)."""

    def hift_noise(self, n_harmonics: int, n_samples: int) -> HiFTNoise:
        return self._hift.pop(0)


def verify_modes(engines: Engines, fixtures: Path) -> Iterator[Check]:
    """Every case of zero_shot.npz, cross_lingual.npz and instruct.npz present in `fixtures`, plus the
    prompted streaming run and the legacy prompt-mel case. Prompt mels come from prompts.npz."""
    meta = json.loads((fixtures / META_NAME).read_text(encoding="utf-8"))
    with np.load(fixtures / PROMPTS_NAME) as prompts:
        mels = {k: prompts[k] for k in prompts.files if k.endswith("_mel80")}
    for name in MODE_FILES:
        mode = name.removesuffix(".npz")
        if not (fixtures / name).is_file():
            continue
        with np.load(fixtures / name) as npz:
            for c in indices(npz, CASE):
                prompt = meta[mode][c].get("prompt")
                mel = mels[f"{prompt}_mel80"] if prompt else None
                yield from verify_mode_case(engines, npz, f"case{c}_", f"{mode} case{c}", mel)
            if mode == "zero_shot" and "stream_n_chunks" in npz.files:
                yield from verify_prompt_stream(engines, npz)
            if mode == "zero_shot" and "legacy_case_prompt_feat" in npz.files:
                yield from _legacy_case(engines, npz, meta)


def _legacy_case(engines: Engines, npz: Any, meta: dict[str, Any]) -> Iterator[Check]:
    """Zero-shot case again with the 22,050 Hz prompt mel (the frame rate the flow was trained on)."""
    case = int(meta["zero_shot_legacy"]["case"])
    key = f"case{case}_"
    prompt = FlowPrompt(npz[key + "flow_embedding"], _ids(npz, key + "flow_prompt_token"), npz["legacy_case_prompt_feat"])
    flow = engines.flow
    inp, _ = flow.prepare(npz[key + "flow_token"], prompt, npz["legacy_case_flow_solver_noise"][0])
    yield Check("zero_shot legacy mel", "flow mu", max_abs(inp.mu, npz["legacy_case_flow_solver_mu"][0]), TOL_FLOW_MU)
    (full,) = flow.solve_many([inp.mu], [inp.spks], [inp.z], flow.steps(None), conds=[inp.cond])
    yield Check("zero_shot legacy mel", "flow solver out", max_abs(full, npz["legacy_case_flow_solver_out"][0]), TOL_FLOW_MEL)
    mel = full[:, inp.prompt_frames :]
    yield Check("zero_shot legacy mel", "flow mel", max_abs(mel, npz["legacy_case_flow_mel"][0]), TOL_FLOW_MEL)
    wav = engines.hift.decode(npz["legacy_case_flow_mel"][0], npz["legacy_case_hift_source"][0, 0])
    yield Check("zero_shot legacy mel", "hift wav (recorded source)", max_abs(wav, npz["legacy_case_hift_wav"][0]), TOL_HIFT_WAV)


def has_mode_fixtures(fixtures: Path) -> bool:
    return (fixtures / META_NAME).is_file() and (fixtures / PROMPTS_NAME).is_file()
