"""Fun-CosyVoice3-0.5B's bundle contract, shared with export/: its graphs and their inputs and outputs, its prompt
models and files, and the constants its manifest section holds. Imports only service.bundle (the exporter reads it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from service.bundle import SPEAKERS_NAME, FamilyLayout, Manifest
from service.errors import BundleError

FAMILY = "cosyvoice3"  # Fun-CosyVoice3-0.5B
TOKENIZER_NAME = "tokenizer.json"  # the Qwen2 byte-level BPE with CosyVoice3's 278 special tokens (`tokenizers` format)
NOISE_NAME = "flow_noise.npy"  # the flow's fixed noise buffer (80, 15000) float32 (official rand_noise)
HIFT_IO: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "hift_f0": (("mel",), ("f0",)),
    "hift_source": (("sine",), ("source",)),
    "hift_decode": (("mel", "s_stft"), ("x",)),
}
# Graphs. Templates: `{i}` one name per LLM layer, `{b}` per DiT block (counts in the manifest's `cosyvoice3` section).
GRAPH_IO: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llm_prompt": (("text_ids",), ("x",)),
    "llm_embed": (("token",), ("x",)),
    "llm_step": (("x", "past_len", "past_k_{i}", "past_v_{i}"), ("logp", "new_k", "new_v")),
    "flow_speaker": (("embedding",), ("spks",)),
    "flow_encoder": (("tokens", "context", "tail"), ("h", "tail_out")),
    "flow_estimator": (
        ("x", "mu", "t", "spks", "cond", "chunk", "start", "tails", "past_k_{b}", "past_v_{b}"),
        ("v", "tails_out", "new_k", "new_v"),
    ),
    **HIFT_IO,
}
# The prompt models: CAM++ and the 25 Hz v3 speech tokenizer (inputs feats, feats_length; output indices).
PROMPT_GRAPHS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "campplus": ("campplus.onnx", ("input",), ("output",)),
    "speech_tokenizer": ("speech_tokenizer_v3.onnx", ("feats", "feats_length"), ("indices",)),
}
LAYOUT = FamilyLayout(
    FAMILY, GRAPH_IO, PROMPT_GRAPHS, TOKENIZER_NAME, (SPEAKERS_NAME, NOISE_NAME), native_graphs=("flow_estimator", "llm_step")
)

# What the official examples put in front of every LLM text (example.py): the model was trained with it, and the
# official CosyVoice3LM refuses a prompt text ++ text without END_OF_PROMPT (llm.py:477-479).
SYSTEM_PROMPT = "You are a helpful assistant."
END_OF_PROMPT = "<|endofprompt|>"
END_OF_PROMPT_ID = 151646
# The official instruct_list (cosyvoice/utils/common.py:28-53): the instructions Fun-CosyVoice3 was trained with.
DIALECTS = (
    "广东",
    "东北",
    "甘肃",
    "贵州",
    "河南",
    "湖北",
    "湖南",
    "江西",
    "闽南",
    "宁夏",
    "山西",
    "陕西",
    "山东",
    "上海",
    "四川",
)
INSTRUCT_PRESETS: tuple[str, ...] = (
    *(f"请用{dialect}话表达。" for dialect in (*DIALECTS, "天津", "云南")),
    "Please say a sentence as loudly as possible.",
    "Please say a sentence in a very soft voice.",
    "请用尽可能慢地语速说一句话。",
    "请用尽可能快地语速说一句话。",
    "请非常开心地说一句话。",
    "请非常伤心地说一句话。",
    "请非常生气地说一句话。",
    "我想体验一下小猪佩奇风格，可以吗？",
    "你可以尝试用机器人的方式解答吗？",
)


def instruction_text(instruction: str) -> str:
    """The LLM prompt text of an instruct2 request as the official examples write it (`instruct_list`): the system
    prompt, a space, the instruction, END_OF_PROMPT (added when the instruction does not end with it already)."""
    text = instruction if instruction.startswith(SYSTEM_PROMPT) else f"{SYSTEM_PROMPT} {instruction}"
    return text if text.endswith(END_OF_PROMPT) else text + END_OF_PROMPT


@dataclass(frozen=True)
class CosyVoice3Constants:
    """CosyVoice3 facts beyond ModelConstants: its special speech ids, the flow's chunk geometry and cache shapes, the
    causal HiFT's look-ahead and how its fixed noise is regenerated.

    In a CosyVoice3 manifest ModelConstants reads: eos_token = 6561, the first id that ends an utterance (every id from
    it stops) and the one masked while the LLM is below its minimum length, as the official CosyVoice3LM does (its
    inherited sampling masks speech_token_size, which is sos here, so the real eos 6562 can end an utterance early);
    llm_num_heads = the LLM's K/V heads; token_hop_len / token_max_hop_len / stream_scale_factor = the official stream
    schedule (25, 100, 2); mel_cache_len = 0 (no vocoder overlap: the HiFT is causal).
    """

    eos: int = 6562  # the eos the LLM was trained to emit (ids 6561..6760 all stop)
    sos: int = 6561  # speech_embedding rows the prefill begins and ends with
    task: int = 6563
    stop_tokens: int = 200
    text_vocab_size: int = 151936
    chunk_tokens: int = 25  # static_chunk_size of the DiT in tokens (x token_mel_ratio frames)
    token_mel_ratio: int = 2
    pre_lookahead: int = 3  # tokens of look-ahead the PreLookaheadLayer reads past a chunk
    lookahead_channels: int = 1024  # PreLookaheadLayer's conv1 width (its conv2's left context is 2 frames of it)
    estimator_blocks: int = 22
    estimator_heads: int = 16
    estimator_head_dim: int = 64
    estimator_dim: int = 1024
    conv_pos_kernel: int = 31  # CausalConvPositionEmbedding: two convolutions, each with kernel - 1 frames of left context
    noise_frames: int = 15000
    f0_look_ahead: int = 3  # frames the causal f0 predictor reads past the frame it predicts
    conv_pre_look_ahead: int = 4  # frames HiFT's conv_pre reads past its output frame
    hift_noise_seed: int = 0  # SineGen2's uniform noise: mt19937 seeded so, after `offset` 32-bit draws (export checks
    hift_noise_offset: int = 0  # the recipe against torch), 24-bit uniforms, `samples` x (nb_harmonics + 1)
    hift_noise_samples: int = 7_200_000
    hift_noise_sha256: str = ""  # of the whole buffer (float32, little-endian, C order)
    silent_tokens: tuple[int, ...] = (1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323)  # llm_job's filter
    max_silent_run: int = 5  # a silent token after this many in a row is dropped before the flow

    def graph_counts(self) -> dict[str, int]:
        """Template counts of GRAPH_IO besides `{i}`."""
        return {"b": self.estimator_blocks}

    @property
    def conv_tail(self) -> int:
        """Frames of left context each convolution of the DiT's position embedding keeps."""
        return self.conv_pos_kernel - 1


def constants_of(manifest: Manifest) -> CosyVoice3Constants:
    """The manifest's `cosyvoice3` section as CosyVoice3Constants (BundleError when it is missing or malformed)."""
    if manifest.family != FAMILY:
        raise BundleError(f"not a CosyVoice3 bundle (family {manifest.family!r})")
    known = {f.name for f in dataclasses.fields(CosyVoice3Constants)}
    section = dict(manifest.family_section)
    unknown = sorted(set(section) - known)
    if not section or unknown:
        raise BundleError(f"manifest section {FAMILY!r} is missing or has unknown keys {unknown}")
    if "silent_tokens" in section:
        section["silent_tokens"] = tuple(int(t) for t in section["silent_tokens"])
    try:
        return CosyVoice3Constants(**section)
    except (TypeError, ValueError) as e:
        raise BundleError(f"manifest section {FAMILY!r} is malformed: {e}") from e
