"""Admission by real-time capacity and by memory, as plain state: the kit's decision (service.engine.admission), its
meter on injected clocks, the process's StreamBudget, the memory limit's sources (setting, cgroup, the machine's RAM),
and the speech service's StreamGate that wires them (jobs started, queued, refused, given back)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import service.engine.memory as memory_mod
from service.engine.admission import Capacity, CapacityMeter, State, Stream, admits, expected_rate
from service.engine.host import usable_cores
from service.engine.memory import (
    CGROUP,
    HEADROOM_FLOOR,
    MACHINE,
    SETTING,
    MemoryLimit,
    StreamBudget,
    cgroup_limit_bytes,
    headroom_bytes,
    memory_limit,
    memory_limit_bytes,
    stream_budget_bytes,
)
from service.engine.options import MEMORY_LIMIT_MMAP_THRESHOLD
from service.memory_plan import MemoryPlan
from service.runtime import runtime_options
from service.settings import Settings, parse_bytes
from service.speech.admission import StreamGate
from service.speech.job import SynthesisObserver

MiB = 1 << 20


# ---- the decision ----------------------------------------------------------------------------------


def test_count_mode_admits_up_to_the_concurrency_whatever_was_measured() -> None:
    slow = Capacity({1: 0.5}, 0.5)  # measured slower than real time
    streams = (Stream(3.0, 1.0),) * 3
    assert admits(State("count", streams, concurrency=4, capacity=slow))
    assert not admits(State("count", (*streams, Stream(0.0)), concurrency=4, capacity=slow))


def test_realtime_admits_as_count_before_anything_is_measured_and_always_the_first_stream() -> None:
    streams = (Stream(0.0),) * 3
    assert admits(State("realtime", streams, concurrency=4))  # nothing measured: as today
    assert not admits(State("realtime", (*streams, Stream(0.0)), concurrency=4))  # the concurrency still bounds it
    assert admits(State("realtime", (), concurrency=4, capacity=Capacity({1: 0.2})))  # nothing to protect


def test_realtime_admits_only_while_the_expected_rate_covers_every_stream_with_the_margin() -> None:
    ahead = Stream(audio_s=5.0, playing_s=2.0)  # 3 s ahead of its listener
    measured = Capacity({1: 1.5}, cores_rate=2.6)
    # two streams: 1.5 x 2 = 3.0, capped by what the cores allow (2.6) >= 2 x 1.05
    assert admits(State("realtime", (ahead,), 8, measured))
    assert not admits(State("realtime", (ahead,), 8, Capacity({1: 1.5}, cores_rate=2.05)))  # 2.05 < 2.1
    # measured with two running: that figure decides the third
    two = Capacity({1: 1.5, 2: 2.16}, cores_rate=3.0)
    assert not admits(State("realtime", (ahead, ahead), 8, two))  # 3 streams need 3.15, 2 measured 2.16 -> at most 3.0
    assert admits(State("realtime", (ahead, ahead), 8, Capacity({1: 1.5, 2: 3.4}, cores_rate=4.0)))


def test_a_playing_stream_close_to_its_listener_holds_newcomers_back() -> None:
    fast = Capacity({1: 4.0}, cores_rate=8.0)
    assert admits(State("realtime", (Stream(3.0, 1.0),), 8, fast))
    assert not admits(State("realtime", (Stream(1.5, 1.0),), 8, fast))  # 0.5 s ahead < MIN_LEAD_S
    assert admits(State("realtime", (Stream(0.0, None),), 8, fast))  # no audio yet: nobody listens to it


def test_the_expected_rate_grows_with_streams_up_to_the_cores_and_never_past_a_measure_with_more() -> None:
    assert expected_rate(Capacity(), 1) is None
    assert expected_rate(Capacity({}, 2.5), 3) == 2.5
    assert expected_rate(Capacity({1: 1.2}), 2) == pytest.approx(2.4)  # no cores figure: in proportion
    assert expected_rate(Capacity({1: 1.2}, 2.0), 2) == 2.0
    assert expected_rate(Capacity({1: 1.2, 4: 2.16}, 9.0), 3) == pytest.approx(2.16)  # four made no more
    assert expected_rate(Capacity({2: 2.0}, 1.5), 3) == 2.0  # a cores figure below a measure never lowers it


class Clocks:
    def __init__(self) -> None:
        self.wall = 100.0
        self.cpu = 10.0

    def advance(self, wall: float, cpu: float) -> None:
        self.wall += wall
        self.cpu += cpu


def test_the_meter_measures_per_stream_count_over_whole_windows() -> None:
    clocks = Clocks()
    meter = CapacityMeter(2, window_s=2.0, smoothing=0.5, clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu)
    meter.streams(1)
    clocks.advance(1.0, 1.0)
    meter.produced(1.5)
    assert meter.capacity() == Capacity({}, None)  # a window is 2 s
    clocks.advance(1.0, 1.0)
    meter.produced(1.5)  # 3 s of audio in 2 s, on 2 CPU seconds of 2 cores
    assert meter.capacity() == Capacity({1: 1.5}, 3.0)
    meter.streams(2)  # a new count starts a new window: what came before is not its measure
    clocks.advance(2.0, 4.0)
    meter.produced(4.0)
    assert meter.capacity().by_streams == {1: 1.5, 2: 2.0}
    assert meter.capacity().cores_rate == pytest.approx(0.5 * 3.0 + 0.5 * 2.0)
    meter.streams(0)
    clocks.advance(5.0, 0.0)
    meter.produced(0.0)
    assert set(meter.capacity().by_streams) == {1, 2}  # idle time measures nothing


# ---- memory ------------------------------------------------------------------------------------------


def test_a_stream_budget_takes_what_fits_and_tells_listeners_when_bytes_come_back() -> None:
    budget = StreamBudget(250 * MiB)
    told: list[int] = []
    budget.listen(lambda: told.append(budget.used))
    a, b, c = object(), object(), object()
    assert budget.try_take(a, 100 * MiB) and budget.try_take(b, 100 * MiB)
    assert not budget.try_take(c, 100 * MiB) and budget.used == 200 * MiB
    budget.release(a)
    assert told == [100 * MiB] and budget.try_take(c, 100 * MiB) and budget.peak == 200 * MiB
    unbounded = StreamBudget(None)
    assert unbounded.try_take(a, 1 << 50)


def test_the_budget_for_requests_is_what_the_limit_leaves_after_the_models_and_the_headroom() -> None:
    assert headroom_bytes(1 << 30) == HEADROOM_FLOOR
    assert headroom_bytes(8 << 30) == int(0.1 * (8 << 30))
    assert stream_budget_bytes(2 << 30, 1 << 30) == (2 << 30) - (1 << 30) - HEADROOM_FLOOR
    assert stream_budget_bytes(1 << 30, 1 << 30) == 0


def test_the_memory_limit_setting_reads_sizes_and_refuses_nonsense() -> None:
    assert parse_bytes("2G") == 2 << 30 and parse_bytes("512Mi") == 512 << 20 and parse_bytes("1.5g") == 3 << 29
    assert parse_bytes("64k") == 64 << 10 and parse_bytes("1000") == 1000 and parse_bytes(" ") is None
    assert Settings(_env_file=None, memory_limit="2G").memory_limit == 2 << 30  # type: ignore[call-arg]
    assert Settings(_env_file=None).memory_limit is None  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="not a size"):
        Settings(_env_file=None, memory_limit="lots")  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        Settings(_env_file=None, memory_limit="-1G")  # type: ignore[call-arg]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_cgroup_limit_is_the_smallest_of_the_processs_own_cgroup_and_its_parents(tmp_path: Path) -> None:
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    _write(proc, "0::/box/job\n")
    _write(root / "box" / "memory.max", "3221225472\n")
    _write(root / "box" / "job" / "memory.max", "max\n")
    assert cgroup_limit_bytes(proc, root) == 3 << 30  # cgroup v2: a parent's limit holds for its children
    _write(proc, "4:memory:/vm/test\n0::/\n")
    _write(root / "memory" / "vm" / "test" / "memory.limit_in_bytes", str(1 << 30))
    assert cgroup_limit_bytes(proc, root) == 1 << 30  # cgroup v1
    _write(root / "memory" / "vm" / "test" / "memory.limit_in_bytes", "9223372036854771712")
    assert cgroup_limit_bytes(proc, root) is None  # "no limit"
    assert cgroup_limit_bytes(tmp_path / "missing", root) is None


def test_the_limit_is_the_setting_else_the_smaller_of_the_cgroups_and_the_machines(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server on a plain VM (no cgroup limit) keeps to the machine's RAM, as one in a container keeps to the cgroup's:
    its requests are bounded, and glibc's threshold is fixed, wherever either can be read."""
    ram: list[int | None] = [4 << 30]
    cgroup: list[int | None] = [None]
    monkeypatch.setattr(memory_mod, "_meminfo_total", lambda: ram[0])
    monkeypatch.setattr(memory_mod, "cgroup_limit_bytes", lambda: cgroup[0])
    assert memory_limit(2 << 30) == MemoryLimit(2 << 30, SETTING)  # TTS_MEMORY_LIMIT wins, even above the RAM
    assert memory_limit(None) == MemoryLimit(4 << 30, MACHINE)  # a plain 4 GB VM
    cgroup[0] = 3 << 30
    assert memory_limit(None) == MemoryLimit(3 << 30, CGROUP)  # a 3 GB container on it
    cgroup[0] = 8 << 30
    assert memory_limit(None) == MemoryLimit(4 << 30, MACHINE)  # a container allowed more than the machine has
    ram[0], cgroup[0] = None, None
    assert memory_limit(None) == MemoryLimit(None, "")  # not Linux: no bound
    assert memory_limit_bytes() is None
    ram[0] = 4 << 30
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    assert runtime_options(settings).memory_limit_bytes == 4 << 30
    assert runtime_options(settings).mmap_threshold() == MEMORY_LIMIT_MMAP_THRESHOLD
    plan = MemoryPlan(settings)
    assert (plan.limit, plan.source) == (4 << 30, MACHINE)


def test_usable_cores_follow_a_cpu_quota(tmp_path: Path) -> None:
    _write(tmp_path / "cpu.max", "100000 100000\n")
    assert usable_cores(str(tmp_path)) == 1
    _write(tmp_path / "cpu.max", "max 100000\n")
    assert usable_cores(str(tmp_path)) >= 1


# ---- the gate ----------------------------------------------------------------------------------------


class Job:
    """What the gate needs of a speech job: a cancel event (and identity)."""

    def __init__(self) -> None:
        self.cancel_event = threading.Event()


class Recorder(SynthesisObserver):
    def __init__(self) -> None:
        self.counts: list[tuple[int, int]] = []

    def queue_changed(self, waiting: int, running: int) -> None:
        self.counts.append((waiting, running))


def gate(mode: str = "count", *, concurrency: int = 4, queue_max: int = 2, budget: StreamBudget | None = None,
         meter: CapacityMeter | None = None, clock: Clocks | None = None) -> StreamGate:  # fmt: skip
    clocks = clock or Clocks()
    return StreamGate(
        concurrency=concurrency, queue_max=queue_max, mode=mode, budget=budget or StreamBudget(),  # type: ignore[arg-type]
        meter=meter or CapacityMeter(2, clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu), observer=Recorder(),
        clock=lambda: clocks.wall,
    )  # fmt: skip


def offer(g: StreamGate, nbytes: int = 0) -> tuple[Job, list[Job], bool]:
    job, started = Job(), []
    accepted = g.offer(job, nbytes, lambda: started.append(job))  # type: ignore[arg-type]
    return job, started, accepted


def test_count_mode_starts_up_to_the_concurrency_then_queues_then_refuses() -> None:
    g = gate(concurrency=2, queue_max=1)
    runs = [offer(g) for _ in range(2)]
    assert all(started and accepted for _, started, accepted in runs)
    queued, started, accepted = offer(g)
    assert accepted and not started and g.counts() == (3, 0) and g.full()
    assert not offer(g)[2]  # the queue holds one
    for job, _, _ in runs:
        g.on_worker(job)  # type: ignore[arg-type]
    assert g.counts() == (1, 2)
    g.finished(runs[0][0])  # type: ignore[arg-type]
    assert started == [queued] and not g.full()


def test_a_memory_budget_admits_exactly_what_fits_and_a_freed_stream_lets_a_queued_one_of_any_model_start() -> None:
    budget = StreamBudget(250 * MiB)  # two 100 MB requests
    first, second = gate(budget=budget, queue_max=4), gate(budget=budget, queue_max=4)
    a = offer(first, 100 * MiB)
    b = offer(second, 100 * MiB)
    c = offer(first, 100 * MiB)
    d = offer(second, 100 * MiB)
    assert a[1] and b[1] and not c[1] and not d[1] and budget.used == 200 * MiB
    second.finished(b[0])  # type: ignore[arg-type]  # the other model's stream ends: the oldest queued one goes
    assert c[1] and not d[1] and budget.used == 200 * MiB
    first.finished(a[0])  # type: ignore[arg-type]
    assert d[1]


def test_a_cancelled_queued_job_starts_at_once_to_end_without_memory() -> None:
    budget = StreamBudget(100 * MiB)
    g = gate(budget=budget)
    offer(g, 100 * MiB)
    job, started, _ = offer(g, 100 * MiB)
    job.cancel_event.set()
    g.dispatch()
    assert started == [job] and budget.used == 100 * MiB  # it reserved nothing


def test_realtime_mode_queues_a_newcomer_until_the_measured_rate_covers_it() -> None:
    clocks = Clocks()
    meter = CapacityMeter(2, window_s=2.0, clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu)
    g = gate("realtime", meter=meter, clock=clocks)
    playing, _, _ = offer(g)
    g.on_worker(playing)  # type: ignore[arg-type]
    clocks.advance(2.0, 2.0)
    g.produced(playing, 2.4)  # type: ignore[arg-type]  # 1.2 x real time alone, 2.4 with both cores busy
    clocks.advance(0.1, 0.1)
    newcomer, started, accepted = offer(g)  # 2 x 1.05 = 2.1 <= min(2.4, 2.4): and 2.3 s ahead of its listener
    assert accepted and started == [newcomer]
    g.on_worker(newcomer)  # type: ignore[arg-type]
    third, started3, accepted3 = offer(g)  # three need 3.15: expected min(1.2 x 3, 2.4) -> waits in the queue
    assert accepted3 and not started3 and g.counts() == (1, 2)
    g.finished(playing)  # type: ignore[arg-type]
    assert started3 == [third]  # one stream left: room for another
