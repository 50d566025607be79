"""Inference engine: ONNX Runtime sessions, LLM decode loop and sampling, flow, HiFT, streaming."""

from service.engine.flow import FlowCache, FlowRunner
from service.engine.hift import HiFTNoise, HiFTRunner
from service.engine.llm import DecodeBatch, LLMRequest, LLMRunner
from service.engine.sampling import SamplingParams, ras_sampling
from service.engine.sessions import RuntimeOptions, make_session_options, open_sessions
from service.engine.synthesizer import AudioChunk, StageTimings, SynthesisOptions, Synthesizer
from service.engine.token2wav import GeneratorNoise, NoiseSource, ReplayNoise, Token2Wav

__all__ = [
    "AudioChunk",
    "DecodeBatch",
    "FlowCache",
    "FlowRunner",
    "GeneratorNoise",
    "HiFTNoise",
    "HiFTRunner",
    "LLMRequest",
    "LLMRunner",
    "NoiseSource",
    "ReplayNoise",
    "RuntimeOptions",
    "SamplingParams",
    "StageTimings",
    "SynthesisOptions",
    "Synthesizer",
    "Token2Wav",
    "make_session_options",
    "open_sessions",
    "ras_sampling",
]
