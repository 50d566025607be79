"""One streamed sentence as a chunk-causal flow sees it (CosyVoice2 and later): its tokens, its flow state and hop, and
the mel chunks it gives; whether its token stream has ended."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from service.engine.chunking import Hop, Progress
from service.engine.scheduler import EndAware
from service.layers.flow_prompt import FlowPrompt

# How long a chunk's cut waits for its token stream's next delivery to learn whether the sentence has ended (one decode
# step is in flight then, a few tens of ms at batch 1; a step that does not come in time only leaves the look-ahead
# tokens to a last chunk of their own). A sentence's first chunk never waits (first audio).
TAIL_WAIT_S = 0.05


@dataclass(frozen=True)
class MelChunk:
    """A piece of a sentence's mel (80, frames) from the flow, and the seconds the flow took for it."""

    mel: np.ndarray
    final: bool
    flow_s: float
    tokens: int  # speech tokens whose frames this chunk holds
    first: bool = False  # it carries the request's first audio (chunking.first_audio): its vocoder call goes first


class EncodedState(Protocol):
    @property
    def tokens(self) -> int:
        """Tokens (prompt included) the flow has encoded so far."""
        ...


S = TypeVar("S", bound=EncodedState)


@dataclass
class Sentence(Generic[S]):
    """One sentence's streaming progress: speech tokens, flow tokens encoded, current hop."""

    prompt: FlowPrompt
    state: S
    hop: Hop
    speech: list[int]
    offset: int = 0  # speech tokens whose audio is out
    chunks: int = 0  # chunks cut so far

    @property
    def encoded(self) -> int:
        return self.state.tokens

    def progress(self, audio_s: float) -> Progress:
        """Where the sentence stands for its schedule, the request having delivered `audio_s` seconds of audio."""
        last = self.hop.tokens if self.chunks else 0
        return Progress(
            chunks=self.chunks, last_hop=last, buffered=len(self.speech) - self.offset, llm_done=False, audio_s=audio_s,
            consumed=self.offset, prompt_tokens=len(self.prompt.tokens), carry=self.hop.carry,
        )  # fmt: skip


def ended(tokens: Iterator[int], wait_s: float) -> bool:
    """Whether `tokens` will give no more, waiting up to `wait_s` to learn it (a scheduler's TokenStream can tell; a
    plain iterator cannot, and its look-ahead tokens get a last chunk of their own)."""
    return isinstance(tokens, EndAware) and tokens.ended(wait_s)
