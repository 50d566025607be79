"""The engine profile: the engine's levers (threads per stage, batching, the acoustic gate, the chunk schedule, the
prompt window, cache budgets, runtimes and kernels, flow steps), apart from the operator settings. One setting,
TTS_ENGINE_PROFILE, holds them: `lever=value` pairs separated by commas, or `@path` to a TOML file of `lever = value`
lines. The defaults are the fastest settings `make bench` found on two cores (docs/perf-log.md); docs/engine-profile.md
says what each does.
An unknown lever is refused at start."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class EngineProfile(BaseModel):
    """Every engine lever, bounded; None means the engine's or the bundle's own choice."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    inter_op_threads: int = Field(default=1, ge=1, le=64, description="ONNX Runtime inter-op threads per session.")
    llm_threads: int | None = Field(
        default=None, ge=1, le=64, description="Intra-op threads of the LLM sessions; empty = TTS_INTRA_OP_THREADS."
    )
    acoustic_threads: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="Intra-op threads of the flow/HiFT sessions; empty = TTS_INTRA_OP_THREADS (CosyVoice-300M and "
        "CosyVoice2: one-thread calls, a lone estimator call splits its two guidance rows over two threads and the "
        "vocoder calls the chunk schedule picks run on a two-thread HiFT session when no other work needs the cores; "
        "2 = off).",
    )
    max_batch: int = Field(
        default=16,
        ge=0,
        le=256,
        description="Rows the LLM scheduler thread decodes together (continuous batching); 0 = each request decodes alone.",
    )
    acoustic_slots: int = Field(
        default=1, ge=0, le=64, description="Flow/HiFT calls allowed at once (earliest deadline first); 0 = unlimited."
    )
    acoustic_nice: int = Field(
        default=0, ge=0, le=19, description="OS niceness of flow/HiFT threads so LLM steps never wait behind them; 0 = off."
    )
    first_audio_priority: bool = Field(
        default=True,
        description="Pause LLM decoding while a request's first chunk is vocoded, unless a request waits for tokens.",
    )
    decode_lead_tokens: int | None = Field(
        default=None,
        ge=0,
        le=1000,
        description="CosyVoice2: while a flow call that takes both cores runs, pause LLM decoding once every stream has "
        "this many tokens decoded ahead of its flow (one-core vocoder and small-chunk calls never pause it); empty = the "
        "schedule's (adaptive: 1, official: its largest hop, 100), 0 = never.",
    )
    acoustic_backend: Literal["auto", "ort", "openvino"] = Field(
        default="auto",
        description="Runtime of the flow estimator and HiFT where no native twin runs them: 'auto' and 'ort' = ONNX "
        "Runtime; 'openvino' = OpenVINO (not installed by requirements-lite.txt or the image: `pip install openvino`; "
        "bf16 where the CPU computes it natively, else f32). On AVX-512 BF16 CPUs a quantized bundle's twins run "
        "the estimator and HiFT's convolutions in bf16 as fast as OpenVINO did (docs/perf-log.md).",
    )
    native_kernels: Literal["auto", "no-amx", "portable", "off"] = Field(
        default="auto",
        description="Our own kernels (built by `make native`): 'auto' runs a quantized bundle's native twins where the "
        "CPU has what their kernels need: the CosyVoice2 flow estimator's attention (AVX-512 BF16, else float32 on "
        "AVX2) and int8 products, the LLM decode step's int8 products (AVX-512 VNNI, else AVX2), AMX tiles where "
        "present; else ONNX Runtime's graphs run; 'no-amx' the same without AMX tiles; 'portable' runs the twins with "
        "the kernels' portable C on any CPU (comparisons, tests); 'off' always runs ONNX Runtime's graphs.",
    )
    native_on_avx2: bool = Field(
        default=True,
        description="Whether 'auto' and 'no-amx' count our kernels' AVX2 code (AVX2 + FMA + F16C: CPUs without "
        "AVX-512, e.g. AMD Zen 2/3; the attention also on AVX-512 CPUs without BF16) as fast: true runs the native twins "
        "there; false keeps ONNX Runtime's graphs wherever a twin's deciding kernel would take its AVX2 code (as before "
        "that code existed).",
    )
    native_estimator: bool | Literal["auto"] = Field(
        default="auto",
        description="Run the flow estimator's native twin (CosyVoice-300M: its transformer blocks as EstimatorBlock "
        "calls attending over the whole window; CosyVoice2: with its cached chunk attention; Fun-CosyVoice3: its DiT "
        "blocks as DiTBlock calls): 'auto' = where "
        "native_kernels runs twins and the estimator's kernels take their AVX-512 code (on AVX2-only CPUs ONNX "
        "Runtime's int8 graph was faster: docs/perf-log.md), or the portable C when asked; true = wherever "
        "native_kernels runs twins; false = ONNX Runtime's int8 graph, or OpenVINO as acoustic_backend says.",
    )
    stream_schedule: Literal["adaptive", "official"] = Field(
        default="adaptive",
        description="How streamed sentences are cut into chunks: 'adaptive' (a small first chunk, then each chunk "
        "large enough to cover making the next, from the measured rates; CosyVoice2: a 10-token first chunk, then "
        "one 25-token attention chunk per hop) or 'official' (v1: every hop 100 tokens; CosyVoice2: 25 + pad, 50, 100).",
    )
    look_ahead_tail: bool = Field(
        default=True,
        description="CosyVoice-300M, adaptive schedule: a streamed chunk whose sentence ends within one 20-token "
        "overlap after its own tokens takes the rest along as the sentence's last (the end is learned within one "
        "decode step) instead of a last flow call over those tokens; false = that last call, as the official schedule "
        "does (CosyVoice2's early schedule always takes its 3 look-ahead tokens along).",
    )
    first_hop_tokens: int | None = Field(
        default=None,
        ge=1,
        le=400,
        description="Speech tokens the first streamed chunk consumes; empty = the schedule's own (v1: 21 adaptive, "
        "100 official; CosyVoice2: 10 adaptive, 25 + pad official). The family's minimum is checked at start: v1 "
        "needs more than its 20-token overlap (>= 21), CosyVoice2 any value >= 1 (the official schedule pads it).",
    )
    prompt_window_s: float | None = Field(
        default=1.0,
        ge=0.0,
        le=60.0,
        description="Seconds of a cloned voice's recording (the last ones, with their speech tokens) the flow sees "
        "with each streamed chunk, in both families; 'all' = the whole recording (the official computation). "
        "Non-streamed sentences always see all of it.",
    )
    flow_window_s: Annotated[float, Field(ge=1.0, le=300.0)] | Literal["auto"] | None = Field(
        default="auto",
        description="CosyVoice2 and CosyVoice3: seconds of generated speech a streamed sentence's flow keeps attending "
        "to besides the prompt (its estimator's keys and values per Euler step and guidance row: 2.3 MB per mel frame "
        "for CosyVoice2, 1.8 MB for CosyVoice3 at full size, float16): past it the oldest whole attention chunks are "
        "dropped down to half of it, so a stream's caches stay under (prompt + this + one chunk) x that; 'auto' = the "
        "family's default (CosyVoice2 2 s, CosyVoice3 4 s); 'all' = every frame (the official computation; the caches "
        "then grow with the sentence).",
    )
    flow_cache_precision: Literal["auto", "graph", "float16", "int8"] = Field(
        default="auto",
        description="CosyVoice2 and CosyVoice3: how streamed sentences' flow caches keep their frames: 'graph' = as the "
        "estimator's core graph reads them (float16 in quantized bundles, float32 in fp32 ones; the official "
        "computation), 'float16', or 'int8' with a scale per frame and head (half of float16's bytes; a quantized "
        "bundle's estimator twin reads them as they are kept, the core graph widens them for each call); 'auto' = "
        "int8 in quantized bundles, 'graph' in fp32 ones. 'graph' and 'float16' run the core graph where the twin "
        "reads int8. docs/deviations.md gives the error of each against fp32.",
    )
    acoustic_arena: Literal["shrink", "keep", "off"] = Field(
        default="shrink",
        description="ONNX Runtime's memory arena of the flow and HiFT sessions: 'shrink' gives its free chunks back "
        "after every call, 'keep' holds them for the next call (ONNX Runtime's default: the peaks of calls of every "
        "length stay resident), 'off' takes each call's tensors from the heap.",
    )
    flow_cache_mb: int | None = Field(
        default=None,
        ge=0,
        le=1 << 20,
        description="Megabytes that streamed sentences' flow caches may hold at once (CosyVoice2: every frame's keys "
        "and values, 2.3 MB per mel frame at full size, ~0.7 GB for a 5 s sentence); a sentence that would go over "
        "waits until others end (the oldest always goes on). Empty = auto: half of what the memory limit (the "
        "container's, else the machine's RAM) leaves after the model is loaded; 0 = no bound.",
    )
    ort_spinning: bool = Field(
        default=False, description="Let idle ONNX Runtime threads spin (only worth it when one graph owns the cores)."
    )
    n_timesteps: int | None = Field(
        default=None, ge=1, le=50, description="Flow-matching Euler steps; empty = the bundle's value."
    )
    prompt_mel_variant: Literal["trained", "official-24k"] = Field(
        default="trained",
        description="Prompt mel of voice cloning: `trained` = from 22,050 Hz audio, the rate the flow was trained on; "
        "`official-24k` = from 24 kHz audio as the official code does since Dec 2025 (frames 9% too fast).",
    )

    @field_validator("prompt_window_s", "flow_window_s", mode="before")
    @classmethod
    def _all_is_none(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return None if isinstance(value, str) and value.strip().lower() in ("all", "none", "") else value

    @field_validator(
        "n_timesteps", "llm_threads", "acoustic_threads", "flow_cache_mb", "first_hop_tokens", "decode_lead_tokens", mode="before"
    )
    @classmethod
    def _empty_is_default(cls, value: object) -> object:
        return None if value == "" else value


LEVERS: tuple[str, ...] = tuple(EngineProfile.model_fields)


def parse_profile(value: object) -> object:
    """TTS_ENGINE_PROFILE as the settings read it: `lever=value,lever=value`, `@path/to/profile.toml`, or (from code) a
    mapping or an EngineProfile; lever names are case-insensitive. ValueError for a malformed pair or an unreadable file."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("@"):
        return _read_file(Path(text[1:]).expanduser())
    pairs: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, lever_value = (x.strip() for x in part.partition("="))
        if not sep or not name:
            raise ValueError(f"{part!r} is not a lever=value pair (e.g. first_hop_tokens=10)")
        if name.lower() in pairs:
            raise ValueError(f"the lever {name!r} is given twice")
        pairs[name.lower()] = lever_value
    return pairs


def _read_file(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"the engine profile {path} cannot be read: {e}") from e
    return {str(k).lower(): v for k, v in data.items()}
