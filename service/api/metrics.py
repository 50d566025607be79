"""Prometheus metrics in a per-app registry, the synthesis observer that feeds them, and the request counter."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.speech.job import SpeechTimings, SynthesisObserver
from service.stores.audio_cache import CacheStats

_LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
_RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class _CacheCollector(Collector):
    """Exports the audio cache's own counters at scrape time (the cache is built later, in the lifespan)."""

    def __init__(self) -> None:
        self.stats: CacheStats | None = None

    def collect(self) -> Iterator[Metric]:
        snap = self.stats.snapshot() if self.stats else {"hits": 0, "misses": 0, "errors": 0}
        for name, doc in (
            ("hits", "Audio cache hits"),
            ("misses", "Audio cache misses"),
            ("errors", "Audio cache backend errors"),
        ):
            family = CounterMetricFamily(f"tts_cache_{name}", doc)
            family.add_metric([], snap[name])
            yield family


class BudgetView(Protocol):
    """What the metrics read of a model's bound on its streams' growing state (service.engine.memory.StateBudget)."""

    used: int
    limit: int | None
    waiting: int


class _BudgetCollector(Collector):
    """Exports the flow-cache budget at scrape time (zeros for a model without one, such as v1)."""

    def __init__(self) -> None:
        self.budget: BudgetView | None = None

    def collect(self) -> Iterator[Metric]:
        b = self.budget
        used, limit, waiting = (b.used, b.limit or 0, b.waiting) if b is not None else (0, 0, 0)
        for name, doc, value in (
            ("tts_flow_cache_bytes", "Bytes streamed sentences' flow caches hold now (CosyVoice2)", used),
            ("tts_flow_cache_limit_bytes", "Bound on tts_flow_cache_bytes (the engine lever flow_cache_mb; 0: none)", limit),
            ("tts_flow_cache_waiting", "Streams waiting for flow cache memory before their next chunk", waiting),
        ):
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], value)
            yield family


class ReservedView(Protocol):
    """The requests' memory budget (service.engine.memory.StreamBudget)."""

    used: int
    limit: int | None


class MemoryView(Protocol):
    """What the metrics read of the process's memory plan (service.memory_plan.MemoryPlan)."""

    limit: int | None
    budget: ReservedView
    models: Sequence[ModelMemoryView]


class ModelMemoryView(Protocol):
    model_id: str
    stream_bytes: int | None
    streams: int | None


class CachesView(Protocol):
    """A served model: its id and what its caches hold now."""

    @property
    def id(self) -> str: ...

    @property
    def model(self) -> CacheHolder: ...


class CacheHolder(Protocol):
    def cache_bytes(self) -> dict[str, int]: ...


class _MemoryCollector(Collector):
    """Exports the memory budget, each model's per-stream worst case and streams that fit, and the bytes its caches
    hold now, at scrape time (nothing before the models are loaded)."""

    def __init__(self) -> None:
        self.plan: MemoryView | None = None
        self.models: Sequence[CachesView] = ()

    def collect(self) -> Iterator[Metric]:
        plan = self.plan
        if plan is None:
            return
        for name, doc, value in (
            (
                "tts_memory_limit_bytes",
                "Memory the server may use (TTS_MEMORY_LIMIT, else the cgroup's or the machine's; 0: none)",
                plan.limit or 0,
            ),
            ("tts_memory_budget_bytes", "What the limit leaves for requests after the models and a headroom (0: no bound)",
             plan.budget.limit or 0),
            ("tts_memory_reserved_bytes", "Bytes the running requests reserved (their worst cases)", plan.budget.used),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], value)
            yield gauge
        worst = GaugeMetricFamily("tts_stream_worst_case_bytes", "The most one stream of a model may hold", labels=["model"])
        fit = GaugeMetricFamily(
            "tts_streams_fit", "Worst-case streams of a model the memory budget holds at once", labels=["model"]
        )
        for m in plan.models:
            if m.stream_bytes is not None:
                worst.add_metric([m.model_id], m.stream_bytes)
            if m.streams is not None:
                fit.add_metric([m.model_id], m.streams)
        caches = GaugeMetricFamily("tts_cache_bytes", "Bytes a model's caches hold now, by kind", labels=["model", "kind"])
        for served in self.models:
            for kind, nbytes in served.model.cache_bytes().items():
                caches.add_metric([served.id, kind], nbytes)
        yield from (worst, fit, caches)


class Metrics(SynthesisObserver):
    """All metrics of one app; two apps in one process never share a registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "tts_requests", "HTTP requests by route, method and status", ["route", "method", "status"], registry=r
        )
        self.request_seconds = Histogram(
            "tts_request_seconds", "Time to the response headers, by route", ["route"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.first_chunk_hist = Histogram(
            "tts_first_chunk_seconds", "Request start to first encoded audio bytes", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.rtf = Histogram("tts_rtf", "Real-time factor: synthesis seconds per audio second", buckets=_RTF_BUCKETS, registry=r)
        self.stage_seconds = Histogram(
            "tts_stage_seconds", "Seconds per request spent in each stage", ["stage"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.audio_seconds = Counter("tts_audio_seconds", "Seconds of audio synthesized", registry=r)
        self.queue_waiting = Gauge("tts_queue_depth", "Synthesis jobs waiting for a worker", registry=r)
        self.jobs_running = Gauge("tts_jobs_running", "Synthesis jobs running on a worker", registry=r)
        self.active_streams = Gauge("tts_active_streams", "Responses being streamed to clients", registry=r)
        self.engine_chunks = Counter("tts_engine_chunks", "Audio chunks produced by the engine", registry=r)
        self.cancelled_total = Counter(
            "tts_synthesis_cancelled", "Synthesis jobs stopped early: the client went away or cancelled", registry=r
        )
        self.transport_requests = Counter(
            "tts_transport_requests",
            "gRPC calls, WebSocket sessions and DashScope tasks by transport, route and final status",
            ["transport", "route", "status"],
            registry=r,
        )
        self.transport_seconds = Histogram(
            "tts_transport_seconds", "Duration of gRPC calls, WebSocket sessions and DashScope tasks", ["transport", "route"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self._cache = _CacheCollector()
        r.register(self._cache)
        self._budget = _BudgetCollector()
        r.register(self._budget)
        self._memory = _MemoryCollector()
        r.register(self._memory)

    def watch_cache(self, stats: CacheStats) -> None:
        self._cache.stats = stats

    def watch_state_budget(self, budget: BudgetView) -> None:
        self._budget.budget = budget

    def watch_memory(self, plan: MemoryView, models: Sequence[CachesView]) -> None:
        self._memory.plan, self._memory.models = plan, models

    # SynthesisObserver overrides
    def queue_changed(self, waiting: int, running: int) -> None:
        self.queue_waiting.set(waiting)
        self.jobs_running.set(running)

    def first_chunk(self, seconds: float) -> None:
        self.first_chunk_hist.observe(seconds)

    def chunk_done(self) -> None:
        self.engine_chunks.inc()

    def finished(self, timings: SpeechTimings) -> None:
        stages = {"frontend": timings.frontend_s, "queue": timings.queue_s, "llm": timings.llm_s}
        stages |= {"flow": timings.flow_s, "hift": timings.hift_s, "encode": timings.encode_s}
        for stage, seconds in stages.items():
            self.stage_seconds.labels(stage).observe(seconds)
        self.audio_seconds.inc(timings.audio_s)
        if timings.rtf is not None:
            self.rtf.observe(timings.rtf)

    def request_done(self, transport: str, route: str, status: str, seconds: float) -> None:
        self.transport_requests.labels(transport, route, status).inc()
        self.transport_seconds.labels(transport, route).observe(seconds)

    def cancelled(self) -> None:
        self.cancelled_total.inc()


class RequestMetricsMiddleware:
    """Counts every HTTP request by route template (not raw path, to bound label values) and status."""

    def __init__(self, app: ASGIApp, metrics: Callable[[], Metrics]) -> None:
        self.app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                route = _route_of(scope)
                self._metrics().request_seconds.labels(route).observe(time.monotonic() - start)
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self._metrics().requests.labels(_route_of(scope), scope["method"], str(status["code"])).inc()


def _route_of(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"
