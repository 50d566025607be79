"""Continuous batching (BatchScheduler) and the acoustic gate on the tiny bundle: equality, join/leave, cancel, no deadlock."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadtest.bench_engine import ForcedLength
from service.bundle import ModelBundle
from service.engine.acoustic_gate import AcousticGate, Pacer
from service.engine.kvcache import KVCache
from service.engine.llm import DecodeBatch
from service.engine.options import RuntimeOptions
from service.engine.scheduler import BatchScheduler
from service.engine.sessions import open_sessions
from service.engine.types import SynthesisOptions
from service.errors import EngineError, ShuttingDownError
from service.families.cosyvoice1.engine import Synthesizer
from service.families.cosyvoice1.llm import LLM_GRAPHS, CosyVoice1LLM
from service.families.cosyvoice1.streaming import default_first_hop
from service.families.cosyvoice1.token2wav import ChunkJob, GeneratorNoise

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def bundle(tiny_bundle: Path) -> ModelBundle:
    return ModelBundle.load(tiny_bundle)


@pytest.fixture(scope="module")
def runner(bundle: ModelBundle) -> CosyVoice1LLM:
    return CosyVoice1LLM(open_sessions(bundle, RuntimeOptions(intra_op_threads=1), names=LLM_GRAPHS), bundle.constants)


@pytest.fixture
def scheduler(runner: CosyVoice1LLM) -> Iterator[BatchScheduler]:
    s = BatchScheduler(runner, max_batch=4)
    yield s
    s.close()


def _inputs(runner: CosyVoice1LLM, n_text: int, seed: int) -> tuple[list[int], np.ndarray]:
    g = np.random.default_rng(seed)
    return g.integers(0, 50000, size=n_text).tolist(), g.standard_normal(runner.constants.spk_embed_dim).astype(np.float32)


def _run_threads(targets: list[Any]) -> None:
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a consumer is stuck (deadlock?)"


def _wait_idle(s: BatchScheduler) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while s.active:
        assert time.monotonic() < deadline, f"scheduler still has {s.active} requests"
        time.sleep(0.01)


def test_batched_tokens_equal_unbatched(runner: CosyVoice1LLM, scheduler: BatchScheduler) -> None:
    """Sampled requests of different lengths decoded together give the tokens each gives alone."""
    cases = [(_inputs(runner, n, 30 + n), limit) for n, limit in ((4, 25), (9, 40), (2, 12), (6, 33), (3, 18), (7, 29))]
    alone = [list(runner.generate(ids, emb, np.random.default_rng(k), max_tokens=m)) for k, ((ids, emb), m) in enumerate(cases)]
    got: dict[int, list[int]] = {}

    def consume(k: int) -> None:
        (ids, emb), m = cases[k]
        got[k] = list(scheduler.generate(ids, emb, np.random.default_rng(k), max_tokens=m))

    _run_threads([lambda k=k: consume(k) for k in range(len(cases))])
    assert [got[k] for k in range(len(cases))] == alone
    assert scheduler.stats.max_rows > 1, "requests were never decoded in the same step"
    assert scheduler.stats.max_rows <= scheduler.max_batch
    assert scheduler.stats.prefills == len(cases)


def test_rows_join_and_leave_between_steps(runner: CosyVoice1LLM, scheduler: BatchScheduler) -> None:
    """A late request joins a running batch; short requests leave while long ones keep decoding."""
    ids, emb = _inputs(runner, 5, 2)
    first = scheduler.generate(ids, emb, np.random.default_rng(0), min_tokens=60, max_tokens=60)
    head = [next(first) for _ in range(10)]  # the first request is decoding
    late = list(scheduler.generate(ids, emb, np.random.default_rng(1), min_tokens=7, max_tokens=7))
    rest = list(first)
    assert len(late) == 7 and len(head) + len(rest) == 60
    assert head + rest == list(runner.generate(ids, emb, np.random.default_rng(0), min_tokens=60, max_tokens=60))
    _wait_idle(scheduler)


def test_cancel_ends_one_stream_and_spares_the_others(runner: CosyVoice1LLM, scheduler: BatchScheduler) -> None:
    ids, emb = _inputs(runner, 4, 3)
    cancel = threading.Event()
    results: dict[str, list[int]] = {}

    def cancelled() -> None:
        out = []
        for tok in scheduler.generate(ids, emb, np.random.default_rng(0), min_tokens=500, max_tokens=500, cancel=cancel):
            out.append(tok)
            if len(out) == 5:
                cancel.set()
        results["cancelled"] = out

    def full() -> None:
        results["full"] = list(scheduler.generate(ids, emb, np.random.default_rng(1), min_tokens=40, max_tokens=40))

    _run_threads([cancelled, full])
    assert 5 <= len(results["cancelled"]) < 500
    assert results["full"] == list(runner.generate(ids, emb, np.random.default_rng(1), min_tokens=40, max_tokens=40))
    _wait_idle(scheduler)


def test_kv_cache_is_given_back_when_the_batch_empties(runner: CosyVoice1LLM, scheduler: BatchScheduler) -> None:
    """A burst grows the K/V buffers (rows and columns); once its last request ends they shrink back at once,
    so the next request does not start on the burst's buffers (with 8 rows x 256 columns: 235 MB full-size)."""
    idle = scheduler.kv_cache_bytes
    ids, emb = _inputs(runner, 4, 5)

    def consume(k: int) -> None:
        list(scheduler.generate(ids, emb, np.random.default_rng(k), min_tokens=150, max_tokens=150))

    _run_threads([lambda k=k: consume(k) for k in range(3)])
    assert scheduler.stats.max_rows > 1
    _wait_idle(scheduler)
    deadline = time.monotonic() + TIMEOUT_S
    while scheduler.kv_cache_bytes > idle:  # the scheduler thread swaps the batch right after its last step
        assert time.monotonic() < deadline, f"K/V cache still holds {scheduler.kv_cache_bytes} bytes (idle: {idle})"
        time.sleep(0.01)


def test_dropped_stream_leaves_the_batch(runner: CosyVoice1LLM, scheduler: BatchScheduler) -> None:
    ids, emb = _inputs(runner, 4, 4)
    stream = scheduler.generate(ids, emb, np.random.default_rng(0), min_tokens=1000, max_tokens=1000)
    assert len([next(stream) for _ in range(3)]) == 3
    stream.close()
    assert list(stream) == []
    _wait_idle(scheduler)
    assert scheduler.stats.steps < 1000


def test_many_consumers_with_cancels_never_deadlock(runner: CosyVoice1LLM) -> None:
    scheduler = BatchScheduler(runner, max_batch=3)  # fewer rows than consumers: some wait for a free row
    counts: dict[int, int] = {}
    try:

        def consume(k: int) -> None:
            ids, emb = _inputs(runner, 3 + k % 4, k)
            cancel = threading.Event()
            n = 0
            for _ in scheduler.generate(ids, emb, np.random.default_rng(k), min_tokens=20, max_tokens=20 + k, cancel=cancel):
                n += 1
                if k % 3 == 0 and n == 4:
                    cancel.set()
            counts[k] = n

        _run_threads([lambda k=k: consume(k) for k in range(12)])
        _wait_idle(scheduler)
    finally:
        scheduler.close()
    assert all(counts[k] == (4 if k % 3 == 0 else 20 + k) for k in range(12)), counts


def test_close_ends_waiting_streams_and_refuses_new_ones(runner: CosyVoice1LLM) -> None:
    scheduler = BatchScheduler(runner, max_batch=2)
    ids, emb = _inputs(runner, 4, 5)
    stream = scheduler.generate(ids, emb, np.random.default_rng(0), min_tokens=100_000, max_tokens=100_000)
    next(stream)
    scheduler.close()
    with pytest.raises(ShuttingDownError):
        for _ in stream:
            pass
    with pytest.raises(ShuttingDownError):
        scheduler.generate(ids, emb, np.random.default_rng(0))


class _FailingOnce(CosyVoice1LLM):
    """The tiny runner, except that the first batched step raises like a broken ONNX Runtime call."""

    failed = False

    def step(self, batch: DecodeBatch) -> list[Any]:
        if not self.failed:
            self.failed = True
            raise RuntimeError("simulated ORT failure")
        return super().step(batch)


def test_a_failed_step_fails_its_batch_and_the_scheduler_keeps_serving(runner: CosyVoice1LLM, bundle: ModelBundle) -> None:
    sessions = open_sessions(bundle, RuntimeOptions(intra_op_threads=1), names=LLM_GRAPHS)
    scheduler = BatchScheduler(_FailingOnce(sessions, bundle.constants), max_batch=2)
    ids, emb = _inputs(runner, 4, 6)
    try:
        with pytest.raises(EngineError):
            list(scheduler.generate(ids, emb, np.random.default_rng(0), min_tokens=10, max_tokens=10))
        again = list(scheduler.generate(ids, emb, np.random.default_rng(0), min_tokens=10, max_tokens=10))
    finally:
        scheduler.close()
    assert again == list(runner.generate(ids, emb, np.random.default_rng(0), min_tokens=10, max_tokens=10))


def test_column_step_growth_keeps_the_cache_near_the_longest_row() -> None:
    cache = KVCache(1, 1, 2, capacity=4, column_step=4)
    first = np.arange(6, dtype=np.float32).reshape(1, 1, 3, 2)
    cache.add_row(first, first)
    capacities = []
    for step in range(10):  # lengths 4 .. 13
        col = np.full((1, 1, 1, 2), 100.0 + step, np.float32)
        cache.append(col, col)
        capacities.append(cache.capacity)
    assert capacities == [4, 8, 8, 8, 8, 12, 12, 12, 12, 16]  # next multiple of 4, not the next power of 2
    k, _ = cache.row_view(0)
    np.testing.assert_array_equal(k[0, 0, :3], first[0, 0])
    np.testing.assert_array_equal(k[0, 0, 3:, 0], 100.0 + np.arange(10))


# ---------------------------------------------------------------------------------------------
# Acoustic gate


def _queue_behind_a_holder(gate: AcousticGate, calls: list[tuple[float, bool]]) -> list[tuple[float, bool]]:
    """Hold the only slot, queue `calls` (deadline, first chunk?), release; returns the order they ran in."""
    order: list[tuple[float, bool]] = []
    holding = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with gate.slot(0.0):
            holding.set()
            release.wait(TIMEOUT_S)

    def waiter(deadline: float, first: bool) -> None:
        with gate.slot(deadline, first=first):
            order.append((deadline, first))

    hold = threading.Thread(target=holder)
    hold.start()
    holding.wait(TIMEOUT_S)
    waiters = [threading.Thread(target=waiter, args=call) for call in calls]
    for w in waiters:
        w.start()
    deadline = time.monotonic() + TIMEOUT_S
    while len(gate._waiting) < len(calls):  # all queued behind the holder
        assert time.monotonic() < deadline
        time.sleep(0.005)
    release.set()
    for t in [hold, *waiters]:
        t.join(TIMEOUT_S)
    return order


def test_gate_serves_waiters_earliest_deadline_first() -> None:
    order = _queue_behind_a_holder(AcousticGate(1), [(3.0, False), (1.0, False), (2.0, False)])
    assert [d for d, _ in order] == [1.0, 2.0, 3.0]


def test_gate_serves_first_chunks_before_overdue_streams() -> None:
    order = _queue_behind_a_holder(AcousticGate(1), [(1.0, False), (9.0, True), (5.0, True), (0.5, False)])
    assert order == [(5.0, True), (9.0, True), (0.5, False), (1.0, False)]


@pytest.mark.parametrize("slots", [1, 2, 0])
def test_gate_bounds_concurrent_calls(slots: int) -> None:
    gate = AcousticGate(slots)
    lock = threading.Lock()
    running = [0]
    peak = [0]

    def work() -> None:
        for _ in range(5):
            with gate.slot(time.monotonic()):
                with lock:
                    running[0] += 1
                    peak[0] = max(peak[0], running[0])
                time.sleep(0.01)
                with lock:
                    running[0] -= 1

    _run_threads([work] * 6)
    assert peak[0] == slots if slots else peak[0] >= 2


def test_pacer_deadline_moves_with_delivered_audio() -> None:
    pacer = Pacer(AcousticGate(1), sample_rate=100, start=10.0)
    assert pacer.deadline == 10.0
    pacer.delivered(250)
    assert pacer.deadline == pytest.approx(12.5)


# ---------------------------------------------------------------------------------------------
# Synthesizer with the scheduler


def test_scheduled_synthesizer_matches_the_direct_one(bundle: ModelBundle) -> None:
    direct = Synthesizer.load(bundle, RuntimeOptions(intra_op_threads=1, max_batch=0, acoustic_slots=0))
    batched = Synthesizer.load(bundle, RuntimeOptions(intra_op_threads=1, max_batch=4, acoustic_slots=1))
    sentences = [[15947, 1002, 13], [40, 716, 13]]
    try:
        assert isinstance(batched.llm, BatchScheduler) and not isinstance(direct.llm, BatchScheduler)
        for opts in (SynthesisOptions(seed=3), SynthesisOptions(seed=4, stream=True, first_hop_tokens=21)):
            want = [c.audio for c in direct.synthesize(sentences, direct.speakers[0], opts)]
            got: dict[int, list[np.ndarray]] = {}

            def run(k: int, opts: SynthesisOptions = opts, out: dict[int, list[np.ndarray]] = got) -> None:
                out[k] = [c.audio for c in batched.synthesize(sentences, batched.speakers[0], opts)]

            _run_threads([lambda k=k: run(k) for k in range(3)])
            for k in range(3):
                assert len(got[k]) == len(want)
                for a, b in zip(got[k], want, strict=True):
                    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    finally:
        batched.close()
        direct.close()


def test_scheduler_pauses_while_yield_to_holds_unless_a_consumer_waits(runner: CosyVoice1LLM) -> None:
    """With yield_to True, no step runs for a request nobody is reading; a blocked consumer resumes decoding."""
    urgent = threading.Event()
    s = BatchScheduler(runner, max_batch=4, yield_to=urgent.is_set)
    try:
        ids, emb = _inputs(runner, 5, 7)
        alone = list(runner.generate(ids, emb, np.random.default_rng(3), min_tokens=300, max_tokens=300))
        urgent.set()
        stream = s.generate(ids, emb, np.random.default_rng(3), min_tokens=300, max_tokens=300, urgent_tokens=1000)
        got = [next(stream)]  # waiting for the first token: the consumer's wait lets the step run
        time.sleep(0.1)
        steps = s.stats.steps
        time.sleep(0.3)  # nobody reads: the scheduler must not decode ahead
        assert s.stats.steps <= steps + 1, "decoded tokens nobody waited for while yield_to was True"
        assert s.stats.pauses > 0 and steps < 299
        got += list(stream)  # reading again (consumer blocked) makes it decode to the end
        assert got == alone
        urgent.clear()
    finally:
        s.close()


def test_gate_reports_first_audio_calls_while_they_run() -> None:
    gate = AcousticGate(1)
    assert not gate.first_audio_running()
    with gate.slot(1.0, first=True):
        assert gate.first_audio_running()
    assert not gate.first_audio_running()
    with gate.slot(1.0):
        assert not gate.first_audio_running()
    unlimited = AcousticGate(0)
    with unlimited.slot(1.0, first=True):
        assert unlimited.first_audio_running()
    assert not unlimited.first_audio_running()
    # a one-thread first-audio call (a first chunk's vocoder) is urgent at the gate but leaves the LLM running
    assert not gate.busy()
    with gate.slot(1.0, first=True, pauses_llm=False):
        assert not gate.busy() and not gate.first_audio_running()
    assert not gate.busy()


def test_gate_is_busy_only_with_calls_that_pause_the_decode_steps() -> None:
    """busy() (what the scheduler's lead policy steps aside for) counts the calls that take the cores, whichever path
    holds the slot: plain slots with and without a limit, a slot handed over by step_aside, and pooled first chunks."""
    for slots in (0, 2):
        gate = AcousticGate(slots)
        with gate.slot(1.0, pauses_llm=False):
            assert not gate.busy()
            with gate.slot(2.0):
                assert gate.busy()
            assert not gate.busy()
        assert not gate.busy()
    gate = AcousticGate(1)
    seen: list[bool] = []
    holding, go = threading.Event(), threading.Event()

    def first_audio() -> None:
        holding.wait(TIMEOUT_S)
        with gate.slot(0.0, first=True):
            seen.append(gate.busy())

    waiter = threading.Thread(target=first_audio)
    waiter.start()
    with gate.slot(5.0) as step_aside:
        assert gate.busy()
        holding.set()
        assert _wait_until(lambda: len(gate._waiting) == 1)
        step_aside()  # the first-audio call runs in between, then this call has its slot back
        assert seen == [True] and gate.busy()
    waiter.join(TIMEOUT_S)
    assert not gate.busy()
    results = []

    def execute(payloads: list[int]) -> Iterator[bool]:
        go.wait(TIMEOUT_S)
        return iter([gate.busy() for _ in payloads])

    pooled = threading.Thread(target=lambda: results.append(gate.pooled(0.0, "k", 1, execute)))
    pooled.start()
    go.set()
    pooled.join(TIMEOUT_S)
    assert results == [True] and not gate.busy()


def test_gate_is_idle_only_with_no_call_running_or_waiting() -> None:
    """idle() (whether a vocoder call may take both cores) is False while any call holds a slot, pausing the decode
    steps or not, and while one waits for a slot; a gate without slots counts nobody, so it is never idle."""
    assert not AcousticGate(0).idle()
    gate = AcousticGate(1)
    assert gate.idle()
    with gate.slot(1.0, pauses_llm=False):
        assert not gate.idle()
    assert gate.idle()
    entered = threading.Event()

    def second() -> None:
        with gate.slot(2.0):
            entered.set()

    with gate.slot(1.0):
        waiter = threading.Thread(target=second)
        waiter.start()
        assert _wait_until(lambda: len(gate._waiting) == 1)
        assert not gate.idle()
    waiter.join(TIMEOUT_S)
    assert entered.is_set() and gate.idle()


def test_gate_is_alone_with_only_the_askers_call_and_nobody_waiting() -> None:
    """alone() (asked from inside a call: may it take both cores?) is True while that call is the only one holding a
    slot and none waits; a second call holding the other slot, or one waiting for a slot, makes it False."""
    assert not AcousticGate(0).alone()
    gate = AcousticGate(2)
    with gate.slot(1.0):
        assert gate.alone()
        with gate.slot(2.0, pauses_llm=False):
            assert not gate.alone()
        assert gate.alone()
    one = AcousticGate(1)

    def second() -> None:
        with one.slot(2.0):
            pass

    with one.slot(1.0):
        waiter = threading.Thread(target=second)
        waiter.start()
        assert _wait_until(lambda: len(one._waiting) == 1)
        assert not one.alone()
    waiter.join(TIMEOUT_S)
    assert one.alone() is True  # nobody left: a call that asked now would be alone


def _wait_until(condition: Any, timeout_s: float = TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_scheduler_stays_a_lead_ahead_while_acoustic_calls_run(runner: CosyVoice1LLM) -> None:
    """With `lead_tokens` and acoustic work running, decoding pauses once the consumer has that many tokens waiting;
    each token it takes lets one more step run; with no acoustic work it decodes on. The tokens are the same."""
    busy = threading.Event()
    busy.set()
    s = BatchScheduler(runner, max_batch=4, lead_tokens=6, acoustic_busy=busy.is_set)
    try:
        ids, emb = _inputs(runner, 5, 9)
        alone = list(runner.generate(ids, emb, np.random.default_rng(5), min_tokens=60, max_tokens=60))
        stream = s.generate(ids, emb, np.random.default_rng(5), min_tokens=60, max_tokens=60)
        assert _wait_until(lambda: s.stats.pauses > 0)
        time.sleep(0.3)  # nobody reads: no step past the lead
        assert stream.ready() == 6 and s.stats.steps <= 6
        got = [next(stream) for _ in range(4)]  # 2 left ahead: decoding resumes up to 6 ahead again
        assert _wait_until(lambda: stream.ready() == 6)
        time.sleep(0.3)
        assert stream.ready() == 6
        busy.clear()  # no acoustic work: nothing to give the cores to
        assert _wait_until(lambda: stream.ready() == 56)
        got += list(stream)
        assert got == alone
    finally:
        s.close()


def test_a_stream_tells_its_end_without_taking_a_token(runner: CosyVoice1LLM) -> None:
    """`TokenStream.ended`: False while a token is buffered or none has come within the wait (a paused scheduler),
    True once the request finished and every token was taken; it never takes a token."""
    paused = threading.Event()
    paused.set()
    s = BatchScheduler(runner, max_batch=4, yield_to=paused.is_set)
    try:
        ids, emb = _inputs(runner, 5, 4)
        alone = list(runner.generate(ids, emb, np.random.default_rng(3), min_tokens=6, max_tokens=6))
        stream = s.generate(ids, emb, np.random.default_rng(3), min_tokens=6, max_tokens=6)
        assert _wait_until(lambda: stream.ready() > 0 and s.stats.pauses > 0)  # the prefill's token, then paused
        assert not stream.ended(0.0)  # a token is there
        got = [next(stream) for _ in range(stream.ready())]
        assert not stream.ended(0.05)  # paused: nothing comes within the wait
        paused.clear()
        while len(got) < 6:
            assert not stream.ended(TIMEOUT_S)  # each wait ends with the next delivery, which has a token
            got.append(next(stream))
        assert stream.ended(TIMEOUT_S) and stream.ended(0.0)
        assert got == alone and list(stream) == []
    finally:
        s.close()


def test_scheduler_calls_before_step_before_every_decode_step(runner: CosyVoice1LLM) -> None:
    """`before_step` runs on the scheduler thread once before each decode step (not before a prefill), so what it sets
    (the spread of the step's products) holds for that step."""
    seen: list[tuple[str, int]] = []
    s = BatchScheduler(runner, max_batch=4)
    s.before_step = lambda: seen.append((threading.current_thread().name, s.stats.steps))
    try:
        ids, emb = _inputs(runner, 5, 9)
        tokens = list(s.generate(ids, emb, np.random.default_rng(5), min_tokens=20, max_tokens=20))
        assert len(tokens) == 20
        assert _wait_until(lambda: s.active == 0)
        assert seen == [("llm-scheduler", i) for i in range(s.stats.steps)] and s.stats.steps >= 19
    finally:
        s.close()


def _pool_behind_a_holder(
    gate: AcousticGate, calls: list[tuple[str, int]], fail_key: str | None = None, max_group: int = 16
) -> Any:
    """Queue pooled calls (key, payload) behind a slot holder, release it; returns (results, batches run)."""
    batches: list[list[int]] = []
    results: dict[int, Any] = {}
    holding, release = threading.Event(), threading.Event()

    def holder() -> None:
        with gate.slot(0.0):
            holding.set()
            release.wait(TIMEOUT_S)

    def execute(payloads: list[int]) -> Iterator[int]:
        batches.append(list(payloads))
        for p in payloads:
            if fail_key is not None and p < 0:
                raise ValueError("boom")
            yield p * 10

    def caller(key: str, payload: int) -> None:
        try:
            results[payload] = gate.pooled(float(abs(payload)), key, payload, execute, max_group=max_group)
        except ValueError as e:
            results[payload] = e

    hold = threading.Thread(target=holder)
    hold.start()
    holding.wait(TIMEOUT_S)
    threads = [threading.Thread(target=caller, args=call) for call in calls]
    for t in threads:
        t.start()
    deadline = time.monotonic() + TIMEOUT_S
    while len(gate._waiting) < len(calls):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    release.set()
    _run_threads([])
    for t in [hold, *threads]:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads)
    return results, batches


def test_gate_pools_waiting_calls_with_the_same_key_into_one_run() -> None:
    gate = AcousticGate(1)
    results, batches = _pool_behind_a_holder(gate, [("a", 1), ("b", 2), ("a", 3), ("a", 4), ("b", 5)])
    assert results == {1: 10, 2: 20, 3: 30, 4: 40, 5: 50}
    assert sorted(map(sorted, batches)) == [[1, 3, 4], [2, 5]]  # one run per key, not one per caller
    assert not gate.first_audio_running() and not gate._waiting and not gate._pooled


def test_gate_pools_at_most_max_group_calls_per_run() -> None:
    gate = AcousticGate(1)
    results, batches = _pool_behind_a_holder(gate, [("a", 1), ("a", 2), ("a", 3), ("a", 4), ("a", 5)], max_group=2)
    assert results == {1: 10, 2: 20, 3: 30, 4: 40, 5: 50}
    assert batches == [[1, 2], [3, 4], [5]]  # in queue order, two at a time
    assert not gate.first_audio_running() and not gate._waiting and not gate._pooled


def test_gate_pooled_error_reaches_every_caller_of_the_group() -> None:
    gate = AcousticGate(1)
    results, batches = _pool_behind_a_holder(gate, [("a", 1), ("a", -2), ("a", 3)], fail_key="a")
    assert len(batches) == 1
    assert results[1] == 10  # delivered before the failure
    assert isinstance(results[-2], ValueError) and isinstance(results[3], ValueError)
    with gate.slot(0.0):  # the slot was given back
        pass


def test_first_chunks_batched_equal_one_by_one(bundle: ModelBundle) -> None:
    """Token2Wav.first_chunks on three requests matches three separate non-final calls (audio and caches)."""
    synth = Synthesizer.load(bundle, RuntimeOptions(intra_op_threads=1, max_batch=0, acoustic_slots=0))
    t2w = synth.token2wav
    g = np.random.default_rng(5)
    tokens = [tuple(int(t) for t in g.integers(0, 4096, size=41)) for _ in range(3)]
    emb = [synth.voice(s).flow for s in synth.speakers[:1]] * 3

    def jobs() -> list[ChunkJob]:
        return [ChunkJob(tokens[k], emb[k], t2w.new_state(), GeneratorNoise(np.random.default_rng(k)), 10) for k in range(3)]

    alone_jobs, pooled_jobs = jobs(), jobs()
    alone = [t2w(j.tokens, j.prompt, j.state, j.noise, finalize=False, n_timesteps=10) for j in alone_jobs]
    pooled = list(t2w.first_chunks(pooled_jobs))
    for a, b, ja, jb in zip(alone, pooled, alone_jobs, pooled_jobs, strict=True):
        assert a.audio.size and a.audio.shape == b.audio.shape
        np.testing.assert_allclose(b.audio, a.audio, atol=1e-5, rtol=0)
        np.testing.assert_allclose(jb.state.mel_overlap, ja.state.mel_overlap, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(jb.state.flow_cache.z, ja.state.flow_cache.z)
    with pytest.raises(ValueError, match="equal token counts"):
        list(t2w.first_chunks([*jobs()[:1], ChunkJob(tokens[0][:30], emb[0], t2w.new_state(), GeneratorNoise(g), 10)]))


def test_paused_scheduler_serves_only_consumers_still_waiting_for_their_first_audio(runner: CosyVoice1LLM) -> None:
    """Past `urgent_tokens`, a waiting consumer does not end the pause; it resumes once yield_to turns False."""
    urgent = threading.Event()
    s = BatchScheduler(runner, max_batch=4, yield_to=urgent.is_set)
    try:
        ids, emb = _inputs(runner, 5, 8)
        alone = list(runner.generate(ids, emb, np.random.default_rng(4), min_tokens=40, max_tokens=40))
        urgent.set()
        stream = s.generate(ids, emb, np.random.default_rng(4), min_tokens=40, max_tokens=40, urgent_tokens=10)
        got = [next(stream) for _ in range(10)]  # its first 10 tokens are urgent: served despite the pause
        done = threading.Event()

        def rest() -> None:
            got.extend(stream)
            done.set()

        reader = threading.Thread(target=rest)
        reader.start()
        assert not done.wait(0.3), "decoded past urgent_tokens while yield_to was True"
        urgent.clear()
        assert done.wait(TIMEOUT_S)
        reader.join(TIMEOUT_S)
        assert got == alone
    finally:
        s.close()


def test_only_a_requests_first_audio_is_pooled(bundle: ModelBundle) -> None:
    """Later sentences of a stream start with a fresh state but are not first audio: they take a normal turn."""
    synth = Synthesizer.load(bundle, RuntimeOptions(intra_op_threads=1, max_batch=4, acoustic_slots=1))
    try:
        assert synth.gate is not None
        pooled: list[int] = []
        original = synth.gate.pooled

        def spy(*args: Any, **kwargs: Any) -> Any:
            pooled.append(kwargs["max_group"])
            return original(*args, **kwargs)

        synth.gate.pooled = spy  # type: ignore[method-assign]
        opts = SynthesisOptions(seed=2, stream=True)
        synth.llm = ForcedLength(synth.llm, 60)
        chunks = list(synth.synthesize([[15947, 1002, 13], [40, 716, 13]], synth.speakers[0], opts))
        assert sum(1 for c in chunks if c.sentence_index == 1) >= 2  # sentence 2 was streamed in chunks too
        first_chunk = tuple(range(default_first_hop(bundle.constants) + bundle.constants.token_overlap_len))
        limit = synth.token2wav.pool_limit(first_chunk, synth.voice(synth.speakers[0]).flow)
        assert pooled == [limit]  # the first chunk's group is capped by its frames (POOLED_SOLVER_FRAMES)
    finally:
        synth.close()


@pytest.mark.parametrize("waiter_first", [True, False])
def test_long_call_steps_aside_for_first_audio_only(waiter_first: bool) -> None:
    """Between its steps a call hands the slot to a waiting first-audio call, then resumes; others wait for its end."""
    gate = AcousticGate(1)
    events: list[str] = []
    started = threading.Event()

    def long_call() -> None:
        with gate.slot(0.0) as step_aside:
            started.set()
            for i in range(30):
                events.append(f"step{i}")
                time.sleep(0.01)
                step_aside()
        events.append("long done")

    def waiter() -> None:
        with gate.slot(-1.0, first=waiter_first):
            events.append("waiter")

    long = threading.Thread(target=long_call)
    long.start()
    started.wait(TIMEOUT_S)
    time.sleep(0.05)
    _run_threads([waiter])
    long.join(TIMEOUT_S)
    at = events.index("waiter")
    if waiter_first:
        assert 0 < at < events.index("step29"), events
        assert events[-1] == "long done"
    else:
        assert events[at - 1] == "long done", events
    assert gate._busy == 0 and not gate._waiting
