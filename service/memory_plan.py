"""The process's memory budget: the limit (TTS_MEMORY_LIMIT, else the cgroup's or the machine's RAM), what the
loaded models leave of it for requests, each model's per-stream worst case and how many such streams fit; stated in the
start-up log, read by /metrics. Every model's synthesis service reserves its requests' footprints in the one StreamBudget."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from service.engine.memory import StreamBudget, headroom_bytes, memory_limit, stream_budget_bytes
from service.engine.types import SynthesisOptions
from service.families.model import Model
from service.settings import Settings

log = logging.getLogger(__name__)
MiB = 1 << 20


@dataclass(frozen=True)
class ModelMemory:
    """One served model's figures: the most one stream may hold (None: the model states none) and how many such
    streams the budget holds at once (None: no bound)."""

    model_id: str
    stream_bytes: int | None
    streams: int | None


class MemoryPlan:
    """The limit, the StreamBudget the services share, and the figures `loaded` computes once the models are in."""

    def __init__(self, settings: Settings) -> None:
        found = memory_limit(settings.memory_limit)
        self.limit, self.source = found.bytes, found.source
        self.budget = StreamBudget(None)  # unbounded until the models are loaded (only their warm-ups run before)
        self.resident = 0
        self.models: tuple[ModelMemory, ...] = ()
        self._options = SynthesisOptions(
            stream=True,
            n_timesteps=settings.engine_profile.n_timesteps,
            max_speech_s=settings.max_speech_s,
            max_sentence_speech_s=settings.max_sentence_speech_s,
        )

    def loaded(self, models: Sequence[tuple[str, Model]], resident: int) -> None:
        """Size the budget from what is `resident` with every model loaded, and log each model's per-stream worst
        case and the streams that fit."""
        self.resident = resident
        if self.limit is not None:
            self.budget.limit = stream_budget_bytes(self.limit, resident)
        self.models = tuple(self._model(model_id, model) for model_id, model in models)
        self._log()

    def _model(self, model_id: str, model: Model) -> ModelMemory:
        worst = model.worst_footprint(self._options)
        if worst is None:
            log.info("model %s states no per-stream memory bound: its requests reserve nothing", model_id)
            return ModelMemory(model_id, None, None)
        whole = model.worst_footprint(replace(self._options, stream=False))
        limit = self.budget.limit
        streams = None if limit is None else limit // max(1, worst.total)
        fits = "no memory limit" if streams is None else f"{streams} such streams fit at once"
        log.info("model %s: one stream may hold at most %s (%s); a sentence without streaming at most %d MB",
                 model_id, worst.describe(), fits, (whole.total if whole else 0) // MiB)  # fmt: skip
        return ModelMemory(model_id, worst.total, streams)

    def _log(self) -> None:
        if self.limit is None:
            log.info(
                "no memory limit (TTS_MEMORY_LIMIT empty, no cgroup limit, no /proc/meminfo): requests are not bounded by memory"
            )
            return
        log.info("memory limit %d MB (%s): %d MB resident with the models loaded, %d MB headroom, %d MB for requests",
                 self.limit // MiB, self.source, self.resident // MiB, headroom_bytes(self.limit) // MiB,
                 (self.budget.limit or 0) // MiB)  # fmt: skip
        if any(m.streams == 0 for m in self.models):
            log.warning("the memory limit leaves no room for one worst-case stream of %s: requests that may hold more "
                        "than the budget are refused (413); lower TTS_MAX_SENTENCE_SPEECH_S or raise the limit",
                        ", ".join(m.model_id for m in self.models if m.streams == 0))  # fmt: skip
