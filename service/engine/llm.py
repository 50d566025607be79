"""The step-graph LLM every family runs: prefill, batched decode over an explicit K/V cache, sampling, forced tokens.

A family gives its prefill input (`encode`) and the step's feeds (`_run_step`); requests, batches and the decode loop
are the same for all."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.bundle import ModelConstants
from service.engine.kvcache import KVCache
from service.engine.sampling import SamplingParams, ras_sampling
from service.engine.types import LLMPrompt
from service.errors import InvalidInputError


@dataclass(eq=False)
class LLMRequest:
    """Decode state of one sequence; it is one row of a DecodeBatch between `add` and its end.

    `tokens` holds every token chosen so far (EOS is never appended); the last one is the input of
    the next decode step. `finished` turns True at EOS, at `max_len`, or when a forced sequence is
    exhausted; `stop_reason` says which.
    """

    text_len: int
    min_len: int
    max_len: int
    rng: np.random.Generator | None = None
    forced: np.ndarray | None = None  # teacher forcing: token i is forced[i] instead of a sample
    record: list[np.ndarray] | None = None  # log-prob rows seen so far (teacher forcing / verify)
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    stop_reason: str = ""
    row: int = -1  # row in its DecodeBatch, -1 when not in one
    prefill_len: int = 0
    prefill_kv: tuple[np.ndarray, np.ndarray] | None = None  # (NL, H, L, DK) each, until added

    def finish(self, reason: str) -> None:
        self.finished = True
        self.stop_reason = reason
        self.prefill_kv = None

    def accept(self, logp: np.ndarray, params: SamplingParams, eos: int) -> None:
        """Consume the log-probs (V,) of the current position: choose the next token or finish."""
        i = len(self.tokens)
        if self.record is not None:
            self.record.append(np.array(logp, dtype=np.float32, copy=True))
        if self.forced is not None:
            if i >= len(self.forced):
                self.finish("forced_end")
                return
            token = int(self.forced[i])
        elif self.rng is None:
            raise ValueError("a sampled request needs an rng")
        else:
            token = ras_sampling(logp, self.tokens, self.rng, params, eos=eos, ignore_eos=i < self.min_len)
            if token >= eos:  # EOS, or one of the stop tokens a family has after it
                self.finish("eos")
                return
        self.tokens.append(token)
        if self.forced is None and len(self.tokens) >= self.max_len:
            self.finish("max_len")


class DecodeBatch:
    """Requests decoded together by one `llm_step` call per step; rows may join and leave between steps.

    Not thread-safe: one thread (a request's generator or a scheduler) owns a batch.
    """

    def __init__(
        self,
        constants: ModelConstants,
        *,
        capacity: int = 64,
        column_step: int = 64,
        kv_dtype: type[np.floating] = np.float32,
    ) -> None:
        c = constants
        self.cache = KVCache(
            c.llm_num_layers, c.llm_num_heads, c.llm_head_dim, capacity=capacity, column_step=column_step, dtype=kv_dtype
        )
        self.requests: list[LLMRequest] = []  # requests[r].row == r

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: LLMRequest) -> None:
        """Join the batch with the request's prefill K/V; finished requests are not added."""
        if request.finished:
            return
        if request.prefill_kv is None or request.row >= 0:
            raise ValueError("request was already added to a batch")
        k, v = request.prefill_kv
        request.row = self.cache.add_row(k, v)
        request.prefill_kv = None
        self.requests.append(request)

    def remove(self, request: LLMRequest) -> None:
        """Leave the batch (finished or abandoned); the last row moves into the freed slot."""
        if request.row < 0:
            return
        row = request.row
        moved = self.cache.remove_row(row)
        if moved is not None:
            self.requests[row] = self.requests[moved]
            self.requests[row].row = row
        self.requests.pop()
        request.row = -1


def max_speech_tokens(text_len: int, constants: ModelConstants) -> int:
    """The official limit on speech tokens for `text_len` text ids (prompt text not counted): int(20 * T_txt)."""
    return int(text_len * constants.max_token_text_ratio)


def inputs_dtype(session: Any, prefixes: tuple[str, ...]) -> type[np.floating]:
    """float16 when every input of `session` whose name starts with one of `prefixes` is float16, else float32.
    Sessions without ORT's `get_inputs` (test doubles) get float32."""
    inputs = getattr(session, "get_inputs", None)
    if inputs is None:
        return np.float32
    types = {i.type for i in inputs() if i.name.startswith(prefixes)}
    return np.float16 if types == {"tensor(float16)"} else np.float32


def kv_cache_dtype(step_session: Any) -> type[np.floating]:
    """The K/V element type the decode graph takes: float16 (quantized bundles) or float32."""
    return inputs_dtype(step_session, ("past_k_", "past_v_"))


class LLMRunner(ABC):
    """Runs a family's LLM graphs; owns no request state.

    One `llm_step` graph serves prefill (the whole LM input, empty past) and decode (one embedded token per row, each
    row with its own past length); `llm_embed` embeds speech tokens. A family subclasses it: `GRAPHS` (every graph it
    needs), `_bind` (its other graphs), `encode` (the prefill input) and `_run_step` (the step's feeds).

    `sessions` maps graph names to objects with ORT's `run(output_names, feeds)`; thread-safe as long as each
    DecodeBatch is driven by one thread at a time.
    """

    GRAPHS: tuple[str, ...] = ("llm_embed", "llm_step")

    def __init__(self, sessions: Mapping[str, Any], constants: ModelConstants) -> None:
        missing = [g for g in self.GRAPHS if g not in sessions]
        if missing:
            raise ValueError(f"{type(self).__name__} needs sessions for {', '.join(missing)}")
        self.constants = constants
        self.params = SamplingParams(constants.top_p, constants.top_k, constants.win_size, constants.tau_r)
        self._embed = sessions["llm_embed"]
        self._step = sessions["llm_step"]
        self.kv_dtype = kv_cache_dtype(self._step)
        self._bind(sessions)

    def _bind(self, sessions: Mapping[str, Any]) -> None:  # noqa: B027 (a hook: most families have other graphs)
        """Take the family's other graphs from `sessions` (none by default)."""

    # ---- building requests -------------------------------------------------------------------
    @abstractmethod
    def encode(self, text_ids: Sequence[int], prompt: LLMPrompt | np.ndarray) -> np.ndarray:
        """The prefill input (L, D) float32 for `text_ids` after the voice's `prompt` (InvalidInputError for bad ids)."""

    @abstractmethod
    def _run_step(self, x: np.ndarray, past: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """llm_step over new inputs x (B, T, D) after the cached `past` -> logp (B, V), new K/V (NL, B, H, T, DK)."""

    def _empty_past(self) -> dict[str, np.ndarray]:
        c = self.constants
        empty = np.zeros((1, c.llm_num_heads, 0, c.llm_head_dim), dtype=self.kv_dtype)
        feeds: dict[str, np.ndarray] = {"past_len": np.zeros(1, dtype=np.int64)}
        for i in range(c.llm_num_layers):
            feeds[f"past_k_{i}"] = empty
            feeds[f"past_v_{i}"] = empty
        return feeds

    def _prefilled(self, request: LLMRequest, text_ids: Sequence[int], prompt: LLMPrompt | np.ndarray) -> LLMRequest:
        lm_input = self.encode(text_ids, prompt)
        logp, k, v = self._run_step(lm_input[None], self._empty_past())
        request.prefill_len = lm_input.shape[0]
        request.prefill_kv = (k[:, 0], v[:, 0])
        request.accept(logp[0], self.params, self.constants.eos_token)
        return request

    def start(
        self,
        text_ids: Sequence[int],
        prompt: LLMPrompt | np.ndarray,
        rng: np.random.Generator,
        *,
        min_tokens: int | None = None,
        max_tokens: int | None = None,
    ) -> LLMRequest:
        """Encode + prefill one request and sample its first token; add it to a DecodeBatch next.

        Limits default to the official ratios: min = int(2 * T_txt) (EOS masked before), max = int(20 * T_txt),
        where T_txt counts `text_ids` only (never the prompt text).
        """
        n = len(text_ids)
        c = self.constants
        min_len = int(n * c.min_token_text_ratio) if min_tokens is None else min_tokens
        max_len = max_speech_tokens(n, c) if max_tokens is None else max_tokens
        if min_len < 0 or max_len < 0:
            raise InvalidInputError("min_tokens and max_tokens must be >= 0")
        request = LLMRequest(text_len=n, min_len=min_len, max_len=max_len, rng=rng)
        if max_len == 0:
            self.encode(text_ids, prompt)  # still validates the inputs
            request.finish("max_len")
            return request
        return self._prefilled(request, text_ids, prompt)

    def start_forced(self, text_ids: Sequence[int], prompt: LLMPrompt | np.ndarray, speech_ids: Sequence[int]) -> LLMRequest:
        """A teacher-forced request: feeds `speech_ids` and records the N+1 log-prob rows it sees."""
        forced = np.asarray(speech_ids, dtype=np.int64).reshape(-1)
        if forced.size and (forced.min() < 0 or forced.max() >= self.constants.speech_token_size):
            raise InvalidInputError(f"speech ids must be in 0..{self.constants.speech_token_size - 1}")
        n = len(text_ids)
        request = LLMRequest(text_len=n, min_len=0, max_len=forced.size + 1, forced=forced, record=[])
        return self._prefilled(request, text_ids, prompt)

    def new_batch(self) -> DecodeBatch:
        return DecodeBatch(self.constants, kv_dtype=self.kv_dtype)

    # ---- decoding ------------------------------------------------------------------------------
    def step(self, batch: DecodeBatch) -> list[LLMRequest]:
        """One batched decode step: feed each row's last token, choose its next one.

        Returns the requests that finished in this step; they have already left the batch.
        """
        if not batch.requests:
            return []
        tokens = np.array([[r.tokens[-1]] for r in batch.requests], dtype=np.int64)
        (x,) = self._embed.run(["x"], {"token": tokens})
        logp, new_k, new_v = self._run_step(x, batch.cache.feeds())
        batch.cache.append(new_k[:, :, :, 0], new_v[:, :, :, 0])
        eos = self.constants.eos_token
        for b, request in enumerate(list(batch.requests)):
            request.accept(logp[b], self.params, eos)
        done = [r for r in batch.requests if r.finished]
        for request in done:
            batch.remove(request)
        return done

    def generate(
        self,
        text_ids: Sequence[int],
        prompt: LLMPrompt | np.ndarray,
        rng: np.random.Generator,
        *,
        min_tokens: int | None = None,
        max_tokens: int | None = None,
        cancel: threading.Event | None = None,
        urgent_tokens: int = 0,
    ) -> Iterator[int]:
        """Speech tokens (ints in 0..speech_token_size-1) until EOS, the max length, or `cancel` is set.

        `urgent_tokens` is for schedulers that serve several requests (BatchScheduler); one request alone has
        nothing to put first."""
        request = self.start(text_ids, prompt, rng, min_tokens=min_tokens, max_tokens=max_tokens)
        yield from self._drain(request, cancel)

    def teacher_force(self, text_ids: Sequence[int], prompt: LLMPrompt | np.ndarray, speech_ids: Sequence[int]) -> np.ndarray:
        """Log-probs (N+1, V) float32 seen at each decode position while feeding `speech_ids` (N tokens)."""
        request = self.start_forced(text_ids, prompt, speech_ids)
        for _ in self._drain(request, None):
            pass
        return np.stack(request.record or [])

    def _drain(self, request: LLMRequest, cancel: threading.Event | None) -> Iterator[int]:
        batch = self.new_batch()
        batch.add(request)
        emitted = 0
        try:
            while True:
                yield from request.tokens[emitted:]
                emitted = len(request.tokens)
                if request.finished:
                    return
                if cancel is not None and cancel.is_set():
                    request.finish("cancelled")
                    return
                self.step(batch)
        finally:
            batch.remove(request)
