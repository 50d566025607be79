"""One streamed CosyVoice2 sentence as the flow sees it (the shared service.layers.mel_stream, over CosyVoice2's flow
state)."""

from __future__ import annotations

from service.families.cosyvoice2.flow import FlowState
from service.layers import mel_stream
from service.layers.mel_stream import TAIL_WAIT_S, MelChunk, ended

__all__ = ["TAIL_WAIT_S", "MelChunk", "Sentence", "ended"]

Sentence = mel_stream.Sentence[FlowState]
