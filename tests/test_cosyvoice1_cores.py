"""CosyVoice-300M's acoustic thread plan (as CosyVoice2's): one-thread flow/HiFT calls; a chunk the schedule lets take
both cores (a sentence's first and last) runs its estimator's two guidance rows side by side and its vocoder call on a
two-thread HiFT session, but only when the cores are free: no other acoustic call holds a slot or waits, and no decode
step competes (the scheduler has no request, or the call is a request's first audio, for which decoding steps aside).
Every precondition here is made by construction (a held gate slot, a decode step held on an event), never by timing."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.bundle import ModelBundle
from service.engine.acoustic_gate import AcousticGate
from service.engine.llm import DecodeBatch
from service.engine.options import RuntimeOptions
from service.engine.scheduler import BatchScheduler
from service.engine.sessions import open_sessions
from service.engine.types import SynthesisOptions
from service.families.cosyvoice1.engine import Synthesizer
from service.families.cosyvoice1.flow import FlowRunner
from service.families.cosyvoice1.llm import LLM_GRAPHS, CosyVoice1LLM
from service.families.cosyvoice1.schedule import ScheduleConfig
from service.layers.acoustic_plan import WIDE_HIFT_DECODE

TIMEOUT_S = 60.0
STREAM = SynthesisOptions(stream=True, seed=3)


class Recorder:
    """A session that logs (its name, the calling thread, the rows of the call) of every run."""

    def __init__(self, session: Any, name: str, log: list[tuple[str, str, int]]) -> None:
        self.session, self.name, self.log = session, name, log

    def run(self, outputs: Any, feeds: dict[str, np.ndarray]) -> Any:
        rows = len(next(iter(feeds.values())))
        self.log.append((self.name, threading.current_thread().name, rows))
        return self.session.run(outputs, feeds)


class HeldSteps(CosyVoice1LLM):
    """The tiny runner whose decode steps wait for `go`: a request stays in the scheduler's batch while it is clear.
    `stepping` is set once a decode step has begun (its request is in the batch)."""

    def __init__(self, sessions: Any, constants: Any) -> None:
        super().__init__(sessions, constants)
        self.go = threading.Event()
        self.stepping = threading.Event()

    def step(self, batch: DecodeBatch) -> list[Any]:
        self.stepping.set()
        assert self.go.wait(TIMEOUT_S), "a held decode step was never released"
        return super().step(batch)


@pytest.fixture(scope="module")
def bundle(tiny_bundle: Path) -> ModelBundle:
    return ModelBundle.load(tiny_bundle)


@pytest.fixture
def recorded(bundle: ModelBundle) -> Iterator[tuple[Synthesizer, list[tuple[str, str, int]], AcousticGate]]:
    """A synthesizer on one-thread sessions with the lanes, the wide vocoder session, a two-slot gate and an idle
    scheduler; its estimator and both HiFT decode sessions logged."""
    one = RuntimeOptions(intra_op_threads=1)
    sessions = open_sessions(bundle, one)
    log: list[tuple[str, str, int]] = []
    sessions[WIDE_HIFT_DECODE] = Recorder(open_sessions(bundle, one, names=("hift_decode",))["hift_decode"], "wide", log)
    sessions["hift_decode"] = Recorder(sessions["hift_decode"], "narrow", log)
    sessions["flow_estimator"] = Recorder(sessions["flow_estimator"], "estimator", log)
    gate = AcousticGate(2)
    scheduler = BatchScheduler(CosyVoice1LLM(sessions, bundle.constants), yield_to=gate.first_audio_running)
    hops = ScheduleConfig.official(bundle.constants).with_first_hop(21)  # 21, then 100 each: what the test expects
    synth = Synthesizer(bundle, sessions, llm=scheduler, gate=gate, cfg_lanes=True, schedule=hops)
    yield synth, log, gate
    synth.close()


def _audio(synth: Synthesizer, tokens: Sequence[int]) -> tuple[np.ndarray, int]:
    chunks = list(synth.synthesize_tokens(tokens, synth.speakers[0], STREAM))
    return np.concatenate([c.audio for c in chunks]), len(chunks)


def _calls(log: list[tuple[str, str, int]], name: str) -> list[tuple[bool, int]]:
    """(on the lane thread, rows) of each call of the session `name`, in order."""
    return [(thread.startswith("cfg-lane"), rows) for what, thread, rows in log if what == name]


def test_every_chunk_takes_both_cores_when_they_are_free(
    recorded: tuple[Synthesizer, list[tuple[str, str, int]], AcousticGate], bundle: ModelBundle
) -> None:
    """230 tokens already decoded, hops of 21 then 100: a first chunk of 41 tokens (first audio), a middle one of 120,
    the last 109, 10 Euler steps each. No decode step and no other call runs beside them, so each solves every step
    as two one-row calls, one on the lane thread, and vocodes on the wide session."""
    synth, log, gate = recorded
    tokens = np.random.default_rng(1).integers(0, bundle.constants.speech_token_size, 230).tolist()
    wide_audio, chunks = _audio(synth, tokens)
    assert chunks == 3
    steps = bundle.constants.n_timesteps
    lanes = [(False, 1), (True, 1)] * steps
    for chunk in range(3):  # the two rows of a step in either order
        assert sorted(_calls(log, "estimator")[2 * steps * chunk : 2 * steps * (chunk + 1)]) == sorted(lanes)
    assert [what for what, _, _ in log if what != "estimator"] == ["wide", "wide", "wide"]
    log.clear()
    with gate.slot(0.0):  # another request's call holds the other slot: the same chunks on one core each
        narrow_audio, _ = _audio(synth, tokens)
    assert _calls(log, "estimator") == [(False, 2)] * 3 * steps
    assert [what for what, _, _ in log if what != "estimator"] == ["narrow"] * 3
    np.testing.assert_allclose(wide_audio, narrow_audio, atol=1e-4)  # fp32: the rows are independent


def test_the_cores_are_free_only_with_no_other_call_and_no_decode_step_beside(bundle: ModelBundle) -> None:
    one = RuntimeOptions(intra_op_threads=1)
    gate, held = AcousticGate(2), HeldSteps(open_sessions(bundle, one, names=LLM_GRAPHS), bundle.constants)
    scheduler = BatchScheduler(held, yield_to=gate.first_audio_running)
    synth = Synthesizer(bundle, open_sessions(bundle, one), llm=scheduler, gate=gate)
    try:
        with gate.slot(0.0):  # the asking call's own slot
            assert synth.cores_free(False) and synth.cores_free(True)
            with gate.slot(0.0):  # a second call beside it
                assert not synth.cores_free(False) and not synth.cores_free(True)
            stream = scheduler.generate([1, 2, 3], np.zeros(bundle.constants.spk_embed_dim, np.float32), np.random.default_rng(0))
            next(stream)  # the prefill delivered its first token; the request now joins the batch for a step
            assert held.stepping.wait(TIMEOUT_S)  # it is in the batch once a step has begun (held there by `go`)
            assert scheduler.active == 1
            assert not synth.cores_free(False)  # a decode step would run beside a middle or last chunk
            assert synth.cores_free(True)  # first audio: the decode steps step aside (first_audio_priority)
            stream.close()
            held.go.set()
        without = Synthesizer(bundle, open_sessions(bundle, one), llm=held, gate=gate)  # no scheduler: nothing tells
        with gate.slot(0.0):
            assert not without.cores_free(True)
    finally:
        held.go.set()
        synth.close()


def test_the_engine_plans_one_thread_calls_unless_acoustic_threads_is_set(bundle: ModelBundle) -> None:
    """The default (acoustic_threads empty): one-thread acoustic sessions, the gate's slots as many as the threads it
    had (2), the lane thread and the wide vocoder session; acoustic_threads=2 is the previous plan (2-thread calls, one
    slot, neither)."""
    planned = Synthesizer.load(bundle, RuntimeOptions(max_batch=0))
    previous = Synthesizer.load(bundle, RuntimeOptions(max_batch=0, acoustic_threads=2))
    try:
        assert planned.gate is not None and planned.gate.slots == 2
        assert planned.token2wav.wide_hift is not None and planned.token2wav.flow.cfg_lanes
        assert previous.gate is not None and previous.gate.slots == 1
        assert previous.token2wav.wide_hift is None and not previous.token2wav.flow.cfg_lanes
    finally:
        planned.close()
        previous.close()


def test_a_lone_estimator_call_splits_only_when_no_other_call_of_its_runner_is_in_flight(bundle: ModelBundle) -> None:
    """Two solves at once on one runner, both told the cores are free: the one that finds the other's call in flight
    runs its rows as one call (the first call is held inside the estimator until the second has run)."""
    log: list[tuple[str, str, int]] = []
    inside, release = threading.Event(), threading.Event()
    sessions = dict(
        open_sessions(bundle, RuntimeOptions(intra_op_threads=1), names=("flow_encoder", "flow_lr", "flow_estimator"))
    )

    class Holding(Recorder):
        def run(self, outputs: Any, feeds: dict[str, np.ndarray]) -> Any:
            if threading.current_thread().name == "holder":
                inside.set()
                assert release.wait(TIMEOUT_S)
            return super().run(outputs, feeds)

    sessions["flow_estimator"] = Holding(sessions["flow_estimator"], "estimator", log)
    flow = FlowRunner(sessions, bundle.constants, cfg_lanes=True)
    mu, z = np.random.default_rng(0).standard_normal((2, 80, 12)).astype(np.float32)
    spks = np.zeros(80, np.float32)
    holder = threading.Thread(target=flow.solve, args=(mu, spks, z, 1), kwargs={"lanes": lambda: False}, name="holder")
    holder.start()
    try:
        assert inside.wait(TIMEOUT_S)
        flow.solve(mu, spks, z, 1, lanes=lambda: True)  # the holder's call is in flight
    finally:
        release.set()
        holder.join(TIMEOUT_S)
    assert [(thread, rows) for _, thread, rows in log] == [("MainThread", 2), ("holder", 2)]
    log.clear()
    flow.solve(mu, spks, z, 1, lanes=lambda: True)  # alone: the rows side by side
    assert sorted((thread.startswith("cfg-lane"), rows) for _, thread, rows in log) == [(False, 1), (True, 1)]
    flow.close()
